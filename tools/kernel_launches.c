// Which CUDA kernels a process launches (tools/kernel_coverage.sh). An LD_PRELOAD library: writes the
// (mangled) name of every kernel the process launches, once, to
// $KERNEL_LAUNCH_DIR/kernels.<pid>. <<<>>> launches resolve their kernel once through __cudaGetKernel;
// cooperative and cluster launches pass the host stub to cudaLaunchCooperativeKernel / cudaLaunchKernelExC.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int cudaError_t;
typedef struct { unsigned x, y, z; } dim3;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

// The real function: from the libcudart already loaded (it may be in a local scope), else next.
static void* real_symbol(const char* name) {
  void* lib = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  void* f = lib ? dlsym(lib, name) : NULL;
  return f ? f : dlsym(RTLD_NEXT, name);
}
static const void* seen[1 << 16];

static void record(const void* fun) {
  pthread_mutex_lock(&mu);
  size_t h = ((uintptr_t)fun >> 4) & ((1 << 16) - 1);
  while (seen[h] && seen[h] != fun) h = (h + 1) & ((1 << 16) - 1);
  int fresh = seen[h] == NULL;
  seen[h] = fun;
  pthread_mutex_unlock(&mu);
  if (!fresh) return;
  static cudaError_t (*get_name)(const char**, const void*) = NULL;
  if (!get_name) get_name = (cudaError_t(*)(const char**, const void*))real_symbol("cudaFuncGetName");
  const char* name = NULL;
  if (!get_name || get_name(&name, fun) != 0 || !name) name = "?";
  const char* dir = getenv("KERNEL_LAUNCH_DIR");
  if (!dir) return;
  char path[4096];
  snprintf(path, sizeof path, "%s/kernels.%d", dir, (int)getpid());
  FILE* f = fopen(path, "a");
  if (f) { fprintf(f, "%s\n", name); fclose(f); }
}

cudaError_t __cudaGetKernel(void** kernel, const void* fun) {
  static cudaError_t (*real)(void**, const void*) = NULL;
  if (!real) real = (cudaError_t(*)(void**, const void*))real_symbol("__cudaGetKernel");
  cudaError_t r = real(kernel, fun);
  record(fun);
  return r;
}

cudaError_t cudaLaunchCooperativeKernel(const void* func, dim3 g, dim3 b, void** args, size_t smem, void* stream) {
  static cudaError_t (*real)(const void*, dim3, dim3, void**, size_t, void*) = NULL;
  if (!real) real = (cudaError_t(*)(const void*, dim3, dim3, void**, size_t, void*))real_symbol("cudaLaunchCooperativeKernel");
  record(func);
  return real(func, g, b, args, smem, stream);
}

cudaError_t cudaLaunchKernelExC(const void* config, const void* func, void** args) {
  static cudaError_t (*real)(const void*, const void*, void**) = NULL;
  if (!real) real = (cudaError_t(*)(const void*, const void*, void**))real_symbol("cudaLaunchKernelExC");
  record(func);
  return real(config, func, args);
}
