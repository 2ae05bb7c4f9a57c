// Thread block clusters (sm_90 and later): the CTAs of a cluster are scheduled together and read
// each other's shared memory. Used where one CTA is too few for a piece of work but the pieces'
// partial results must still be combined in a fixed order (deterministic) without another launch.
//
// A kernel that takes a cluster size at run time must also be correct when it is compiled for an
// architecture without clusters (FUSEDNORM_CLUSTERS == 0, e.g. sm_80 code in a multi-architecture
// build): there each CTA of a would-be cluster does the whole cluster's work on its own.

#pragma once

#include <cooperative_groups.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSEDNORM_CLUSTERS 1
#else
#define FUSEDNORM_CLUSTERS 0
#endif

namespace fusednorm {

namespace cg = cooperative_groups;

// A launch configuration of `grid` CTAs in clusters of `cluster` CTAs along x. Not copyable:
// `config` points at `attr`.
struct ClusterLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr{};

  ClusterLaunch(unsigned grid, unsigned block, size_t smem_bytes, int cluster, cudaStream_t stream = nullptr) {
    config.gridDim = dim3(grid);
    config.blockDim = dim3(block);
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cluster);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// How many clusters of `cluster` CTAs of `kernel` the current device runs at once; 0 where it
// cannot say (no clusters, or a size the kernel is not allowed). Clusters are placed within one
// GPC, so this can be well under SMs / cluster for CTAs that take a whole SM.
template <typename Kernel>
int max_active_clusters(Kernel kernel, unsigned block, size_t smem_bytes, int cluster) {
  const ClusterLaunch launch(static_cast<unsigned>(cluster), block, smem_bytes, cluster);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess) {
    (void)cudaGetLastError();  // a refused query must not surface at the next launch check
    return 0;
  }
  return clusters;
}

// Launches `kernel` on `grid` CTAs (a multiple of `cluster`) in clusters of `cluster` CTAs along x;
// a cluster of 1 is a plain launch. The caller checks that the device has clusters.
template <typename Kernel, typename... Args>
void launch_clustered(Kernel kernel, unsigned grid, unsigned block, size_t smem_bytes, int cluster,
    cudaStream_t stream, const Args&... args) {
  if (cluster <= 1) {
    kernel<<<grid, block, smem_bytes, stream>>>(args...);
  } else {
    const ClusterLaunch launch(grid, block, smem_bytes, cluster, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, args...));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusednorm
