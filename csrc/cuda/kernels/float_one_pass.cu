// float: the kernels of the one-pass forward, paths Registers, Shared and Cluster (paths.h). One
// translation unit per path and dtype, compiled in parallel, or together in kernels/float.cu on
// machines with few cores (docs/design.md, "Source layout").
#include "cuda/clusters.cuh"
#include "cuda/group_norm_one_pass.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_shared_kernel.cuh"

#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <array>

namespace fusednorm {

// Whether the device schedules clusters of 16 CTAs of kOnePassCtaBytes (H100's non-portable
// maximum; 8 is the portable one). Asked once per device.
bool clusters_of_16(const cudaDeviceProp& prop) {
  static std::array<int, 64> known{};  // 0: not asked yet, 1: no, 2: yes
  const int device = c10::cuda::current_device();
  if (device >= static_cast<int>(known.size())) return false;
  if (known[device] == 0) {
    bool ok = false;
    if (prop.major >= 9) {
      auto kernel = group_norm_one_pass_kernel<float, 4, Activation::None>;
      ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
           cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOnePassCtaBytes) == cudaSuccess;
      ok = ok && max_active_clusters(kernel, kOnePassThreads, kOnePassCtaBytes, 16) > 0;
      (void)cudaGetLastError();  // a refused attribute must not surface at the next launch check
    }
    known[device] = ok ? 2 : 1;
  }
  return known[device] == 2;
}

}  // namespace fusednorm

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(float);
