// The channels-last sweep forward, for channels-last groups the one-pass kernels do not hold
// (docs/design.md, "Channels-last sweep"): the sweep path's design (sweep_path.cuh) on the
// channels-last layout, where a tile of whole rows (positions s, every channel) of one sample is
// one contiguous range of x:
//   1. the moments sweep: each CTA takes one tile; every thread keeps to one pack of V channels
//      (the CTA is `rows` rows of C / V packs, so a thread's pack is the same in every row it
//      reads) and sums x - T and (x - T)^2 per channel, T its own first element of the channel;
//      the CTA combines the threads' sums per channel, then per group (plain sums in the two-step
//      form of Chan's merge, shifted by K, the first element of the channel's group in the
//      sample) and writes the tile's count, mean and M2;
//   2. the split passes' finalize merges each group's tile moments in tile order (Chan merges)
//      into its mean, rstd and the output records;
//   3. the output sweep: each CTA takes one tile (tiles of their own size); every thread computes
//      its V channels' coefficients once (output_coefficients) and streams its rows through
//      output_element, the one-pass kernels' arithmetic.
// The finalize is a programmatic dependent of the moments kernel and the output kernel of the
// finalize (common/dependent_launch.cuh): each starts on the SMs the previous one's last tiles
// leave idle, and waits there.
// The split passes' channels-last kernels, which this replaces in the forward, give every tile a
// block of channels and a chunk of rows and combine per-column Welford states over a shared-memory
// tree; their tiles were short and their states long, and they streamed at 1.1 (reduce) and 1.8
// (apply) TB/s on an H200.

#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/common/output_packs.cuh"
#include "cuda/common/pack_ring.cuh"
#include "cuda/common/shared_memory.cuh"
#include "cuda/one_pass_output.cuh"
#include "cuda/paths.h"
#include "cuda/split_path.cuh"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <cstring>
#include <limits>

