// Reduction states (moments merged with Chan's formula, gradient sums), their warp shuffles and
// segment reductions, and the per-thread accumulation of packs (docs/design.md, "Numerics").
#pragma once

#include "cuda/common/base.cuh"

#include <cstdint>

namespace fusednorm {
namespace {

// ---------------------------------------------------------------------------------------------
// Reduction states. L lanes: L == 1 folds a whole pack into one state (ChannelsFirst rows, where
// a thread's elements all belong to one row), L == V keeps one state per element of the pack
// (ChannelsLast, where element j of a pack is channel c0 + j).

// Moments of x - K: count, mean and sum of squared deviations (M2). All lanes share one count.
template <typename acc_t, int L>
struct Moments {
  acc_t n;
  acc_t mean[L];
  acc_t m2[L];
};

// Backward sums: dy, dy * (x - m), x - m.
template <typename acc_t, int L>
struct Sums {
  acc_t dy[L];
  acc_t dyxc[L];
  acc_t xc[L];
};

template <typename acc_t, int L>
__device__ __forceinline__ void clear(Moments<acc_t, L>& s) {
  s.n = acc_t(0);
#pragma unroll
  for (int l = 0; l < L; ++l) s.mean[l] = s.m2[l] = acc_t(0);
}

template <typename acc_t, int L>
__device__ __forceinline__ void clear(Sums<acc_t, L>& s) {
#pragma unroll
  for (int l = 0; l < L; ++l) s.dy[l] = s.dyxc[l] = s.xc[l] = acc_t(0);
}

// Chan et al.'s parallel update: exact for empty operands (an empty state has mean 0), no
// cancellation (M2 only accumulates non-negative terms).
template <typename acc_t, int L>
__device__ __forceinline__ Moments<acc_t, L> merge(const Moments<acc_t, L>& a, const Moments<acc_t, L>& b) {
  Moments<acc_t, L> r;
  r.n = a.n + b.n;
  const acc_t wb = r.n > acc_t(0) ? b.n / r.n : acc_t(0);
  const acc_t cross = a.n * wb;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const acc_t d = b.mean[l] - a.mean[l];
    r.mean[l] = a.mean[l] + d * wb;
    r.m2[l] = a.m2[l] + b.m2[l] + d * d * cross;
  }
  return r;
}

template <typename acc_t, int L>
__device__ __forceinline__ Sums<acc_t, L> merge(const Sums<acc_t, L>& a, const Sums<acc_t, L>& b) {
  Sums<acc_t, L> r;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.dy[l] = a.dy[l] + b.dy[l];
    r.dyxc[l] = a.dyxc[l] + b.dyxc[l];
    r.xc[l] = a.xc[l] + b.xc[l];
  }
  return r;
}

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

// The sum of v over each aligned segment of `width` lanes (a power of two, at most kWarp), in
// every lane of the segment: a butterfly, the same order in every segment and every warp.
template <typename T>
__device__ __forceinline__ T segment_sum(T v, int width) {
  for (int off = width / 2; off > 0; off >>= 1) v += shfl_xor(v, off);
  return v;
}

template <typename acc_t, int L>
__device__ __forceinline__ Moments<acc_t, L> shfl_xor(const Moments<acc_t, L>& v, int mask) {
  Moments<acc_t, L> r;
  r.n = shfl_xor(v.n, mask);
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.mean[l] = shfl_xor(v.mean[l], mask);
    r.m2[l] = shfl_xor(v.m2[l], mask);
  }
  return r;
}

template <typename acc_t, int L>
__device__ __forceinline__ Sums<acc_t, L> shfl_xor(const Sums<acc_t, L>& v, int mask) {
  Sums<acc_t, L> r;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.dy[l] = shfl_xor(v.dy[l], mask);
    r.dyxc[l] = shfl_xor(v.dyxc[l], mask);
    r.xc[l] = shfl_xor(v.xc[l], mask);
  }
  return r;
}

