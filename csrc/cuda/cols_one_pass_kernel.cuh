// The one-pass forward of ChannelsLast groups in shared memory (path ColsShared; docs/design.md,
// "Channels-last one-pass"): group_norm_cols_one_pass_kernel, the instantiation a plan calls
// (with_cols_one_pass_kernel), the planner's residency question about it and its launcher. The
// entry points that reach them (group_norm_one_pass.cuh) are instantiated apart from the
// ChannelsFirst ones, in kernels/<dtype>_cols_one_pass.cu.

#pragma once

#include <cuda_pipeline.h>
#include "cuda/clusters.cuh"
#include "cuda/cols_place.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/shared_memory.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_output.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

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
  extern __shared__ __align__(kSmemLineBytes) unsigned char one_pass_smem[];
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
        tk = pack_element<acc_t>(first, 0) - KL[0];
#pragma unroll
        for (int j = 0; j < V; ++j) KL[j] += tk;
      } else {
        T = pack_element<acc_t>(first, 0);
        tk = T - K;
      }
      // (Packs copied out of shared memory whole: one V-wide load each.)
      for (int64_t s = r_begin + row0; s < r_end; s += step) {
        const P x(xs[place.dense(s - r_begin)]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          acc_t d;
          if constexpr (kBias) {
            d = pack_element<acc_t>(x, j) - KL[j];
          } else {
            d = pack_element<acc_t>(x, j) - T;
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

}  // namespace
}  // namespace fusednorm