namespace fusednorm {
namespace {

constexpr int kColsSweepThreads = plan::kColsSweepThreads;
constexpr int kColsSweepMinBlocks = plan::kColsSweepBlocksPerSM;
constexpr int kColsSweepOutputThreads = plan::kColsSweepOutputThreads;
constexpr int kColsSweepOutputMinBlocks = plan::kColsSweepOutputBlocksPerSM;
// The fewest rows the planner gives a thread; with a residual or multiplier the output kernel
// loads half as many rows of each stream before using any (the rest take the ring below).
constexpr int kColsSweepUnroll = plan::kColsSweepUnroll;
// Packs a thread of either kernel has in flight, less one (its PackRing's slots): 7 x 16 bytes
// where the registers held 4 (docs/design.md, "Channels-last sweep").
constexpr int kColsSweepStages = 8;
using ColsSweepRing = PackRing<kColsSweepStages>;

// The moments kernel's dynamic shared memory: the ring, then (in the same bytes) two per-thread,
// per-channel arrays of acc_t.
template <typename acc_t, int V>
constexpr size_t cols_sweep_moments_smem(int threads) {
  const size_t red = 2 * static_cast<size_t>(threads) * V * sizeof(acc_t);
  return ColsSweepRing::bytes(threads) > red ? ColsSweepRing::bytes(threads) : red;
}

template <typename scalar_t>
struct ColsSweepArgs {
  using acc_t = acc_type<scalar_t>;
  OnePassArgs<scalar_t> op;  // op.chunk and op.cluster unused
  acc_t* part;               // moments sweep: 3 per (n, g, k), k the tile of sample n
  const acc_t* rec;          // output sweep: kRec per (n, g), finalize_moments_kernel's records
  int64_t chunk;             // rows a tile
  int split;                 // tiles a sample
  int cpr;                   // packs a row, C / V
  int rows;                  // rows a CTA reads at once: blockDim.x / cpr (each kernel its own)
  // The residual-add prologue (cols_sweep_add_moments_kernel): x's second operand and the sum
  // written, x's shape and layout; null without it.
  const scalar_t* addend;
  scalar_t* sum;
};

// Tile `index` of either kernel (the moments kernel takes them last to first, the output kernel
// first to last), sample n's rows [s_begin, s_end), and the calling thread's place in it: pack p
// of every row it reads (channels [p * V, (p + 1) * V)), rows r, r + rows, ...
struct ColsSweepTile {
  int p, r;
  int64_t n, k, s_begin, s_end, sample;  // sample: the element offset of sample n
};

template <typename scalar_t>
__device__ __forceinline__ ColsSweepTile cols_sweep_tile(const ColsSweepArgs<scalar_t>& a, int64_t index) {
  ColsSweepTile t;
  t.p = static_cast<int>(threadIdx.x) % a.cpr;
  t.r = static_cast<int>(threadIdx.x) / a.cpr;
  t.n = index / a.split;
  t.k = index - t.n * a.split;
  t.s_begin = t.k * a.chunk;
  t.s_end = imin(a.op.S, t.s_begin + a.chunk);
  t.sample = t.n * a.op.S * a.op.C;
  return t;
}

// The calling thread's rows of its tile, t.s_begin + t.r, + step, ...: how many (step: a.rows).
__device__ __forceinline__ int64_t cols_sweep_thread_rows(const ColsSweepTile& t, int64_t step) {
  return t.s_end - t.s_begin > t.r ? (t.s_end - t.s_begin - t.r + step - 1) / step : 0;
}

// The CTA's per-thread, per-channel values v (rows x C, row-major in `red`) summed per channel:
// the totals end in row 0 of `red`. Each column is added by T = blockDim.x / C threads (at least
// one) over every T-th row, then by one over those T partials: a fixed order.
template <typename acc_t>
__device__ __forceinline__ void cols_sweep_channel_totals(acc_t* red, int rows, int C) {
  const int threads = static_cast<int>(blockDim.x);
  const int T = threads > C ? threads / C : 1;
  for (int e = threadIdx.x; e < C * T; e += threads) {
    const int c = e % C;
    const int i = e / C;
    acc_t u = acc_t(0);
    for (int r = i; r < rows; r += T) u += red[r * C + c];
    red[i * C + c] = u;  // read only by this thread above
  }
  __syncthreads();
  if (T > 1) {
    for (int c = threadIdx.x; c < C; c += threads) {
      acc_t u = red[c];
      for (int i = 1; i < T; ++i) u += red[i * C + c];
      red[c] = u;
    }
    __syncthreads();
  }
}

// The total of value(c) over channels c in [g * D, (g + 1) * D), in every lane of the calling warp.
template <typename acc_t, typename Value>
__device__ __forceinline__ acc_t cols_sweep_group_total(int g, int D, const Value& value) {
  const int lane = threadIdx.x & (kWarp - 1);
  acc_t u = acc_t(0);
  for (int i = lane; i < D; i += kWarp) u += value(g * D + i);
  return segment_sum(u, kWarp);
}

// Stores a thread's V per-channel values at row r, channels [c0, c0 + V) of `red` (two 16-byte
// stores a thread for V = 8: a warp's row segment is contiguous, no bank conflicts).
template <int V, typename acc_t>
__device__ __forceinline__ void cols_sweep_store_lanes(acc_t* red, int64_t at, const acc_t (&v)[V]) {
  if constexpr (std::is_same_v<acc_t, float> && V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      *reinterpret_cast<float4*>(red + at + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) red[at + j] = v[j];
  }
}

// The first channel of the group of each of channels c0 .. c0 + V - 1 (D a group): one division,
// then a step at each group boundary. The moments kernels' code after their loop runs in every
// warp at once and is bound by issue: each division by a run-time integer was ~20 instructions
// (docs/design.md, "Channels-last sweep").
template <int V>
__device__ __forceinline__ void cols_sweep_group_firsts(int c0, int D, int (&first)[V]) {
  int f = (c0 / D) * D;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (c0 + j >= f + D) f += D;
    first[j] = f;
  }
}

// The CTA's per-channel sums (q1 = sum (x - T), q2 = sum (x - T)^2 over each thread's nr rows, TK
// = T - K, K the finalize's shift) combined per channel, then per group, into the tile's count,
// mean of x - K and M2 in a.part. Called by every thread once its ring's slots are free (they
// become red1 and red2).
template <int V, typename scalar_t, typename acc_t = acc_type<scalar_t>>
__device__ __forceinline__ void cols_sweep_tile_moments(const ColsSweepArgs<scalar_t>& a, const ColsSweepTile& tile,
    int64_t nr, const acc_t (&TK)[V], const acc_t (&q1)[V], const acc_t (&q2)[V], unsigned char* smem) {
  const OnePassArgs<scalar_t>& o = a.op;
  const int C = static_cast<int>(o.C);
  const int c0 = tile.p * V;
  acc_t* red1 = reinterpret_cast<acc_t*>(smem);
  acc_t* red2 = red1 + static_cast<int64_t>(blockDim.x) * V;
  // Per channel, the tile's sum of x - K: each thread's nr * (T - K) + q1, added up over the rows.
  const acc_t cnt = static_cast<acc_t>(nr);
  const acc_t rows_n = static_cast<acc_t>(tile.s_end - tile.s_begin);  // a channel's count in the tile
  acc_t v[V];
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = nr > 0 ? cnt * TK[j] + q1[j] : acc_t(0);
  cols_sweep_store_lanes<V>(red1, static_cast<int64_t>(tile.r) * C + c0, v);
  __syncthreads();
  cols_sweep_channel_totals(red1, a.rows, C);
  // Per channel, the tile's M2: each thread's own M2 plus nr times its mean's squared distance
  // from the channel's (the two-step form of Chan's merge, in plain sums). Reciprocals, not
  // divisions: this code is issue-bound (cols_sweep_group_firsts).
  const acc_t inv_cnt = nr > 0 ? acc_t(1) / cnt : acc_t(0);
  const acc_t inv_rows = acc_t(1) / rows_n;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t mean_t = q1[j] * inv_cnt;                      // of x - T
    const acc_t d = TK[j] + mean_t - red1[c0 + j] * inv_rows;  // thread's mean - channel's
    v[j] = nr > 0 ? (q2[j] - q1[j] * mean_t) + cnt * d * d : acc_t(0);
  }
  cols_sweep_store_lanes<V>(red2, static_cast<int64_t>(tile.r) * C + c0, v);
  __syncthreads();
  cols_sweep_channel_totals(red2, a.rows, C);
  // Per group, the same two steps over its D channels (equal counts).
  const int warp = static_cast<int>(threadIdx.x >> kLogWarp);
  const int warps = static_cast<int>(blockDim.x >> kLogWarp);
  const int D = static_cast<int>(o.D), G = static_cast<int>(o.G);
  const acc_t count = rows_n * static_cast<acc_t>(D);
  const acc_t inv_count = acc_t(1) / count;
  const auto store = [&](int g, acc_t mean, acc_t m2) {
    acc_t* slot = a.part + ((tile.n * o.G + g) * a.split + tile.k) * 3;
    slot[0] = count;
    slot[1] = mean;
    slot[2] = m2;
  };
  // A channel's term of its group's M2: the channel's own plus rows_n times its mean's squared
  // distance from the group's.
  const auto channel_m2 = [&](int c, acc_t mean) {
    const acc_t d = red1[c] * inv_rows - mean;
    return red2[c] + rows_n * d * d;
  };
  const int lane = static_cast<int>(threadIdx.x & (kWarp - 1));
  if (D <= kWarp / 2) {
    // Groups of at most 16 channels: a warp takes kWarp / S at once, S = D rounded up to a power
    // of two, and reduces each over its segment of S lanes (the same additions, in the same
    // order, as the whole-warp reduction below, whose other lanes add zeros).
    int log_s = 0;
    while ((1 << log_s) < D) ++log_s;
    const int S = 1 << log_s, per_warp = kWarp >> log_s;
    const int i = lane & (S - 1);
    for (int g0 = warp * per_warp; g0 < G; g0 += warps * per_warp) {
      const int g = g0 + (lane >> log_s);
      const bool mine = g < G && i < D;
      const acc_t mean = segment_sum(mine ? red1[g * D + i] : acc_t(0), S) * inv_count;
      const acc_t m2 = segment_sum(mine ? channel_m2(g * D + i, mean) : acc_t(0), S);
      if (i == 0 && g < G) store(g, mean, m2);
    }
    return;
  }
  for (int g = warp; g < G; g += warps) {
    const acc_t mean = cols_sweep_group_total<acc_t>(g, D, [&](int c) { return red1[c]; }) * inv_count;
    const acc_t m2 = cols_sweep_group_total<acc_t>(g, D, [&](int c) { return channel_m2(c, mean); });
    if (lane == 0) store(g, mean, m2);
  }
}

// kBias: with input_bias (docs/design.md, "Input bias"), its own instantiation (its loads of p
// took the kernel without it from 80 to 172 bytes of spill loads around the loop).
template <typename scalar_t, int V, bool kBias>
__global__ void __launch_bounds__(kColsSweepThreads, kColsSweepMinBlocks)
    cols_sweep_moments_kernel(const __grid_constant__ ColsSweepArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  static_assert(sizeof(P) == 16, "the channels-last sweep reads 16-byte packs");
  // The ring's slots during the loop, then the per-thread, per-channel values (rows x C, reduced
  // to channel totals in row 0) in red1 and red2 (cols_sweep_moments_smem).
  extern __shared__ __align__(16) unsigned char cols_sweep_smem[];
  const OnePassArgs<scalar_t>& o = a.op;
  const int D = static_cast<int>(o.D);
  // The tiles last to first: the first waves read the end of x, which its writer (a convolution)
  // wrote last and L2 may still hold, and the output kernel (first to last) then starts on the
  // tiles read here last (docs/design.md, "Channels-last sweep").
  const ColsSweepTile tile = cols_sweep_tile(a, static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x);
  const int p = tile.p, r = tile.r;
  const int64_t n = tile.n, s_begin = tile.s_begin, sample = tile.sample;
  // Row s_begin + r + i * step's pack at xs + i * stride.
  const uint4* xs = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(o.x + sample) + p) + (s_begin + r) * a.cpr;
  const int c0 = p * V;
  const int64_t step = a.rows;
  const int64_t stride = step * a.cpr;
  const int64_t nr = cols_sweep_thread_rows(tile, step);
  const ColsSweepRing ring{reinterpret_cast<uint4*>(cols_sweep_smem) + threadIdx.x, static_cast<int>(blockDim.x)};
  ring.start(nr, xs, stride);
  // Two shifts a channel (docs/design.md, "Channels-last sweep"): the thread sums x - T, T its
  // own first element of the channel, so that M2 = q2 - q1^2 / nr loses digits only to an outlier
  // among its own few rows (no second pass over the tile, whatever the data); the sums it hands
  // on are of x - K, K the first element of the channel's group in the sample, the finalize's
  // shift (finalize_moments_kernel).
  // T stays in the input's type (half the registers of acc_t for 16-bit types).
  P T;
  if (nr > 0) {
    const uint4 w = ring.take(0);
    memcpy(&T, &w, sizeof(P));
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) T.v[j] = scalar_t(0);
  }
  launch_dependents();
  acc_t q1[V], q2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) q1[j] = q2[j] = acc_t(0);
  for (int64_t i = 0; i < nr; ++i) {
    const uint4 w = ring.next(i, nr, xs, stride);
    P xp;
    memcpy(&xp, &w, sizeof(P));
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t d = pack_element<acc_t>(xp, j) - pack_element<acc_t>(T, j);
      q1[j] += d;
      q2[j] += d * d;
    }
  }
  __pipeline_wait_prior(0);  // (only empty groups can be left)
  __syncthreads();           // every thread done with its slots: red1 and red2 take their place
  // kBias: the kernel normalizes x' = x + p, and K is the first element of x'-s group: the sums of
  // x' - T' (T' = T + p_c) are those of x - T, and only T' - K = T - (K - p_c) changes.
  acc_t TK[V];  // loaded after the loop (registers); TK = T - K
  int first[V];
  cols_sweep_group_firsts<V>(c0, D, first);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c_first = first[j];
    acc_t K = static_cast<acc_t>(o.x[sample + c_first]);
    if constexpr (kBias) {
      const InputBiasRef<scalar_t>& ib = o.epi.input_bias;
      K += ib.template at<acc_t>(n, c_first) - ib.template at<acc_t>(n, c0 + j);
    }
    TK[j] = pack_element<acc_t>(T, j) - K;
  }
  cols_sweep_tile_moments<V>(a, tile, nr, TK, q1, q2, cols_sweep_smem);
}

