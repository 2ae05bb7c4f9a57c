// Cluster capacity and placement on this GPU (docs/design.md, "Channels-last
// one-pass"): cudaOccupancyMaxActiveClusters for clusters of 2/4/8/16 CTAs of 256 threads at
// one, two and three CTAs an SM (dynamic shared memory as the cap), then where 256 CTAs in
// clusters land on an idle GPU: how many SMs hold 1, 2, 3... CTAs, which SMs hold none, and how
// many CTAs started late (a second wave; each CTA spins ~1 ms so that a wave is co-resident).
// The cluster scheduler places whole clusters in a GPC and may give some SMs more CTAs than
// others; a plan's CTA count and shared memory decide how many fit at once. Standalone (no
// torch), sm_90 and later:
//     nvcc -O2 -arch=sm_90 -o /tmp/cluster_placement tools/cluster_placement.cu && /tmp/cluster_placement
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <vector>

// Records each CTA's SM and start time, then spins ~1 ms so that every CTA of a wave is resident.
__global__ void record_and_spin(unsigned* sm, unsigned long long* start) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) {
    unsigned id;
    unsigned long long t;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    sm[blockIdx.x] = id;
    start[blockIdx.x] = t;
    smem[0] = 1;
  }
  const long long c0 = clock64();
  while (clock64() - c0 < 2000000) {
  }
}

struct Launch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr{};
  Launch(unsigned grid, int cluster, size_t smem) {
    config.gridDim = dim3(grid);
    config.blockDim = dim3(256);
    config.dynamicSmemBytes = smem;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  Launch(const Launch&) = delete;  // config points at attr
  Launch& operator=(const Launch&) = delete;
};

// Dynamic shared memory a CTA that lets one, two or three CTAs of 256 threads on an SM (228 KB).
static size_t smem_for(int per_sm) { return (per_sm == 1 ? 200 : per_sm == 2 ? 100 : 72) * 1024; }

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(record_and_spin, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  cudaFuncSetAttribute(record_and_spin, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int cluster : {2, 4, 8, 16}) {
    for (int per_sm = 1; per_sm <= 3; ++per_sm) {
      Launch l(cluster, cluster, smem_for(per_sm));
      int n = -1;
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, record_and_spin, &l.config);
      printf("capacity: clusters of %2d at %d CTAs an SM: %d clusters (%d CTAs) %s\n", cluster, per_sm, n, n * cluster,
          e != cudaSuccess ? cudaGetErrorString(e) : "");
    }
  }
  unsigned* sm;
  unsigned long long* start;
  cudaMalloc(&sm, 4096 * sizeof(unsigned));
  cudaMalloc(&start, 4096 * sizeof(unsigned long long));
  struct Case {
    int cluster, per_sm;
    unsigned grid;
  };
  for (const Case c : {Case{8, 3, 256}, Case{8, 2, 256}, Case{16, 2, 256}, Case{16, 3, 256}, Case{8, 1, 128}, Case{4, 2, 256}}) {
    cudaDeviceSynchronize();
    usleep(20000);  // an idle GPU
    Launch l(c.grid, c.cluster, smem_for(c.per_sm));
    const cudaError_t e = cudaLaunchKernelEx(&l.config, record_and_spin, sm, start);
    cudaDeviceSynchronize();
    std::vector<unsigned> h(c.grid);
    std::vector<unsigned long long> t(c.grid);
    cudaMemcpy(h.data(), sm, c.grid * sizeof(unsigned), cudaMemcpyDeviceToHost);
    cudaMemcpy(t.data(), start, c.grid * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    unsigned long long t0 = ~0ull;
    for (auto v : t) t0 = v < t0 ? v : t0;
    std::map<unsigned, int> per;
    int late = 0;
    for (unsigned b = 0; b < c.grid; ++b) {
      per[h[b]]++;
      if (t[b] - t0 > 300000) late++;  // started after the first wave's ~1 ms
    }
    std::map<int, int> held;
    for (const auto& kv : per) held[kv.second]++;
    printf("placement: %u CTAs in clusters of %2d, at most %d an SM (%s): %zu SMs;", c.grid, c.cluster, c.per_sm,
        e != cudaSuccess ? cudaGetErrorString(e) : "launched", per.size());
    for (const auto& kv : held) printf(" %d SMs hold %d;", kv.second, kv.first);
    printf(" %d CTAs in a later wave; SMs holding none:", late);
    for (int s = 0; s < sms; ++s) {
      if (!per.count(static_cast<unsigned>(s))) printf(" %d", s);
    }
    printf("\n");
  }
  return 0;
}
