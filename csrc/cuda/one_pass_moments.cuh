// The moments of a group that one CTA holds, or a cluster of CTAs holds between them, from each
// thread's sums of its own elements (docs/design.md, "Shifted moments and Chan merges", "Cluster
// path"): block sums in a fixed order (of one group, or of up to kMaxColsSpan groups at once), the
// two-step Chan merge of the threads' shifted sums (block_moments_of_shifted_sums, cta_part_moments),
// the cluster's exchange and merge of its CTAs' parts over distributed shared memory
// (one_pass_cluster_moments), and a CTA's merge of a group's parts from global memory
// (parts_moments: the team forward's ranks, the output sweep's tiles). The one-pass kernels share
// them with the team, sweep and one-CTA backward kernels, which include this header rather than
// the one-pass kernels'.
// kOnePassThreads, the one-pass kernels' CTA size, is here because the block sums are sized by it.

#pragma once

#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/moments.cuh"

#include <cstdint>

namespace fusednorm {
namespace {

constexpr int kOnePassThreads = 256;

// Sum of v over the CTA (whole warps, at most MaxThreads threads; smem holds one value a warp), in
// a fixed order; every thread gets the total. kReused: smem serves the next sum too, so a barrier
// after the reads keeps a fast warp's next write from overtaking them; a caller whose sums each
// have smem of their own, read once, skips it.
template <int MaxThreads = kOnePassThreads, bool kReused = true, typename acc_t>
__device__ __forceinline__ acc_t one_pass_block_sum(acc_t v, acc_t* smem) {
  v = segment_sum(v, kWarp);
  if ((threadIdx.x & (kWarp - 1)) == 0) smem[threadIdx.x >> kLogWarp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> kLogWarp);
  acc_t total = acc_t(0);
#pragma unroll
  for (int w = 0; w < MaxThreads / kWarp; ++w) {
    if (w < warps) total += smem[w];
  }
  if constexpr (kReused) __syncthreads();
  return total;
}

// The CTA's mean and M2 of x - K from each thread's sums of its own nt elements, q1 = sum (x - T)
// and q2 = sum (x - T)^2, T the thread's own shift (its first element; docs/design.md, "Numerics"):
// the two-step form of Chan's merge in two block sums, first the mean of x - K (nt * (T - K) + q1
// a thread), then M2 (the thread's q2 - q1^2 / nt plus nt times its mean's squared distance from
// the CTA's). With T among the thread's own few elements, q2 - q1^2 / nt loses digits only to
// an outlier there; a shift K far from the data (a group whose first element is an outlier) costs
// the mean's absolute digits only as the sums of x - K always did, and no second pass is needed
// whatever the data. `tk` = T - K; `count` = the CTA's elements (sum of nt).
template <typename acc_t>
struct BlockMoments {
  acc_t mean, m2;  // of x - K
};

template <int MaxThreads, typename acc_t>
__device__ __forceinline__ BlockMoments<acc_t> block_moments_of_shifted_sums(
    acc_t nt, acc_t tk, acc_t q1, acc_t q2, acc_t count, acc_t* smem) {
  BlockMoments<acc_t> r;
  r.mean = one_pass_block_sum<MaxThreads>(nt > acc_t(0) ? nt * tk + q1 : acc_t(0), smem);
  r.mean = count > acc_t(0) ? r.mean / count : acc_t(0);
  acc_t c = acc_t(0);
  if (nt > acc_t(0)) {
    const acc_t mt = q1 / nt;          // the thread's mean of x - T
    const acc_t d = tk + mt - r.mean;  // its mean's distance from the CTA's
    c = (q2 - q1 * mt) + nt * d * d;
  }
  r.m2 = one_pass_block_sum<MaxThreads>(c, smem);
  return r;
}

// A part's moments of x - K: count, mean and M2 (a team rank's chunk, an output sweep tile), as
// parts_moments reads them.
template <typename acc_t>
struct ChunkMoments {
  acc_t n, mean, m2;
};

// The mean and M2 of x - K over a group of `count` elements from its parts' moments, one (count,
// mean, M2) a part (`load` reads part r; thread t of the CTA's Threads takes parts t, t + Threads,
// ...): the team forward's ranks, the output sweep's tiles. Merged by sums rather than Chan's
// pairwise merges: the mean is the sum of each part's count * mean over `count`, M2 the sum of
// each part's M2 and count * (its mean - the mean)^2, every term nonnegative (as
// block_moments_of_shifted_sums merges a CTA's threads). Two CTA sums of additions, where the
// merges' chain (five butterfly steps, then the warps' states in turn, a division each) sat on the
// team's every round (docs/design.md, "Team path"). A butterfly sum gives both lanes of a pair the
// same bits (addition commutes) and every thread adds the warps' sums in warp order, so every CTA
// gets the same bits. A thread keeps its first part in registers for the second sum (the team's
// parts come from L2; a team has at most Threads ranks). `smem`: 2 * Threads / kWarp values,
// written again only after a later __syncthreads.
template <int Threads, typename acc_t, typename Load>
__device__ __forceinline__ BlockMoments<acc_t> parts_moments(int parts, acc_t count, const Load& load, acc_t* smem) {
  const int tid = static_cast<int>(threadIdx.x);
  const ChunkMoments<acc_t> c = tid < parts ? load(tid) : ChunkMoments<acc_t>{};
  const int warps = (imin(parts, Threads) + kWarp - 1) >> kLogWarp;  // the warps holding parts
  const auto sum = [&](acc_t v, acc_t* at) {
    v = segment_sum(v, kWarp);
    if ((tid & (kWarp - 1)) == 0) at[tid >> kLogWarp] = v;
    __syncthreads();
    v = at[0];
    for (int w = 1; w < warps; ++w) v += at[w];
    return v;
  };
  acc_t s = c.n * c.mean;
  for (int r = tid + Threads; r < parts; r += Threads) {
    const ChunkMoments<acc_t> p = load(r);
    s += p.n * p.mean;
  }
  BlockMoments<acc_t> m;
  m.mean = sum(s, smem) / count;
  const acc_t d = c.mean - m.mean;
  acc_t q = c.m2 + c.n * d * d;
  for (int r = tid + Threads; r < parts; r += Threads) {
    const ChunkMoments<acc_t> p = load(r);
    const acc_t e = p.mean - m.mean;
    q += p.m2 + p.n * e * e;
  }
  m.m2 = sum(q, smem + Threads / kWarp);  // other slots: no barrier between the sums
  return m;
}

// Most adjacent groups a CTA of group_norm_cols_one_pass_kernel takes at once (its `span`).
constexpr int kMaxColsSpan = 4;
// A cluster's slots (span * cluster: clusters of 8 at any span, of 16 at span 2) in a warp:
// one_pass_cluster_moments (launch_cols_one_pass asserts it).
static_assert(8 * kMaxColsSpan <= kWarp, "a cluster's slots in a warp: one_pass_cluster_moments");

// one_pass_block_sum for `span` <= kMaxColsSpan sums at once: each thread adds v into slot `slot`
// and gets that slot's total (smem holds kMaxColsSpan values a warp). Fixed order, as the single
// sum; with span 1 it is one_pass_block_sum.
template <typename acc_t>
__device__ __forceinline__ acc_t one_pass_slot_sum(acc_t v, int slot, int span, acc_t* smem) {
  constexpr int kWarps = kOnePassThreads / kWarp;
#pragma unroll
  for (int q = 0; q < kMaxColsSpan; ++q) {
    if (q < span) {
      const acc_t u = segment_sum(slot == q ? v : acc_t(0), kWarp);
      if ((threadIdx.x & (kWarp - 1)) == 0) smem[q * kWarps + (threadIdx.x >> kLogWarp)] = u;
    }
  }
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> kLogWarp);
  acc_t total = acc_t(0);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warps) total += smem[slot * kWarps + w];
  }
  __syncthreads();
  return total;
}