// The residual-add prologue (docs/design.md, "Residual-add prologue"): the moments kernel of
// sum = x + addend (+ input_bias), each element added in acc_t and rounded once to scalar_t,
// which it writes to a.sum and sums as the kernel above sums x (the statistics are the written
// sum's). Its two streams share the ring's bytes (half the rows ahead each). The shift K stays
// the finalize's, x + input_bias at the group's first element (finalize_shift), not an element
// of the sum: any K is exact, and this one the finalize can read before its wait.
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kColsSweepThreads, kColsSweepMinBlocks)
    cols_sweep_add_moments_kernel(const __grid_constant__ ColsSweepArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  using Ring = PairRing<kColsSweepStages / 2>;
  static_assert(Ring::bytes(kColsSweepThreads) == ColsSweepRing::bytes(kColsSweepThreads), "the same bytes");
  extern __shared__ __align__(16) unsigned char cols_sweep_smem[];
  const OnePassArgs<scalar_t>& o = a.op;
  const int D = static_cast<int>(o.D);
  const ColsSweepTile tile = cols_sweep_tile(a, static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x);
  const int p = tile.p, r = tile.r;
  const int64_t n = tile.n, s_begin = tile.s_begin, sample = tile.sample;
  const int64_t v0 = (s_begin + r) * a.cpr;
  // The ring's running pointers into x and the addend (PairRing::start / next), and the sum's.
  const uint4* xs = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(o.x + sample) + p) + v0;
  const uint4* as = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(a.addend + sample) + p) + v0;
  uint4* ss = reinterpret_cast<uint4*>(reinterpret_cast<P*>(a.sum + sample) + p) + v0;
  const int c0 = p * V;
  const int64_t step = a.rows;
  const int64_t stride = step * a.cpr;
  const int64_t nr = cols_sweep_thread_rows(tile, step);
  const Ring ring{reinterpret_cast<uint4*>(cols_sweep_smem) + threadIdx.x, static_cast<int>(blockDim.x)};
  ring.start(nr, xs, as, stride);
  // input_bias at the thread's channels (0 without one), and T, the thread's own first element
  // of the sum a channel (as the kernel above), kept as packs (4 registers each).
  uint4 pw;
  {
    P pb;
#pragma unroll
    for (int j = 0; j < V; ++j) pb.v[j] = o.epi.input_bias.template at<scalar_t>(n, c0 + j);
    memcpy(&pw, &pb, sizeof(P));
  }
  const auto add = [&](const uint4& wx, const uint4& wa) {
    P xp, ap, pb, sp;
    memcpy(&xp, &wx, sizeof(P));
    memcpy(&ap, &wa, sizeof(P));
    memcpy(&pb, &pw, sizeof(P));
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sp.v[j] = static_cast<scalar_t>(
          pack_element<acc_t>(xp, j) + pack_element<acc_t>(ap, j) + pack_element<acc_t>(pb, j));
    }
    uint4 ws;
    memcpy(&ws, &sp, sizeof(P));
    return ws;
  };
  uint4 Tw = make_uint4(0, 0, 0, 0);  // (0 in every 2- and 4-byte floating type)
  if (nr > 0) {
    uint4 wx, wa;
    ring.take(0, wx, wa);
    Tw = add(wx, wa);
  }
  launch_dependents();
  acc_t q1[V], q2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) q1[j] = q2[j] = acc_t(0);
  // One row at a time: unrolled by two, as the compiler would, it spills twice as much and ran
  // 3-6% slower (docs/design.md, "Measured and not kept").
