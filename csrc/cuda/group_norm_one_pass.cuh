// The one-pass forward, for groups small enough to sit in one CTA's shared memory or registers
// (docs/design.md, "One-pass forward", "Register kernel", "Channels-last one-pass"). One file of
// about 900 lines: the shared-memory, cluster, register and channels-last kernels share
// OnePassArgs, OnePassOutput and the block sums, and their launchers one dispatch.
//
// The split forward reads x twice and takes three launches; for small groups that is mostly
// latency and launch overhead (Stable Diffusion UNet shapes, problem 3's rows of 8192). Here one
// CTA takes one group (n, g) of the ChannelsFirst layout, D * S contiguous elements:
//   1. copies the group into shared memory with cp.async, every copy of a thread in flight at once
//      (a thread later reads only the packs it copied itself, so no barrier is needed for them);
//   2. mean, then the sum of squared deviations from it, both from shared memory: the exact
//      two-pass variance (of x - K, K the first element, as the split path), reduced in a fixed
//      order (deterministic);
//   3. writes y = act(((x - mean) * rstd * w_eff + b_eff) + residual) * multiplier from shared
//      memory, with the per-(n, c) modulation of epilogue.h folded into w_eff and b_eff.
// x is read from DRAM once. The activation is a template parameter, so that the element loop has
// no switch in it. Groups that fit in registers (at most 4 packs a thread of 512; problem 3's rows
// of 8192, UNet's small groups) take group_norm_registers_kernel instead: the same arithmetic
// without the shared-memory staging, whose 64 KB per CTA bounded how many groups an SM held.

#pragma once

#include <cuda_pipeline.h>
#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/paths.h"
#include "group_norm.h"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <array>

#include <cstdlib>
#include <type_traits>

namespace fusednorm {
namespace {

constexpr int kOnePassThreads = 256;
// The CTA size of the clusters probed by clusters_of_16 (the planner's largest one-pass CTA share,
// plan.cpp; which groups take the one-pass kernels, and in how many CTAs, is the planner's).
constexpr int64_t kOnePassCtaBytes = 64 * 1024;

template <typename scalar_t>
struct OnePassArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  scalar_t* y;
  ParamRef weight, bias;
  acc_t* mean;  // (N, G)
  acc_t* rstd;
  int64_t C, S, G, D, len;  // len = D * S, the elements of a group
  int64_t chunk;            // packs per CTA: a cluster of `cluster` CTAs takes a group
  int cluster;
  bool cols;  // ChannelsLast: a group is S rows of D channels, C elements apart (ColsPlace)
  acc_t eps;
  EpiArgs<scalar_t> epi;

  // x and its distinct tensor-sized operands (the residual and the multiplier may be one tensor).
  int streams() const {
    return 1 + (epi.residual != nullptr) + (epi.multiplier != nullptr && epi.multiplier != epi.residual);
  }

  // ChannelsLast: the first element of group (n, g); its element (s, d) lies s * C + d further.
  __host__ __device__ int64_t cols_group_base(int64_t n, int64_t g) const { return n * S * C + g * D; }

  // Whether the elements of each V-element pack share their coefficients (OnePassOutput's
  // uniform_pack): S a multiple of V (a pack lies in one channel) or no per-channel parameter.
  template <int V>
  __host__ __device__ bool uniform_packs() const {
    return S % V == 0 || uniform_channels();
  }

  // Whether every channel of a group has the same coefficients: no per-channel parameter.
  __host__ __device__ bool uniform_channels() const {
    return weight.ptr == nullptr && bias.ptr == nullptr && epi.scale.ptr == nullptr && epi.shift.ptr == nullptr;
  }
};

// The arguments of a forward over 16-byte packs, but for chunk and cluster; false where a
// tensor-sized operand is not 16-byte aligned. The channels-last sweep takes them so (its rows are
// whole packs, C a multiple of V: the planner's condition).
template <typename scalar_t>
bool make_forward_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd, OnePassArgs<scalar_t>& a) {
  using acc_t = acc_type<scalar_t>;
  a.cols = layout == Layout::ChannelsLast;
  a.epi = epi_args<scalar_t>(ep, /*with_residual=*/true);
  a.x = x.data_ptr<scalar_t>();
  a.y = y.data_ptr<scalar_t>();
  if (!aligned16(a.x) || !aligned16(a.y) || (a.epi.residual != nullptr && !aligned16(a.epi.residual)) ||
      (a.epi.multiplier != nullptr && !aligned16(a.epi.multiplier))) {
    return false;
  }
  a.weight = param_ref<scalar_t>(weight);
  a.bias = param_ref<scalar_t>(bias);
  a.mean = mean.data_ptr<acc_t>();
  a.rstd = rstd.data_ptr<acc_t>();
  a.C = sh.C;
  a.S = sh.S;
  a.G = sh.G;
  a.D = sh.D;
  a.len = sh.D * sh.S;
  a.eps = static_cast<acc_t>(eps);
  return true;
}

// The arguments of the one-pass and team forwards, but for chunk and cluster; false where the
// group's length (ChannelsFirst) or a tensor-sized operand's alignment rules out 16-byte packs,
// or (ChannelsLast) a group's channels are not a whole number of 4-byte packs (the narrowest copy
// of the channels-last shared-memory kernel; the register kernel needs 16-byte ones).
template <typename scalar_t, int V>
bool make_one_pass_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd, OnePassArgs<scalar_t>& a) {
  const bool cols = layout == Layout::ChannelsLast;
  if (cols ? (sh.D * static_cast<int64_t>(sizeof(scalar_t))) % 4 != 0 : (sh.D * sh.S) % V != 0) return false;
  return make_forward_args<scalar_t>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, a);
}

// Sum of v over the CTA (whole warps, at most MaxThreads threads; smem holds one value a warp), in
// a fixed order; every thread gets the total.
template <int MaxThreads = kOnePassThreads, typename acc_t>
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
  __syncthreads();  // smem is reused by the next sum
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

// A 16-byte pack from shared memory in one 16-byte load. Read element by element where it lies
// (p.v[j] through a reference into shared memory), a half / bfloat16 pack took eight 2-byte loads.
template <typename P>
__device__ __forceinline__ P load_pack(const P& p) {
  static_assert(sizeof(P) == sizeof(uint4), "shared-memory packs are 16 bytes");
  const uint4 bits = *reinterpret_cast<const uint4*>(&p);
  P out;
  memcpy(&out, &bits, sizeof(P));
  return out;
}

// A pack from shared memory: 16-bit packs in one 16-byte load (load_pack), others as they are
// (float packs were loaded whole already; through load_pack, the float team backward with ReLU
// spilled registers it did not spill before).
template <typename P>
__device__ __forceinline__ P read_pack(const P& p) {
  if constexpr (sizeof(P) == sizeof(uint4) && sizeof(p.v[0]) == 2) {
    return load_pack(p);
  } else {
    return p;
  }
}

// Calls f(std::true_type()) or f(std::false_type()) as `b`: a loop compiled twice, once without
// what it needs only where b holds. The forward output loops take it for the residual and
// multiplier: predicated off, their handling still took about 60 of the 244 instructions a pack
// of the bfloat16 team forward with SiLU issued, in a loop the SMs spent half their time issuing
// (ncu, VAE row).
template <typename F>
__device__ __forceinline__ void dispatch_bool(bool b, const F& f) {
  if (b) {
    f(std::true_type());
  } else {
    f(std::false_type());
  }
}

// Sum over a pack of x - K, and of ((x - K) - shifted_mean)^2: the terms of the register
// kernel's two-pass moments (RegisterGroup::finish).
template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ acc_t pack_shifted_sum(const Pack<scalar_t, V>& p, acc_t K) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < V; ++j) s += static_cast<acc_t>(p.v[j]) - K;
  return s;
}

template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ acc_t pack_squared_deviations(const Pack<scalar_t, V>& p, acc_t K, acc_t shifted_mean) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t d = (static_cast<acc_t>(p.v[j]) - K) - shifted_mean;
    s += d * d;
  }
  return s;
}

// Adds a pack's x - T to q1 and their squares to q2: a thread's shifted sums, T its first element,
// for block_moments_of_shifted_sums (docs/design.md, "Shifted moments and Chan merges").
template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ void add_shifted_sums(const Pack<scalar_t, V>& p, acc_t T, acc_t& q1, acc_t& q2) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t d = static_cast<acc_t>(p.v[j]) - T;
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

// (w_eff, b_eff) of channel c of sample n: the affine parameters with the per-(n, c) modulation
// folded in (modulate, epilogue.h). No statistics: the channels-last sweep's output kernel loads
// them before it waits for its records.
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ Affine<acc_t> channel_affine(const OnePassArgs<scalar_t>& a, int64_t n, int64_t c) {
  return modulate(a.epi, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
}
// The coefficients of channel c of sample n in y = (x - mean) * a_c + b_c: a_c = rstd * w_eff,
// b_c = b_eff.
template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> output_coefficients(const Affine<acc_t>& m, acc_t rstd) {
  return {rstd * m.w, m.b};
}
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ Affine<acc_t> output_coefficients(const OnePassArgs<scalar_t>& a, int64_t n, int64_t c, acc_t rstd) {
  return output_coefficients(channel_affine<acc_t>(a, n, c), rstd);
}

// One element of y, before its rounding to scalar_t, of a group shifted by K whose mean is
// K + shifted_mean (centred on K, then on shifted_mean: (x - mean) keeps its digits where
// |mean| >> std), with channel coefficients (a_c, b_c): the residual added, the activation, the
// multiplier.
template <Activation A, typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t output_element(const EpiArgs<scalar_t>& e, acc_t K, acc_t shifted_mean, acc_t a_c,
    acc_t b_c, scalar_t x, scalar_t r, bool has_r, scalar_t m, bool has_m) {
  acc_t p = ((static_cast<acc_t>(x) - K) - shifted_mean) * a_c + b_c;
  if (has_r) p += static_cast<acc_t>(r);
  acc_t z = device_activation_forward(A, p, e.slope);
  if (has_m) z *= static_cast<acc_t>(m);
  return z;
}

// y = act(((x - K) - shifted_mean) * rstd * w_eff + b_eff + residual) * multiplier for the packs
// of group (n, g), with the per-(n, c) modulation folded into w_eff and b_eff (epilogue.h); a
// channel's coefficients are cached, as with S >= V a pack lies in one channel. A: the activation,
// fixed at compile time.
template <typename scalar_t, int V, Activation A>
struct OnePassOutput {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const OnePassArgs<scalar_t>& a;
  int64_t n, c_first;
  acc_t K, shifted_mean, rstd;
  bool uniform;  // every pack's elements share their coefficients (OnePassArgs::uniform_packs)
  int64_t cached_c = -1;
  acc_t ca = acc_t(0), cb = acc_t(0);
  // The elements [lo, hi) of the group share the cached coefficients (uniform packs): a thread's
  // next pack mostly lies in the same channel, and testing the range replaces a division a pack.
  int64_t lo = 0, hi = 0;

  __device__ __forceinline__ OnePassOutput(
      const OnePassArgs<scalar_t>& args, int64_t n_, int64_t g, acc_t K_, acc_t shifted_mean_, acc_t rstd_)
      : a(args), n(n_), c_first(g * args.D), K(K_), shifted_mean(shifted_mean_), rstd(rstd_),
        uniform(args.template uniform_packs<V>()) {}

  // Pack v (counted from the group's start) of y from x's, with the residual's and multiplier's
  // packs where they are present.
  __device__ __forceinline__ P operator()(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    return uniform ? uniform_pack(v, xp, rp, has_r, mp, has_m) : straddling_pack(v, xp, rp, has_r, mp, has_m);
  }

  // A pack that may straddle channels: the channel of its first element, then counted forward
  // element by element.
  __device__ __forceinline__ P straddling_pack(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    int64_t c = div_nn(v * V, a.S);
    int64_t rem = v * V - c * a.S;
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j > 0 && ++rem == a.S) {
        rem = 0;
        ++c;
      }
      coefficients(c_first + c);
      z[j] = element(xp.v[j], rp.v[j], has_r, mp.v[j], has_m);
    }
    return round_pack<scalar_t, V>(z);
  }

  // A pack with the cached coefficients (every channel's, where OnePassArgs::uniform_channels).
  __device__ __forceinline__ P constant_pack(const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) const {
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) z[j] = element(xp.v[j], rp.v[j], has_r, mp.v[j], has_m);
    return round_pack<scalar_t, V>(z);
  }

  // A pack whose elements share their coefficients: S a multiple of V (a pack lies in one channel)
  // or no per-channel parameter at all. The element loop then holds no channel logic, which
  // matters where it is unrolled over a thread's R packs (the register kernel).
  __device__ __forceinline__ P uniform_pack(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    const int64_t first = v * V;
    if (first < lo || first >= hi) {
      const int64_t c = div_nn(first, a.S);
      lo = c * a.S;
      hi = lo + a.S;
      coefficients(c_first + c);
    }
    return constant_pack(xp, rp, has_r, mp, has_m);
  }

  // One element of y, before its rounding to scalar_t (round_pack).
  __device__ __forceinline__ acc_t element(scalar_t x, scalar_t r, bool has_r, scalar_t m, bool has_m) const {
    return element_with(ca, cb, x, r, has_r, m, has_m);
  }

  __device__ __forceinline__ acc_t element_with(
      acc_t a_c, acc_t b_c, scalar_t x, scalar_t r, bool has_r, scalar_t m, bool has_m) const {
    return output_element<A>(a.epi, K, shifted_mean, a_c, b_c, x, r, has_r, m, has_m);
  }

  __device__ __forceinline__ Affine<acc_t> channel(int64_t c) const { return output_coefficients(a, n, c, rstd); }

  __device__ __forceinline__ void coefficients(int64_t c) {
    if (c != cached_c) {
      const Affine<acc_t> m = channel(c);
      ca = m.w;
      cb = m.b;
      cached_c = c;
    }
  }

  // ChannelsLast: a pack holds V channels, first_lane the group's channel of its element 0 (the
  // same for every pack of a thread: its coefficients are loaded once, into lane_a / lane_b).
  __device__ __forceinline__ void lane_coefficients(int first_lane, acc_t (&lane_a)[V], acc_t (&lane_b)[V]) const {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const Affine<acc_t> m = channel(c_first + first_lane + j);
      lane_a[j] = m.w;
      lane_b[j] = m.b;
    }
  }

  __device__ __forceinline__ P lane_pack(const acc_t (&lane_a)[V], const acc_t (&lane_b)[V], const P& xp,
      const P& rp, bool has_r, const P& mp, bool has_m) const {
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) z[j] = element_with(lane_a[j], lane_b[j], xp.v[j], rp.v[j], has_r, mp.v[j], has_m);
    return round_pack<scalar_t, V>(z);
  }
};

template <typename scalar_t, int V, Activation A>
__global__ void __launch_bounds__(kOnePassThreads) group_norm_one_pass_kernel(const OnePassArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char one_pass_smem[];
  __shared__ acc_t red[kOnePassThreads / kWarp];
  __shared__ ClusterExchange exchange;  // the cluster's parts
  const int64_t item = div_nn(blockIdx.x, a.cluster);  // (n, g)
  const int rank = static_cast<int>(blockIdx.x - item * a.cluster);  // the CTA's rank in its cluster
  const int64_t n = div_nn(item, a.G);
  const int64_t g = item - n * a.G;
  const int64_t off = item * a.len;  // ChannelsFirst: group (n, g) starts at (n * C + g * D) * S
  const int64_t lenv = a.len / V;
  exchange.begin(a.cluster, 1);
  // This CTA's packs of the group: [v_begin, v_end).
  const int64_t v_begin = imin(lenv, rank * a.chunk);
  const int64_t count = imin(lenv, v_begin + a.chunk) - v_begin;
  const EpiArgs<scalar_t>& e = a.epi;
  // Shared memory: the CTA's part of the group of x, then the residual's and the multiplier's (one
  // region when they are the same tensor, as in problem 3's (h + y) * y), all copied at once.
  P* x_smem = reinterpret_cast<P*>(one_pass_smem);
  P* r_smem = e.residual != nullptr ? x_smem + a.chunk : nullptr;
  P* m_smem = e.multiplier == nullptr ? nullptr
          : e.multiplier == e.residual ? r_smem
                                       : x_smem + a.chunk * (r_smem != nullptr ? 2 : 1);
  const P* xg = reinterpret_cast<const P*>(a.x + off) + v_begin;
  const P* rg = reinterpret_cast<const P*>(offset_or_null(e.residual, off)) + v_begin;
  const P* mg = reinterpret_cast<const P*>(offset_or_null(e.multiplier, off)) + v_begin;
  for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
    __pipeline_memcpy_async(&x_smem[v], &xg[v], sizeof(P));
    if (r_smem != nullptr) __pipeline_memcpy_async(&r_smem[v], &rg[v], sizeof(P));
    if (m_smem != nullptr && m_smem != r_smem) __pipeline_memcpy_async(&m_smem[v], &mg[v], sizeof(P));
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);

  // Moments of x - K, K the group's first element, as the split path computes them: a constant
  // group gives exactly mean = K and variance 0, and a mean far from 0 keeps its digits. One pass
  // over shared memory: sums of x - T and (x - T)^2, T the thread's first element, merged over
  // the CTA in the two steps of block_moments_of_shifted_sums (cta_part_moments), then over the
  // cluster in one exchange (one_pass_cluster_moments; docs/design.md, "Cluster path").
  const acc_t K = static_cast<acc_t>(a.x[off]);
  acc_t nt = acc_t(0), tk = acc_t(0), q1 = acc_t(0), q2 = acc_t(0);
  if (threadIdx.x < count) {
    const acc_t T = static_cast<acc_t>(load_pack(x_smem[threadIdx.x]).v[0]);
    tk = T - K;
    for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
      add_shifted_sums(load_pack(x_smem[v]), T, q1, q2);
      nt += static_cast<acc_t>(V);
    }
  }
  const acc_t total = static_cast<acc_t>(a.len);
  const PartMoments<acc_t> part = cta_part_moments(nt, tk, q1, q2, static_cast<acc_t>(count * V), 0, 1, red);
  const BlockMoments<acc_t> gm = one_pass_cluster_moments(part, total, 0, threadIdx.x == 0, exchange, rank, a.cluster, 1,
      [&](int r) {
        const int64_t b = imin(lenv, r * a.chunk);
        return static_cast<acc_t>((imin(lenv, b + a.chunk) - b) * V);
      });
  const acc_t shifted_mean = gm.mean;
  const acc_t var = gm.m2 / total;
  // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
  const acc_t group_rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
  if (rank == 0 && threadIdx.x == 0) {
    a.mean[item] = K + shifted_mean;
    a.rstd[item] = group_rstd;
  }

  OnePassOutput<scalar_t, V, A> out(a, n, g, K, shifted_mean, group_rstd);
  P* yg = reinterpret_cast<P*>(a.y + off) + v_begin;
  dispatch_bool(r_smem != nullptr || m_smem != nullptr, [&](auto operands) {
    const bool has_r = decltype(operands)::value && r_smem != nullptr;
    const bool has_m = decltype(operands)::value && m_smem != nullptr;
    for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
      P rp, mp;
      if (has_r) rp = load_pack(r_smem[v]);
      if (has_m) mp = load_pack(m_smem[v]);
      yg[v] = out(v_begin + v, load_pack(x_smem[v]), rp, has_r, mp, has_m);
    }
  });
}

// Where a thread works in a ChannelsLast group of S rows of D channels (OnePassArgs::cols): in
// lanes of V channels, thread t keeps lane t % lanes, so that its channels' coefficients load
// once, and takes rows row0 = t / lanes, row0 + step, ...; threads past step * lanes hold none.
template <int V>
struct ColsPlace {
  int lanes = 0, row0 = 0, lane = 0, step = 0;

  ColsPlace() = default;
  __device__ __forceinline__ ColsPlace(int64_t D, int threads)
      : lanes(static_cast<int>(D / V)),
        row0(static_cast<int>(threadIdx.x) / lanes),
        lane(static_cast<int>(threadIdx.x) - row0 * lanes),
        step(threads / lanes) {}

  __device__ __forceinline__ bool active() const { return row0 < step; }
  // The thread's pack of row s: in elements from the group's first, and its index in the group
  // stored densely (pack (s, lane) at s * lanes + lane).
  __device__ __forceinline__ int64_t offset(int64_t s, int64_t C) const { return s * C + lane * V; }
  __device__ __forceinline__ int64_t dense(int64_t s) const { return s * lanes + lane; }
};

// The one-pass forward with the group in registers, for groups of at most R packs per thread of
// a CTA (S == 1 rows such as problem 3's, UNet's small groups). The arithmetic is the
// shared-memory kernel's, but without its staging: every load of x is issued up front into
// registers, and a CTA holds no shared memory, so that the SM's register file rather than 64 KB per
// CTA bounds how many groups are in flight. E is the number of extra tensor-sized streams: 0,
// 1 (the residual, the multiplier, or both when they are one tensor, as in problem 3's
// (h + y) * y) or 2; it is a template parameter because registers are allocated for the worst path
// of a kernel. finish() takes the activation A at compile time (the output is unrolled over R * V
// elements, and a switch over every activation in it took ptxas ~10 s per kernel with R = 8).
//
// kLate (ChannelsFirst groups without per-channel parameters, OnePassArgs::uniform_channels, as
// problem 3's tail): compiled for three CTAs an SM rather than two, i.e. 40 registers a thread.
// The operands are loaded in the output phase, kLateBatch packs of each at a time, rather than up
// front beside x (the moments need x alone), and the output takes the group's one pair of
// coefficients without OnePassOutput's channel tracking: with either, the kernel spilled under the
// cap (ptxas sm_90: 120-128 bytes for problem 3's tail; 38 registers and none without both).
// Otherwise R * (1 + E) packs are held at once.
//
// kCols: the ChannelsLast layout, where group (n, g) is S rows of D channels, C elements apart
// (UNet's channels_last groups of 40 channels on 8x8 and 16x16 pixels, which the split passes
// took in three launches); a thread's packs are those of its ColsPlace, its k-th in row
// row0 + k * step.
constexpr int kLateBatch = 2;

template <typename scalar_t, int V, int R, int E, bool kCols = false, bool kLate = false>
struct RegisterGroup {
  static_assert(!(kLate && kCols), "the late-operand kernel is ChannelsFirst's");
  using P = Pack<scalar_t, V>;
  static constexpr int kHeld = E > 0 && !kLate ? E : 1;  // operand streams held from load() on
  P x[R];
  P extra[kHeld][kLate ? 1 : R];  // extra[0]: the residual if given, else the multiplier; [1]: the multiplier
  scalar_t first;                 // x's first element, K
  ColsPlace<V> place;             // kCols
  // ChannelsFirst with at most two packs a thread: each pack's channel parameters (weight, bias,
  // scale, shift), loaded beside x so that their latency passes during the moments instead of
  // after them (docs/design.md, "Register kernel"); the output multiplies in rstd as
  // OnePassOutput::channel does, so the bits are the same.
  static constexpr bool kEarlyParams = !kCols && !kLate && R <= 2;
  Affine<acc_type<scalar_t>> params[kEarlyParams ? R : 1];

  // Group (n, g)'s first element.
  __device__ __forceinline__ int64_t group_offset(const OnePassArgs<scalar_t>& a, int64_t item) const {
    if constexpr (kCols) {
      const int64_t n = div_nn(item, a.G);
      return a.cols_group_base(n, item - n * a.G);
    } else {
      return item * a.len;
    }
  }

  // The thread's k-th pack: its index counted from the group's first (ChannelsFirst: packs
  // threadIdx.x + k * blockDim.x), whether it lies in the group, and its first element's offset
  // from the group's first.
  __device__ __forceinline__ int pack_index(int k) const { return static_cast<int>(threadIdx.x + k * blockDim.x); }

  __device__ __forceinline__ bool valid(const OnePassArgs<scalar_t>& a, int k) const {
    if constexpr (kCols) {
      return place.active() && place.row0 + k * place.step < a.S;
    } else {
      return pack_index(k) < static_cast<int>(a.len / V);
    }
  }

  __device__ __forceinline__ int64_t pack_offset(const OnePassArgs<scalar_t>& a, int k) const {
    if constexpr (kCols) {
      return place.offset(place.row0 + k * place.step, a.C);
    } else {
      return static_cast<int64_t>(pack_index(k)) * V;
    }
  }

  // The operands' packs at element e: ops[0] the residual if given, else the multiplier; ops[1]
  // the multiplier.
  __device__ __forceinline__ static void load_operands(const OnePassArgs<scalar_t>& a, int64_t e, P* ops0, P* ops1) {
    const scalar_t* extra0 = a.epi.residual != nullptr ? a.epi.residual : a.epi.multiplier;
    if constexpr (E >= 1) *ops0 = *reinterpret_cast<const P*>(extra0 + e);
    if constexpr (E >= 2) *ops1 = *reinterpret_cast<const P*>(a.epi.multiplier + e);
  }

  // Pack k (batch slot u) of operand stream `stream` (0: the residual if given, else the
  // multiplier; the last: the multiplier): from the batch `late` loaded in the output loop
  // (kLate), else as held since load().
  template <typename Late>
  __device__ __forceinline__ const P& operand(const Late& late, int stream, int k, int u) const {
    if constexpr (kLate) {
      return late[stream][u];
    } else {
      return extra[stream == 0 ? 0 : kHeld - 1][k];
    }
  }

  // Issues every load of group `item` (the operands' too unless kLate).
  __device__ __forceinline__ void load(const OnePassArgs<scalar_t>& a, int64_t item) {
    const int64_t off = group_offset(a, item);
    first = a.x[off];
    if constexpr (kCols) place = ColsPlace<V>(a.D, static_cast<int>(blockDim.x));
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) {
        const int64_t e = off + pack_offset(a, k);
        x[k] = *reinterpret_cast<const P*>(a.x + e);
        if constexpr (!kLate) load_operands(a, e, &extra[0][k], &extra[kHeld - 1][k]);
      }
    }
    if constexpr (kEarlyParams) {
      using acc_t = acc_type<scalar_t>;
      const int64_t n = div_nn(item, a.G);
      const int64_t c_first = (item - n * a.G) * a.D;
#pragma unroll
      for (int k = 0; k < R; ++k) {
        if (valid(a, k)) {
          const int64_t c = c_first + div_nn(pack_offset(a, k), a.S);
          params[k] = modulate(a.epi, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
        }
      }
    }
  }

  // Moments (two-pass, from registers), the statistics, and y of group `item`, once its loads
  // are in. `red`: MaxThreads / kWarp values of shared memory.
  template <int MaxThreads, Activation A>
  __device__ __forceinline__ void finish(const OnePassArgs<scalar_t>& a, int64_t item, acc_type<scalar_t>* red) const {
    using acc_t = acc_type<scalar_t>;
    const acc_t K = static_cast<acc_t>(first);
    acc_t sum = acc_t(0);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) sum += pack_shifted_sum(x[k], K);
    }
    const acc_t total = static_cast<acc_t>(a.len);
    const acc_t shifted_mean = one_pass_block_sum<MaxThreads>(sum, red) / total;
    acc_t m2 = acc_t(0);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) m2 += pack_squared_deviations(x[k], K, shifted_mean);
    }
    const acc_t var = one_pass_block_sum<MaxThreads>(m2, red) / total;
    // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
    const acc_t rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
    if (threadIdx.x == 0) {
      a.mean[item] = K + shifted_mean;
      a.rstd[item] = rstd;
    }
    const int64_t n = div_nn(item, a.G);
    OnePassOutput<scalar_t, V, A> out(a, n, item - n * a.G, K, shifted_mean, rstd);
    const bool has_r = E >= 1 && a.epi.residual != nullptr;
    const bool has_m = E >= 1 && a.epi.multiplier != nullptr;
    acc_t lane_a[kCols ? V : 1], lane_b[kCols ? V : 1];
    if constexpr (kCols) {
      if (!place.active()) return;
      out.lane_coefficients(place.lane * V, lane_a, lane_b);
    }
    const int64_t off = group_offset(a, item);
    if constexpr (kLate) out.coefficients(out.c_first);  // every channel's
    // kLate: the operands of B packs are loaded together before their stores (the compiler cannot
    // move a load above a store to y, which they may alias).
    constexpr int B = kLate ? kLateBatch : R;
#pragma unroll
    for (int k0 = 0; k0 < R; k0 += B) {
      P late[kLate && E > 0 ? E : 1][kLate ? B : 1];
      if constexpr (kLate && E > 0) {
#pragma unroll
        for (int u = 0; u < B; ++u) {
          if (k0 + u < R && valid(a, k0 + u)) {
            load_operands(a, off + pack_offset(a, k0 + u), &late[0][u], &late[E - 1][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int k = k0 + u;
        if (k < R && valid(a, k)) {
          const P& r = operand(late, 0, k, u);
          const P& m = operand(late, E >= 2 ? 1 : 0, k, u);
          P& y = *reinterpret_cast<P*>(a.y + off + pack_offset(a, k));
          if constexpr (kCols) {
            y = out.lane_pack(lane_a, lane_b, x[k], r, has_r, m, has_m);
          } else if constexpr (kLate) {
            y = out.constant_pack(x[k], r, has_r, m, has_m);
          } else if constexpr (kEarlyParams) {
            out.ca = out.rstd * params[k].w;
            out.cb = params[k].b;
            y = out.constant_pack(x[k], r, has_r, m, has_m);
          } else {
            y = out.uniform_pack(pack_index(k), x[k], r, has_r, m, has_m);
          }
        }
      }
    }
  }
};

// One CTA a group, of up to kRegisterThreads threads: warps enough to hide the latency of the
// reductions' barriers and shuffles. With 256 threads of 8 packs (96 registers, 16 warps an SM)
// problem 3's rows ran at 71% of the copy bandwidth; persistent CTAs that loaded the next group
// during the current one's reductions, with 16 warps an SM, did no better (67%): the SM was
// waiting on its own instruction latencies.
constexpr int kRegisterThreads = 512;

// CTAs an SM the register kernel is compiled for: two (at most 64 registers a thread) while it
// holds the operands through the reductions, three (40) when it loads them late.
template <bool kLate>
constexpr int kRegisterCtasPerSm = kLate ? 3 : 2;

template <typename scalar_t, int V, int R, int E, Activation A, bool kCols, bool kLate>
__global__ void __launch_bounds__(kRegisterThreads, kRegisterCtasPerSm<kLate>)
    group_norm_registers_kernel(const OnePassArgs<scalar_t> a) {
  __shared__ acc_type<scalar_t> red[kRegisterThreads / kWarp];
  RegisterGroup<scalar_t, V, R, E, kCols, kLate> group;
  group.load(a, blockIdx.x);
  group.finish<kRegisterThreads, A>(a, blockIdx.x, red);
}

// Rows whose residual / multiplier packs a thread of group_norm_cols_one_pass_kernel loads at once.
constexpr int kColsOperandBatch = 4;

// The one-pass forward of ChannelsLast groups in shared memory, for the groups the register kernel
// cannot take: D not a multiple of the 16-byte pack (UNet's 10 and 20 channels a group in half
// precision) or more rows than a CTA covers in registers (ResNet's 3136).
//
// A CTA takes `span` adjacent groups of a sample at once (a slab: S rows of span * D channels),
// slabs blockIdx.x, + gridDim.x, ...: a group's row of 16 or 20 bytes fills half a 32-byte sector,
// and with one group a CTA each sector was read by two CTAs (ncu: L2 served 2.6x the bytes
// needed). V is the widest pack (16, 8 or 4 bytes) that divides a row's D channels, so that a pack
// lies in one group: the thread's group q = lane * V / D is fixed, and the moments are span block
// sums at once (one_pass_slot_sum).
//
// Each thread takes the packs of its ColsPlace in the slab: it copies them into shared memory
// (cp.async, all in flight), sums them once there (shifted sums, merged as in
// block_moments_of_shifted_sums), and writes y from them, so it reads only what it copied itself
// and needs no barrier but the block sums'; its lane's coefficients are loaded once. Threads
// without a lane only join the block sums. The residual and multiplier are read in the output
// loop (once each, as x is), kColsOperandBatch rows at a time; E is the number of those streams
// (RegisterGroup's E), so that a kernel holds registers for its own operands only.
//
// At most 128 registers (two CTAs an SM): bfloat16's 16-byte packs with two streams took 146 and
// ran one CTA an SM; the span-2 ResNet slabs of 100 KB run two. Measured on an H100 and not kept
// (docs/design.md, "Channels-last one-pass"): a cap of 80 or 64 registers (spills: ResNet 0.059 -> 0.079 /
// 0.094 ms), 8 rows of operands at once (spills: 0.093), an L2 prefetch of the operands beside
// the copy of x (0.0555 -> 0.0595).
//
// buffer_packs > 0: two buffers of that many packs, the next slab's copy in flight during this
// one's sums and output (with one slab a CTA, every CTA of the single wave loaded, then summed,
// then wrote at the same time). 0: one buffer, and a grid of one CTA a slab, or (kClustered,
// a.cluster > 1, sm_90) of one cluster a slab: its CTAs take equal ranges of the slab's rows and
// merge their parts' moments over distributed shared memory (one_pass_cluster_moments), for slabs
// too large for one CTA or too few to fill the GPU one a CTA (docs/design.md, "Channels-last
// one-pass"). items: the slabs, N * G / span. The clustered kernels (E = 0, 16-bit types: the
// planner's clusters) are instantiations of their own, so that the others hold no cluster code:
// with it, the unclustered rows ran up to 5% slower (ResNet's (32,256,56,56)).
//
// kBias (E = 0 only): with input_bias (docs/design.md, "Input bias"), its own instantiation (the
// per-lane shifts took the kernels without it 8-18 registers more, ptxas sm_90). The kernels
// without operands (E = 0, the clusters' kernels) are held to three CTAs an SM (80 registers): at
// two, the clusters of 8 of the 256-CTA plans did not all fit at once (GPCs hold whole clusters)
// and the rows took 1.25-1.6x as long.
template <typename scalar_t, int V, Activation A, int E, bool kBias = false, bool kClustered = false>
__global__ void __launch_bounds__(kOnePassThreads, kBias || E == 0 ? 3 : 2) group_norm_cols_one_pass_kernel(
    const OnePassArgs<scalar_t> a, int64_t items, int64_t buffer_packs, int span) {
  using acc_t = acc_type<scalar_t>;
  const int cluster = kClustered ? a.cluster : 1;  // (the launcher's choice: a.cluster > 1)
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char one_pass_smem[];
  __shared__ acc_t red[kMaxColsSpan * kOnePassThreads / kWarp];
  __shared__ ClusterExchange exchange;  // the cluster's parts
  P* buffers = reinterpret_cast<P*>(one_pass_smem);  // slabs dense (ColsPlace::dense)
  const ColsPlace<V> place(span * a.D, kOnePassThreads);
  const int row0 = place.row0, step = place.step;
  // A cluster of a.cluster CTAs takes a slab (one buffer, a slab a cluster): this CTA's rows are
  // [r_begin, r_end), the rank-th of a.cluster equal ranges, and this thread's r_begin + row0,
  // + step, ... < r_end (none without a lane).
  const int rank = static_cast<int>(blockIdx.x % cluster);
  const int64_t cluster_rows = ceil_div(a.S, static_cast<int64_t>(cluster));
  const int64_t r_begin = imin(a.S, rank * cluster_rows);
  const int64_t r_part = imin(a.S, r_begin + cluster_rows);  // the CTA's
  const int64_t r_end = place.active() ? r_part : r_begin;
  const int q = place.active() ? static_cast<int>(place.lane * V / a.D) : 0;  // the thread's group in the slab
  // The first thread of each group's lanes (row 0 of the CTA): writes the slot's exchange value
  // and (rank 0) the group's statistics.
  const bool slot_writer = place.active() && row0 == 0 && place.lane * V == q * a.D;
  const int64_t slabs = a.G / span;  // a sample's
  const auto slab_base = [&](int64_t item, int64_t& n, int64_t& g0) {
    n = div_nn(item, slabs);
    g0 = (item - n * slabs) * span;
    return a.cols_group_base(n, g0);
  };
  const auto copy_in = [&](int64_t item, P* xs) {
    int64_t n, g0;
    const int64_t base = slab_base(item, n, g0);
    for (int64_t s = r_begin + row0; s < r_end; s += step) {
      __pipeline_memcpy_async(&xs[place.dense(s - r_begin)], a.x + base + place.offset(s, a.C), sizeof(P));
    }
    __pipeline_commit();
  };
  const bool pipelined = buffer_packs > 0;  // (never with clusters)
  const int64_t first_item = blockIdx.x / cluster;
  const int64_t item_stride = gridDim.x / cluster;
  exchange.begin(cluster, span);
  copy_in(first_item, buffers);
  int b = 0;
  for (int64_t item = first_item; item < items; item += item_stride) {
    P* xs = buffers + b * buffer_packs;
    int64_t n, g0;
    const int64_t base = slab_base(item, n, g0);
    const int64_t g = g0 + q;
    const acc_t K = static_cast<acc_t>(a.x[base + q * a.D]);  // (loaded during the copy, as p is)
    // kBias: the kernel normalizes x' = x + p, shifted by K' = K + p at the group's first channel:
    // lane j sums x' - K' = x - KL[j], KL[j] = K' - p at its own channel = K - delta[j]. p is
    // loaded once, while the slab's copy is in flight (docs/design.md, "Input bias").
    acc_t delta[kBias ? V : 1];
    acc_t p_first = acc_t(0);
    if constexpr (kBias) {
      const InputBiasRef<scalar_t>& ib = a.epi.input_bias;
      p_first = ib.template at<acc_t>(n, g * a.D);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        delta[j] = place.active() ? ib.template at<acc_t>(n, g0 * a.D + place.lane * V + j) - p_first : acc_t(0);
      }
    }
    const int64_t next = item + item_stride;
    if (pipelined && next < items) {
      b ^= 1;
      copy_in(next, buffers + b * buffer_packs);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);  // (unpipelined, the grid is one CTA a slab: one pass of this loop)
    }

    acc_t KL[kBias ? V : 1];
    if constexpr (kBias) {
#pragma unroll
      for (int j = 0; j < V; ++j) KL[j] = K - delta[j];
    }
    // One pass over the thread's packs: the sums of x - T and (x - T)^2, T the thread's first
    // element (of x - KL with kBias), merged over the CTA in the two steps of
    // block_moments_of_shifted_sums (cta_part_moments), then over the cluster in one exchange
    // (one_pass_cluster_moments). The exact two-pass form (a second pass over shared memory
    // for the M2, after the cluster's mean) took ~40 of the ~190 instructions a pack, in phases
    // every warp of the SM runs at once (docs/design.md, "Channels-last one-pass").
    acc_t nt = acc_t(0), tk = acc_t(0), q1 = acc_t(0), q2 = acc_t(0);
    if (r_begin + row0 < r_end) {
      const P first(xs[place.dense(row0)]);
      acc_t T = acc_t(0);  // x - T = (x - K) - tk
      if constexpr (kBias) {
        // Lane j sums x - (KL[j] + tk): one subtraction an element, as without input_bias. The
        // shift's rounding (half an ulp of K) moves a lane's terms by a constant: the mean by no
        // more than its float rounding as K + mean, the M2 by (ulp(K) / std)^2 relatively.
        tk = static_cast<acc_t>(first.v[0]) - KL[0];
#pragma unroll
        for (int j = 0; j < V; ++j) KL[j] += tk;
      } else {
        T = static_cast<acc_t>(first.v[0]);
        tk = T - K;
      }
      // (Packs copied out of shared memory whole: one V-wide load each.)
      for (int64_t s = r_begin + row0; s < r_end; s += step) {
        const P x(xs[place.dense(s - r_begin)]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          acc_t d;
          if constexpr (kBias) {
            d = static_cast<acc_t>(x.v[j]) - KL[j];
          } else {
            d = static_cast<acc_t>(x.v[j]) - T;
          }
          q1 += d;
          q2 += d * d;
        }
        nt += static_cast<acc_t>(V);
      }
    }
    const acc_t total = static_cast<acc_t>(a.len);
    const PartMoments<acc_t> part =
        cta_part_moments(nt, tk, q1, q2, kClustered ? static_cast<acc_t>((r_part - r_begin) * a.D) : total, q, span, red);
    const BlockMoments<acc_t> gm =
        one_pass_cluster_moments(part, total, q, slot_writer, exchange, rank, cluster, span, [&](int r) {
          const int64_t b = imin(a.S, r * cluster_rows);
          return static_cast<acc_t>((imin(a.S, b + cluster_rows) - b) * a.D);
        });
    const acc_t shifted_mean = gm.mean;
    const acc_t var = gm.m2 / total;
    // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
    const acc_t group_rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
    if (rank == 0 && slot_writer) {
      if constexpr (kBias) {
        a.mean[n * a.G + g] = (K + p_first) + shifted_mean;
      } else {
        a.mean[n * a.G + g] = K + shifted_mean;
      }
      a.rstd[n * a.G + g] = group_rstd;
    }
    if (r_begin + row0 >= r_end) continue;  // (the next slab's block sums still need this thread)

    OnePassOutput<scalar_t, V, A> out(a, n, g, K, shifted_mean, group_rstd);
    acc_t lane_a[V], lane_b[V];
    out.lane_coefficients(place.lane * V - static_cast<int>(q * a.D), lane_a, lane_b);
    if constexpr (kBias) {
      // ((x - KL[j]) - mean') * a + b = ((x - K) - mean') * a + (b + (K - KL[j]) * a): the output
      // loop keeps its one shift K.
#pragma unroll
      for (int j = 0; j < V; ++j) lane_b[j] += delta[j] * lane_a[j];
    }
    const EpiArgs<scalar_t>& e = a.epi;
    // E >= 1: stream 0 is the residual if given, else the multiplier (both when they are one
    // tensor); E == 2: stream 1 is the multiplier.
    const scalar_t* stream0 = e.residual != nullptr ? e.residual : e.multiplier;
    const bool has_r = E >= 1 && e.residual != nullptr;
    const bool has_m = E >= 1 && e.multiplier != nullptr;
    // The operands of kBatch rows are loaded together before their rows' stores: the compiler
    // cannot move a load above a store to y (they may alias), so one row at a time waited a
    // memory latency a row.
    constexpr int kBatch = E > 0 ? kColsOperandBatch : 1;
    for (int64_t s0 = r_begin + row0; s0 < r_end; s0 += kBatch * step) {
      P ops[E > 0 ? E : 1][kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t off = base + place.offset(s0 + u * step, a.C);
        if (s0 + u * step < r_end) {
          if constexpr (E >= 1) ops[0][u] = *reinterpret_cast<const P*>(stream0 + off);
          if constexpr (E >= 2) ops[1][u] = *reinterpret_cast<const P*>(e.multiplier + off);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t s = s0 + u * step;
        if (s < r_end) {
          *reinterpret_cast<P*>(a.y + base + place.offset(s, a.C)) = out.lane_pack(
              lane_a, lane_b, P(xs[place.dense(s - r_begin)]), ops[0][u], has_r, ops[E >= 2 ? 1 : 0][u], has_m);
        }
      }
    }
  }
}

// Lets `kernel` take `bytes` of dynamic shared memory. Without the opt-in a CTA gets 48 KB in all,
// its static shared memory (under 1 KB in these kernels) included: a 48 KB group of the one-pass
// backward failed to launch ("invalid argument") when the opt-in began above 48 KB.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes + 1024 > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

template <typename scalar_t, int V, Activation A>
void launch_one_pass(const OnePassArgs<scalar_t>& a, int64_t items, size_t smem_bytes) {
  auto kernel = group_norm_one_pass_kernel<scalar_t, V, A>;
  allow_dynamic_smem(kernel, smem_bytes);
  TORCH_INTERNAL_ASSERT(a.cluster <= kWarp, "one-pass cluster of over a warp of CTAs (one_pass_cluster_moments)");
  launch_clustered(kernel, static_cast<unsigned>(items * a.cluster), kOnePassThreads, smem_bytes, a.cluster,
      at::cuda::getCurrentCUDAStream(), a);
}

// Packs per thread of the register kernel, and its extra streams: R * (1 + E) <= kRegisterPacks
// 16-byte packs a thread (32 registers) fit two CTAs of kRegisterThreads per SM under the kernel's
// register cap of 64.
constexpr int kRegisterPacks = 8;

// One CTA a group of `threads` threads (the plan's: whole warps enough for R packs a thread;
// ChannelsLast: R rows a thread, D / V threads a row); `late`: the variant that loads the
// operands after the moments (ChannelsFirst, not bfloat16: its late kernels spilled 4-14 bytes
// under the cap).
template <typename scalar_t, int V, int R, int E, bool kCols>
void launch_registers(const OnePassArgs<scalar_t>& a, int64_t items, int threads, bool late) {
  static_assert(R * (1 + E) <= kRegisterPacks, "register kernel over its budget");
  const auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(items), threads, 0, at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  constexpr bool kLateAllowed = !kCols && !std::is_same_v<scalar_t, at::BFloat16>;
  const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
    constexpr Activation kA = decltype(act)::value;
    if constexpr (kLateAllowed) {
      if (late) return launch(group_norm_registers_kernel<scalar_t, V, R, E, kA, false, true>);
    }
    launch(group_norm_registers_kernel<scalar_t, V, R, E, kA, kCols, false>);
  });
  TORCH_INTERNAL_ASSERT(launched, "register kernel planned for an activation it is not instantiated for");
}