// Combines `v` over each aligned segment of 2^log_width consecutive threads (log_width <=
// kLogThreads) in a fixed order; the segment's first thread gets the total. Every thread of the
// block must call it (it synchronises when a segment spans several warps). `smem` holds
// kThreads / kWarp states.
template <typename State>
__device__ __forceinline__ State segment_reduce(State v, int log_width, State* smem) {
  const int in_warp = log_width < kLogWarp ? log_width : kLogWarp;
  for (int off = (1 << in_warp) >> 1; off > 0; off >>= 1) v = merge(v, shfl_xor(v, off));
  if (log_width > kLogWarp) {
    const int warp = threadIdx.x >> kLogWarp;
    if ((threadIdx.x & (kWarp - 1)) == 0) smem[warp] = v;
    __syncthreads();
    if ((threadIdx.x & ((1 << log_width) - 1)) == 0) {
      // This thread's warp is the first of its segment.
      for (int w = 1; w < (1 << (log_width - kLogWarp)); ++w) v = merge(v, smem[warp + w]);
    }
    __syncthreads();  // smem is reused by the next call
  }
  return v;
}

// The sum of v over each aligned segment of 2^log_width consecutive threads (log_width <=
// kLogThreads), in every thread of the segment: a butterfly in each warp, then the segment's
// warps' sums in warp order. Every thread of the block must call it (it synchronises when a
// segment spans several warps). `smem` holds kThreads / kWarp values.
template <typename acc_t>
__device__ __forceinline__ acc_t segment_all_sum(acc_t v, int log_width, acc_t* smem) {
  v = segment_sum(v, 1 << (log_width < kLogWarp ? log_width : kLogWarp));
  if (log_width > kLogWarp) {
    const int warp = threadIdx.x >> kLogWarp;
    if ((threadIdx.x & (kWarp - 1)) == 0) smem[warp] = v;
    __syncthreads();
    const int first = warp & ~((1 << (log_width - kLogWarp)) - 1);  // the segment's first warp
    v = smem[first];
    for (int w = 1; w < (1 << (log_width - kLogWarp)); ++w) v += smem[first + w];
    __syncthreads();  // smem is reused by the next call
  }
  return v;
}

template <int L, int V>
__device__ __forceinline__ constexpr int lane_of(int j) {
  return L == 1 ? 0 : j;
}

// Folds a batch (the first `nvalid` of U packs) of x - shift into `st`: the batch's own mean and
// M2 are computed from registers in two passes, then merged with Chan's formula. Few divisions
// per element, no E[x^2] - E[x]^2.
template <int U, int V, int L, typename acc_t>
__device__ __forceinline__ void accumulate(
    Moments<acc_t, L>& st, const acc_t (&x)[U][V], const acc_t (&shift)[L], int nvalid) {
  static_assert(L == 1 || L == V, "lanes");
  if (nvalid <= 0) return;
  Moments<acc_t, L> b;
  clear(b);
  b.n = static_cast<acc_t>(nvalid * (V / L));
  const acc_t inv = acc_t(1) / b.n;
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (u < nvalid) b.mean[lane_of<L, V>(j)] += x[u][j] - shift[lane_of<L, V>(j)];
    }
  }
#pragma unroll
  for (int l = 0; l < L; ++l) b.mean[l] *= inv;
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int l = lane_of<L, V>(j);
      const acc_t d = (x[u][j] - shift[l]) - b.mean[l];
      if (u < nvalid) b.m2[l] += d * d;
    }
  }
  st = merge(st, b);
}

template <int U, int V, int L, typename acc_t>
__device__ __forceinline__ void accumulate(
    Sums<acc_t, L>& st, const acc_t (&x)[U][V], const acc_t (&dy)[U][V], const acc_t (&mean)[L],
    int nvalid) {
  static_assert(L == 1 || L == V, "lanes");
  Sums<acc_t, L> b;  // per-batch sums first: shorter addition chains
  clear(b);
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int l = lane_of<L, V>(j);
      if (u < nvalid) {
        const acc_t xc = x[u][j] - mean[l];
        b.dy[l] += dy[u][j];
        b.dyxc[l] += dy[u][j] * xc;
        b.xc[l] += xc;
      }
    }
  }
  st = merge(st, b);
}

}  // namespace
}  // namespace fusednorm