#pragma unroll 1
  for (int64_t i = 0; i < nr; ++i) {
    uint4 wx, wa;
    ring.next(i, nr, xs, as, stride, wx, wa);
    const uint4 ws = add(wx, wa);
    *ss = ws;
    ss += stride;
    P sp, T;
    memcpy(&sp, &ws, sizeof(P));
    memcpy(&T, &Tw, sizeof(P));
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t d = pack_element<acc_t>(sp, j) - pack_element<acc_t>(T, j);
      q1[j] += d;
      q2[j] += d * d;
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  acc_t TK[V];
  int first[V];
  cols_sweep_group_firsts<V>(c0, D, first);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c_first = first[j];
    const acc_t K = static_cast<acc_t>(o.x[sample + c_first]) + o.epi.input_bias.template at<acc_t>(n, c_first);
    P T;
    memcpy(&T, &Tw, sizeof(P));
    TK[j] = pack_element<acc_t>(T, j) - K;
  }
  cols_sweep_tile_moments<V>(a, tile, nr, TK, q1, q2, cols_sweep_smem);
}

// The output kernel's per-channel constants of a thread's V channels [c0, c0 + V) in sample n:
// K, the shifted mean, and the coefficients of output_element.
template <typename acc_t, int V>
struct OutputChannels {
  acc_t K[V], sm[V], ca[V], cb[V];
};