// The register kernel as planned: R packs (rows) a thread and E extra streams, among the
// instantiations the planner picks from (docs/design.md, "Register kernel"; bfloat16 has none
// with more than one extra stream, or one beside 4 packs, and channels-last bfloat16 only 2 rows
// and no extra stream: those spilled).
template <typename scalar_t, int V>
void launch_registers_planned(const OnePassArgs<scalar_t>& a, int64_t items, const plan::Plan& pl) {
  constexpr bool kSmall = std::is_same_v<scalar_t, at::BFloat16>;
  const int R = pl.reg_packs, E = pl.reg_streams;
  const auto wrong = [&] { TORCH_INTERNAL_ASSERT(false, "register kernel planned with ", R, " packs and ", E, " streams"); };
  if (a.cols) {
    if (R == 2 && E == 0) return launch_registers<scalar_t, V, 2, 0, true>(a, items, pl.threads, pl.late);
    if constexpr (!kSmall) {
      if (R == 2 && E == 1) return launch_registers<scalar_t, V, 2, 1, true>(a, items, pl.threads, pl.late);
      if (R == 4 && E == 0) return launch_registers<scalar_t, V, 4, 0, true>(a, items, pl.threads, pl.late);
    }
    return wrong();
  }
  if (R == 2 && E == 0) return launch_registers<scalar_t, V, 2, 0, false>(a, items, pl.threads, pl.late);
  if (R == 2 && E == 1) return launch_registers<scalar_t, V, 2, 1, false>(a, items, pl.threads, pl.late);
  if (R == 4 && E == 0) return launch_registers<scalar_t, V, 4, 0, false>(a, items, pl.threads, pl.late);
  if constexpr (!kSmall) {
    if (R == 2 && E == 2) return launch_registers<scalar_t, V, 2, 2, false>(a, items, pl.threads, pl.late);
    if (R == 4 && E == 1) return launch_registers<scalar_t, V, 4, 1, false>(a, items, pl.threads, pl.late);
  }
  wrong();
}