// Adds a pack's x - T to q1 and their squares to q2: a thread's shifted sums, T its first element,
// for block_moments_of_shifted_sums (docs/design.md, "Shifted moments and Chan merges").
template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ void add_shifted_sums(const Pack<scalar_t, V>& p, acc_t T, acc_t& q1, acc_t& q2) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t d = pack_element<acc_t>(p, j) - T;
    q1 += d;
    q2 += d * d;
  }
}

// A CTA's part of a group for the cluster's merge (one_pass_cluster_moments): its elements' sum
// of x - K and their M2 about their own mean.
template <typename acc_t>
struct PartMoments {
  acc_t sum, m2;
};

// What a CTA of a cluster receives from the others for one_pass_cluster_moments: slots[r * span +
// q] holds rank r's (sum, M2) of slot q, stored there by rank r; `bar` counts their bytes. Every
// thread calls begin() at the kernel's start, long before the exchange.
struct ClusterExchange {
  float2 slots[kWarp];
  uint64_t bar;

  __device__ __forceinline__ void begin(int cluster, int span) {
#if FUSEDNORM_CLUSTERS
    if (cluster > 1) {
      if (threadIdx.x == 0) init_receive_barrier(&bar, static_cast<uint32_t>(cluster * span * sizeof(float2)));
      cluster_arrive_relaxed();
    }
#endif
  }
};