// Waits for the finalize's records (the output kernel is its programmatic dependent), then
// computes the thread's OutputChannels once. The parameters and input_bias are loaded before the
// wait (the finalize does not write them): after it, only the records' loads stand between the
// finalize's end and the first row.
template <int V, typename scalar_t, typename acc_t = acc_type<scalar_t>>
__device__ __forceinline__ OutputChannels<acc_t, V> cols_sweep_output_channels(
    const ColsSweepArgs<scalar_t>& a, int64_t n, int c0) {
  const OnePassArgs<scalar_t>& o = a.op;
  const EpiArgs<scalar_t>& e = o.epi;
  Affine<acc_t> m[V];
  acc_t p[V];  // input_bias (x' - K' = x - (K' - p_c), docs/design.md, "Input bias")
#pragma unroll
  for (int j = 0; j < V; ++j) {
    m[j] = channel_affine<acc_t>(o, n, c0 + j);
    p[j] = e.input_bias.template at<acc_t>(n, c0 + j);  // (0 without one)
  }
  wait_for_primary();  // the finalize's records
  OutputChannels<acc_t, V> ch;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t* rec = a.rec + (n * o.G + (c0 + j) / o.D) * kRec;
    ch.K[j] = e.input_bias.ptr != nullptr ? rec[0] - p[j] : rec[0];
    ch.sm[j] = rec[1];
    const Affine<acc_t> cf = output_coefficients(m[j], rec[2]);
    ch.ca[j] = cf.w;
    ch.cb[j] = cf.b;
  }
  return ch;
}

// OPS: with a residual or a multiplier (more streams, fewer rows in flight: loaded into registers,
// as output_packs does; without them x takes the thread's ring).
template <typename scalar_t, int V, Activation A, bool OPS>
__global__ void __launch_bounds__(kColsSweepOutputThreads, kColsSweepOutputMinBlocks)
    cols_sweep_output_kernel(const __grid_constant__ ColsSweepArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const OnePassArgs<scalar_t>& o = a.op;
  const EpiArgs<scalar_t>& e = o.epi;
  const ColsSweepTile tile = cols_sweep_tile(a, blockIdx.x);
  const int p = tile.p, r = tile.r;
  const int64_t n = tile.n, s_begin = tile.s_begin, s_end = tile.s_end, sample = tile.sample;
  const int c0 = p * V;
  const uint4* xs = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(o.x + sample) + p);
  uint4* ys = reinterpret_cast<uint4*>(reinterpret_cast<P*>(o.y + sample) + p);
  const int64_t step = a.rows;
  const int64_t stride = step * a.cpr;  // packs between a thread's rows
  if constexpr (!OPS) {
    // x through the thread's ring, its first rows in flight before the wait for the finalize and
    // the coefficients' loads (x is the moments kernel's input: written before it began).
    __shared__ uint4 slots[ColsSweepRing::bytes(kColsSweepOutputThreads) / sizeof(uint4)];
    const ColsSweepRing ring{slots + threadIdx.x, static_cast<int>(blockDim.x)};
    const int64_t nr = cols_sweep_thread_rows(tile, step);
    const int64_t v0 = (s_begin + r) * a.cpr;
    ring.start(nr, xs + v0, stride);
    const OutputChannels<acc_t, V> ch = cols_sweep_output_channels<V>(a, n, c0);
    for (int64_t i = 0; i < nr; ++i) {
      const uint4 w = ring.next(i, nr, xs + v0, stride);
      P xp;
      memcpy(&xp, &w, sizeof(P));
      acc_t z[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        z[j] = output_element<A>(e, ch.K[j], ch.sm[j], ch.ca[j], ch.cb[j], xp, xp, false, xp, false, j);
      }
      const P yp = round_pack<scalar_t, V>(z);
      uint4 yw;
      memcpy(&yw, &yp, sizeof(P));
      ys[v0 + i * stride] = yw;
    }
  } else {
    const OutputChannels<acc_t, V> ch = cols_sweep_output_channels<V>(a, n, c0);
    const uint4* rs = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(offset_or_null(e.residual, sample)) + p);
    const uint4* ms = reinterpret_cast<const uint4*>(reinterpret_cast<const P*>(offset_or_null(e.multiplier, sample)) + p);
    const bool has_r = e.residual != nullptr;
    const bool has_m = e.multiplier != nullptr;
    constexpr int U = kColsSweepUnroll / 2;  // more streams, fewer rows in flight
    for (int64_t s = s_begin + r; s < s_end; s += U * step) {
      const int64_t v = s * a.cpr;
      output_packs<U, scalar_t, V>(xs, rs, ms, ys, has_r, has_m, [&](int u) { return s + u * step < s_end; },
          [&](int u) { return v + u * stride; },
          [&](int j, const P& xp, const P& rp, const P& mp) {
            return output_element<A>(e, ch.K[j], ch.sm[j], ch.ca[j], ch.cb[j], xp, rp, has_r, mp, has_m, j);
          });
    }
  }
}

}  // namespace

