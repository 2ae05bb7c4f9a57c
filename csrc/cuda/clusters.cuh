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

// The largest cluster every device with clusters schedules; a larger one (16 on H100 and H200)
// must be allowed per kernel, and the planner asks first whether the device runs it.
constexpr int kPortableClusterSize = 8;

// Launches `kernel` on `grid` CTAs (a multiple of `cluster`) in clusters of `cluster` CTAs along x;
// a cluster of 1 is a plain launch. The caller checks that the device has clusters (and clusters of
// that size, when over kPortableClusterSize).
template <typename Kernel, typename... Args>
void launch_clustered(Kernel kernel, unsigned grid, unsigned block, size_t smem_bytes, int cluster,
    cudaStream_t stream, const Args&... args) {
  if (cluster <= 1) {
    kernel<<<grid, block, smem_bytes, stream>>>(args...);
  } else {
    if (cluster > kPortableClusterSize) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    }
    const ClusterLaunch launch(grid, block, smem_bytes, cluster, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, args...));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#if FUSEDNORM_CLUSTERS
// Device side: a CTA's messages to the others of its cluster without a cluster-wide barrier at
// the exchange. A cg cluster sync is a release / acquire barrier: ptxas puts a MEMBAR.ALL.GPU
// before its arrival, which waits on the thread's outstanding memory operations, and a CTA had
// to wait for the slowest one of its cluster before it left. Here each receiving CTA counts the
// bytes stored into its shared memory on an mbarrier (st.async completes them, as TMA copies do),
// and waits only for those (docs/design.md, "Cluster path").

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread, at the kernel's start: `bar` expects `bytes` from the cluster's st.async stores
// (cluster_store); then every thread arrives at the cluster's barrier (relaxed: no fence), and
// waits on it (cluster_wait) before its first store into another CTA, whose barrier must exist.
__device__ __forceinline__ void init_receive_barrier(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait;" ::: "memory");
}

// Stores v at `dst` and completes its 8 bytes on `bar`, both this CTA's addresses taken in CTA
// `rank` of the cluster (itself included).
__device__ __forceinline__ void cluster_store(float2 v, const void* dst, const uint64_t* bar, int rank) {
  uint32_t remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_dst) : "r"(shared_address(dst)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(shared_address(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(remote_dst),
               "f"(v.x), "f"(v.y), "r"(remote_bar)
               : "memory");
}

// Returns once `bar`'s first phase is complete: every byte it expected has been stored.
__device__ __forceinline__ void wait_received(const uint64_t* bar) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar))
        : "memory");
  } while (!done);
}
#endif

}  // namespace fusednorm