// The channels-last shared-memory forward as planned (docs/design.md, "Channels-last one-pass"):
// `span` groups a CTA, packs of `pack_bytes`, with two buffers a CTA and a grid of the CTAs
// resident at once where the plan says so (buffer_packs > 0). Calls f(kernel) with the kernel
// instantiated for the call's pack width, activation (none, SiLU, ReLU) and extra streams.
template <typename scalar_t, typename F>
void with_cols_one_pass_kernel(
    Activation act, int streams, int pack_bytes, const F& f, bool input_bias = false, bool clustered = false) {
  TORCH_INTERNAL_ASSERT(!input_bias || streams == 1, "channels-last one-pass kernel with input_bias and operands");
  TORCH_INTERNAL_ASSERT(!clustered || (streams == 1 && sizeof(scalar_t) == 2),
      "channels-last one-pass clusters planned for operands or a 32-bit type");
  const auto with_width = [&](auto width) {
    constexpr int V = decltype(width)::value / static_cast<int>(sizeof(scalar_t));
    const bool found = dispatch_common_activation(act, [&](auto a) {
      constexpr Activation kA = decltype(a)::value;
      if constexpr (sizeof(scalar_t) == 2) {
        if (clustered && input_bias) return f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 0, true, true>);
        if (clustered) return f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 0, false, true>);
      }
      if (input_bias) return f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 0, true>);
      switch (streams) {
        case 1: f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 0>); break;
        case 2: f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 1>); break;
        default: f(group_norm_cols_one_pass_kernel<scalar_t, V, kA, 2>); break;
      }
    });
    TORCH_INTERNAL_ASSERT(found, "channels-last one-pass kernel planned for an activation it is not instantiated for");
  };
  if (pack_bytes == 16) return with_width(std::integral_constant<int, 16>());
  if (pack_bytes == 8) return with_width(std::integral_constant<int, 8>());
  with_width(std::integral_constant<int, 4>());
}

// The planner's residency question about the channels-last kernel of a call: CTAs an SM with
// `smem` bytes each (the kernel allowed that much first).
template <typename scalar_t>
int cols_one_pass_ctas_per_sm(Activation act, int streams, int pack_bytes, int64_t smem, bool input_bias) {
  int per_sm = 0;
  with_cols_one_pass_kernel<scalar_t>(act, streams, pack_bytes, [&](auto kernel) {
    allow_dynamic_smem(kernel, static_cast<size_t>(smem));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kOnePassThreads, static_cast<size_t>(smem)));
  }, input_bias);
  return per_sm;
}

template <typename scalar_t>
void launch_cols_one_pass(OnePassArgs<scalar_t> a, int64_t groups, const plan::Plan& pl) {
  const int64_t items = groups / pl.span;
  a.cluster = pl.cluster;
  TORCH_INTERNAL_ASSERT(pl.cluster == 1 || (pl.cluster * pl.span <= kWarp && pl.buffer_packs == 0 && pl.grid == items * pl.cluster),
      "channels-last one-pass clusters planned over a warp of slots (one_pass_cluster_moments), with a pipeline or with a "
      "grid of other than a cluster a slab");
  with_cols_one_pass_kernel<scalar_t>(a.epi.act, a.streams(), pl.pack_bytes, [&](auto kernel) {
    const size_t smem = static_cast<size_t>(pl.smem);
    allow_dynamic_smem(kernel, smem);
    launch_clustered(kernel, static_cast<unsigned>(pl.grid), kOnePassThreads, smem, a.cluster,
        at::cuda::getCurrentCUDAStream(), a, items, pl.buffer_packs, pl.span);
  }, /*input_bias=*/a.epi.input_bias.ptr != nullptr, /*clustered=*/a.cluster > 1);
}

// Runs the one-pass forward as planned: path Registers, Shared or Cluster, or with
// `channels_last_path` path ColsShared. The two are separate entry points (paths.h), so that each
// is instantiated in a translation unit of its own (docs/design.md, "Source layout").
template <typename scalar_t, bool channels_last_path>
void forward_one_pass(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    TORCH_INTERNAL_ASSERT(false, "one-pass forward planned for double");
  } else {
    TORCH_INTERNAL_ASSERT((pl.path == plan::Path::ColsShared) == channels_last_path,
        "one-pass forward entry called for another path");
    OnePassArgs<scalar_t> a{};
    const bool made = make_one_pass_args<scalar_t, V>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, a);
    TORCH_INTERNAL_ASSERT(made, "one-pass forward planned for arguments it cannot take");
    const int64_t items = sh.N * sh.G;
    a.cluster = 1;
    if constexpr (channels_last_path) {
      launch_cols_one_pass<scalar_t>(a, items, pl);
    } else {
      if (!a.cols) a.chunk = ceil_div(a.len / V, pl.path == plan::Path::Registers ? 1 : pl.cluster);
      if (pl.path == plan::Path::Registers) return launch_registers_planned<scalar_t, V>(a, items, pl);
      a.cluster = pl.cluster;
      const size_t smem = static_cast<size_t>(pl.smem);
      dispatch_activation(ep.activation, [&](auto act) { launch_one_pass<scalar_t, V, decltype(act)::value>(a, items, smem); });
    }
  }
}

}  // namespace

// The one-pass entry points of paths.h, instantiated per dtype in kernels/<dtype>_one_pass.cu and
// kernels/<dtype>_cols_one_pass.cu.
template <typename scalar_t>
void one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  forward_one_pass<scalar_t, false>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
}

template <typename scalar_t>
void cols_one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y,
    at::Tensor& mean, at::Tensor& rstd) {
  forward_one_pass<scalar_t, true>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
}

template <typename scalar_t>
int cols_one_pass_residency(Activation act, int streams, int pack_bytes, int64_t smem, bool input_bias) {
  return cols_one_pass_ctas_per_sm<scalar_t>(act, streams, pack_bytes, smem, input_bias);
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(T)                                                             \
  template void fusednorm::one_pass_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,       \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&)
#define FUSEDNORM_INSTANTIATE_COLS_ONE_PASS(T)                                                                \
  template void fusednorm::cols_one_pass_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,  \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&);                                                                                           \
  template int fusednorm::cols_one_pass_residency<T>(Activation, int, int, int64_t, bool)