// Runs the channels-last sweep forward as planned (plan.path == ColsSweep; plan.reduce: the tiles,
// plan.threads: the moments CTA; the output CTA is cols_sweep_threads(kColsSweepOutputThreads)).
template <typename scalar_t>
void cols_sweep_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  using acc_t = acc_type<scalar_t>;
  static_assert(std::is_same_v<acc_t, float>, "the channels-last sweep is instantiated for 2- and 4-byte types");
  constexpr int V = pack_width<scalar_t>();
  ColsSweepArgs<scalar_t> a{};
  OnePassArgs<scalar_t>& o = a.op;
  const bool made = make_forward_args<scalar_t>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, o);
  TORCH_INTERNAL_ASSERT(made && o.cols && sh.C % V == 0, "channels-last sweep planned for arguments it cannot take");
  o.cluster = 1;
  a.cpr = static_cast<int>(sh.C / V);
  a.rows = pl.threads / a.cpr;
  const int out_threads = plan::cols_sweep_threads(kColsSweepOutputThreads, a.cpr);
  a.chunk = pl.reduce.chunk;
  a.split = static_cast<int>(pl.reduce.split);
  const int64_t tiles = sh.N * a.split;
  const int64_t out_tiles = sh.N * pl.output.split;
  TORCH_INTERNAL_ASSERT(tiles == pl.reduce.tiles && out_tiles == pl.output.tiles && a.rows >= 2 &&
      a.rows * a.cpr == pl.threads && pl.threads <= kColsSweepThreads && out_threads > 0 &&
      imax(tiles, out_tiles) <= std::numeric_limits<int>::max());
  if (tiles == 0) return;
  at::Tensor part = at::detail::empty_cuda({sh.N * sh.G * a.split * 3}, x.options().dtype(at::kFloat));
  a.part = part.data_ptr<acc_t>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = cols_sweep_moments_smem<acc_t, V>(pl.threads);
  const auto moments = [&](auto kernel) {
    allow_dynamic_smem(kernel, smem);
    kernel<<<static_cast<unsigned>(tiles), pl.threads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (ep.addend.defined()) {
    a.addend = ep.addend.data_ptr<scalar_t>();
    a.sum = ep.sum.data_ptr<scalar_t>();
    moments(cols_sweep_add_moments_kernel<scalar_t, V>);
  } else if (o.epi.input_bias.ptr != nullptr) {
    moments(cols_sweep_moments_kernel<scalar_t, V, true>);
  } else {
    moments(cols_sweep_moments_kernel<scalar_t, V, false>);
  }
  const at::Tensor rec =
      finalize_moments_pass<scalar_t>(part, a.split, x, eps, sh, layout, mean, rstd, /*dependent=*/true, o.epi.input_bias);
  a.rec = rec.data_ptr<acc_t>();
  if (ep.addend.defined()) {
    // The output kernel normalizes the sum, input_bias included. Its ring's first rows, issued
    // before it waits for the finalize, read what the moments kernel wrote: the finalize lets
    // it start only once it has waited for the moments kernel's end, and 16-byte cp.async reads
    // L2 (docs/design.md, "Residual-add prologue").
    o.x = a.sum;
    o.epi.input_bias = InputBiasRef<scalar_t>{nullptr, 0};
  }
  a.rows = out_threads / a.cpr;
  a.chunk = pl.output.chunk;
  a.split = static_cast<int>(pl.output.split);
  const bool operands = o.epi.residual != nullptr || o.epi.multiplier != nullptr;
  dispatch_activation(ep.activation, [&](auto act) {
    constexpr Activation kA = decltype(act)::value;
    const auto grid = static_cast<unsigned>(out_tiles);
    if (operands) {
      launch_maybe_dependent(cols_sweep_output_kernel<scalar_t, V, kA, true>, grid, out_threads, stream, a);
    } else {
      launch_maybe_dependent(cols_sweep_output_kernel<scalar_t, V, kA, false>, grid, out_threads, stream, a);
    }
  });
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_COLS_SWEEP(T)                                                                   \
  template void fusednorm::cols_sweep_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,      \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&)
