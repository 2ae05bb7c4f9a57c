// Programmatic dependent launch (sm_90; docs/design.md, "Sweep path"): a kernel launched as a
// programmatic dependent of the one before it on the stream may start once every CTA of that one
// has called launch_dependents() (or ended), and waits in wait_for_primary() until that kernel
// has finished and its writes are visible. Compiled for older architectures both are no-ops, and
// launch_maybe_dependent launches an ordinary kernel there.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace fusednorm {
namespace {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, 0, stream>>>(args) as a programmatic dependent of the stream's
// previous kernel where the device has programmatic dependent launch and the kernel's code waits
// for it (built for sm_90 on: PTX of an older architecture, compiled for this device at load
// time, has no wait), else as an ordinary kernel.
template <typename Kernel, typename... Args>
void launch_maybe_dependent(Kernel kernel, unsigned grid, unsigned block, cudaStream_t stream, const Args&... args) {
  bool dependent = false;
  if (at::cuda::getCurrentDeviceProperties()->major >= 9) {
    cudaFuncAttributes attrs{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kernel));
    dependent = attrs.ptxVersion >= 90;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace
}  // namespace fusednorm