// The group's mean and M2 of x - K over the cluster from each CTA's PartMoments of slot q (the
// same in every thread of a CTA that passes q), Chan's merge in one fixed order so that every CTA
// gets the same bits: slot q's `writer` stores the CTA's (sum, M2 about its own mean) into every
// CTA of the cluster (ClusterExchange; `rank` = this CTA's), each CTA waits for its cluster * span
// records, and no CTA waits on another's progress but for those bytes (docs/design.md,
// "Cluster path"). part_count(r): rank r's elements of the group. The cluster's size is
// a power of two (the planners double it) and span * cluster <= kWarp (the launchers assert it).
//
// Lane s * cluster + r of each warp takes slot s of rank r, the `cluster` lanes of a slot merge
// their records over a butterfly (the same tree in every CTA), and each thread takes its slot's
// result from that slot's first lane.
template <typename acc_t, typename PartCount>
__device__ __forceinline__ BlockMoments<acc_t> one_pass_cluster_moments(const PartMoments<acc_t>& part, acc_t total,
    int q, bool writer, ClusterExchange& ex, int rank, int cluster, int span, const PartCount& part_count) {
  static_assert(sizeof(acc_t) == sizeof(float), "the exchange holds float records");
#if FUSEDNORM_CLUSTERS
  if (cluster > 1) {
    cluster_wait();  // every CTA's barrier initialized (ClusterExchange::begin)
    if (writer) {
      for (int r = 0; r < cluster; ++r) {
        cluster_store(make_float2(part.sum, part.m2), &ex.slots[rank * span + q], &ex.bar, r);
      }
    }
    wait_received(&ex.bar);
    const int lane = static_cast<int>(threadIdx.x & (kWarp - 1));
    const int log_cluster = __ffs(cluster) - 1;
    const int r = lane & (cluster - 1);
    acc_t sum = acc_t(0), m2 = acc_t(0), count = acc_t(0);
    if (lane < span * cluster) {
      const float2 rec = ex.slots[r * span + (lane >> log_cluster)];
      sum = rec.x;
      m2 = rec.y;
      count = part_count(r);
    }
    const acc_t mean = segment_sum(sum, cluster) / total;
    if (count > acc_t(0)) {
      const acc_t d = sum / count - mean;  // the part's mean's distance from the group's
      m2 += count * d * d;
    }
    m2 = segment_sum(m2, cluster);
    const int first = q << log_cluster;
    return BlockMoments<acc_t>{__shfl_sync(0xffffffffu, mean, first), __shfl_sync(0xffffffffu, m2, first)};
  }
#endif
  return BlockMoments<acc_t>{part.sum / total, part.m2};
}

// The CTA's PartMoments from each thread's shifted sums (nt elements, tk = T - K, q1 = sum (x - T),
// q2 = sum (x - T)^2: block_moments_of_shifted_sums over slot q of `span`, one_pass_slot_sum);
// `count` = the CTA's elements of the slot's group (sum of nt over its threads). Alone in its
// cluster, the M2 is about the group's mean as one_pass_cluster_moments' result wants.
template <typename acc_t>
__device__ __forceinline__ PartMoments<acc_t> cta_part_moments(
    acc_t nt, acc_t tk, acc_t q1, acc_t q2, acc_t count, int q, int span, acc_t* red) {
  PartMoments<acc_t> p;
  p.sum = one_pass_slot_sum(nt > acc_t(0) ? nt * tk + q1 : acc_t(0), q, span, red);
  const acc_t mean = p.sum / count;  // (NaN in a CTA without elements, whose threads do not use it)
  acc_t c = acc_t(0);
  if (nt > acc_t(0)) {
    const acc_t mt = q1 / nt;        // the thread's mean of x - T
    const acc_t d = tk + mt - mean;  // its mean's distance from the CTA's
    c = (q2 - q1 * mt) + nt * d * d;
  }
  p.m2 = one_pass_slot_sum(c, q, span, red);
  return p;
}

}  // namespace
}  // namespace fusednorm
