// The sweep forward, for 16-bit ChannelsFirst groups of 9 MB and more (4 MB with a residual or
// multiplier), and inputs whose rows are contiguous but not back to back, read where they lie
// (docs/design.md, "Sweep path"): the split passes' design (x read twice) in two launches of
// streaming kernels, with no barrier:
//   1. the moments sweep: each CTA takes one tile (a chunk of a group) and writes its count, mean
//      and M2 of x - K (K the group's first element; each thread's sums shifted by its own first
//      element, block_moments_of_shifted_sums, so no pass depends on the data);
//   2. the output sweep: each CTA takes one tile, merges its group's tile moments in one fixed
//      order (every CTA gets the same bits; the group's first tile writes its mean and rstd) and
//      writes y through OnePassOutput's epilogue, one channel's coefficients at a time.
// Tiles of kSweepTileBytes, many more than the resident CTAs, so that the block scheduler keeps
// every SM streaming to the end: one contiguous range a CTA (a persistent grid) ran 10% slower
// on the video-VAE row, the SMs' unequal shares of the DRAM bandwidth then setting the pace.

#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/output_packs.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_output.cuh"
#include "cuda/paths.h"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <cstring>
#include <limits>

namespace fusednorm {
namespace {

// The sweeps' CTAs: 512 threads, as the team forward's.
constexpr int kSweepThreads = 512;
// The output kernel's CTAs an SM its register cap guarantees (its launch bounds).
constexpr int kSweepOutputBlocksPerSM = 2;
// Packs each thread loads before using any: with three CTAs an SM (moments) or two (output), 64-96
// KB in flight an SM.
constexpr int kSweepUnroll = 4;

template <typename scalar_t>
struct SweepArgs {
  using acc_t = acc_type<scalar_t>;
  OnePassArgs<scalar_t> op;  // op.chunk and op.cluster unused
  acc_t* part;               // 3 per tile (count, mean, M2), tile g * split + k
  int64_t lenv;              // packs a group
  int64_t chunk;             // packs a tile
  int split;                 // tiles a group
  // Where x's packs lie (y's are back to back): group (n, gl) from n * x_sample + gl * x_group
  // packs on, its channels' rows x_seg_stride packs apart; read in segments of x_seg packs, each
  // within one row or, where x is dense, the whole group (x_seg = lenv: one segment). Strided rows
  // (docs/design.md, "Sweep path": the frames of an NCDHW video): x_seg = S / V.
  int64_t x_seg, x_seg_stride, x_sample, x_group;

  // The first pack of x of segment `j` of group `g`.
  __device__ __forceinline__ int64_t x_segment(int64_t g, int64_t j) const {
    const int64_t n = div_nn(g, op.G);
    return n * x_sample + (g - n * op.G) * x_group + j * x_seg_stride;
  }
};

// The output sweep is a programmatic dependent of the moments sweep (common/dependent_launch.cuh;
// docs/design.md, "Sweep path"): each moments CTA, once started, lets the output sweep launch, so
// that output CTAs take the SMs the moments sweep's last tiles leave idle; an output CTA waits for
// the whole moments sweep (its writes visible) before it reads a tile moment.

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kSweepThreads, 3) group_norm_sweep_moments_kernel(const __grid_constant__ SweepArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  __shared__ acc_t red[kSweepThreads / kWarp];
  const OnePassArgs<scalar_t>& o = a.op;
  const int64_t t = blockIdx.x;
  const int64_t g = div_nn(t, a.split);
  const int64_t k = t - g * a.split;
  // The tile's packs [v0, v1) of its group, in the group's segments (one where x is dense).
  const int64_t v0 = k * a.chunk;
  const int64_t v1 = imin(a.lenv, (k + 1) * a.chunk);
  const P* xp0 = reinterpret_cast<const P*>(o.x);
  const acc_t K = static_cast<acc_t>(o.x[a.x_segment(g, 0) * V]);
  launch_dependents();
  // Sums of x - T, T the thread's first element (block_moments_of_shifted_sums).
  acc_t T = acc_t(0), s1 = acc_t(0), s2 = acc_t(0);
  bool first = true;
  int mine = 0;  // packs this thread summed
  for (int64_t e0 = v0; e0 < v1;) {
    const int64_t j = div_nn(e0, a.x_seg);
    const int64_t e1 = imin(v1, (j + 1) * a.x_seg);
    const P* xg = xp0 + a.x_segment(g, j) + (e0 - j * a.x_seg);
    const int64_t count = e1 - e0;
    for (int64_t v = threadIdx.x; v < count; v += kSweepUnroll * kSweepThreads) {
      uint4 xw[kSweepUnroll];
#pragma unroll
      for (int u = 0; u < kSweepUnroll; ++u) {
        if (v + u * kSweepThreads < count) xw[u] = __ldg(reinterpret_cast<const uint4*>(xg + v + u * kSweepThreads));
      }
      if (first) {
        P p0;
        memcpy(&p0, &xw[0], sizeof(P));
        T = pack_element<acc_t>(p0, 0);
        first = false;
      }
#pragma unroll
      for (int u = 0; u < kSweepUnroll; ++u) {
        if (v + u * kSweepThreads < count) {
          P xp;
          memcpy(&xp, &xw[u], sizeof(P));
          add_shifted_sums(xp, T, s1, s2);
          ++mine;
        }
      }
    }
    e0 = e1;
  }
  const acc_t n = static_cast<acc_t>((v1 - v0) * V);
  const BlockMoments<acc_t> bm = block_moments_of_shifted_sums<kSweepThreads>(
      static_cast<acc_t>(mine * V), T - K, s1, s2, n, red);
  const acc_t mean = bm.mean;
  const acc_t m2 = bm.m2;
  if (threadIdx.x == 0) {
    acc_t* slot = a.part + t * 3;
    slot[0] = n;
    slot[1] = mean;
    slot[2] = m2;
  }
}

// OPS: with a residual or a multiplier (a kernel of its own: its three streams need registers the
// plain loop then lacked, ptxas spilling in both).
template <typename scalar_t, int V, Activation A, bool OPS>
__global__ void __launch_bounds__(kSweepThreads, kSweepOutputBlocksPerSM) group_norm_sweep_output_kernel(const __grid_constant__ SweepArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  __shared__ acc_t fold[2 * kSweepThreads / kWarp];
  const OnePassArgs<scalar_t>& o = a.op;
  const EpiArgs<scalar_t>& e = o.epi;
  const int64_t t = blockIdx.x;
  const int64_t g = div_nn(t, a.split);
  const int64_t k = t - g * a.split;
  const int64_t g_begin = g * a.lenv;
  const int64_t v0 = g_begin + k * a.chunk;
  const int64_t v1 = g_begin + imin(a.lenv, (k + 1) * a.chunk);
  const acc_t* slots = a.part + g * a.split * 3;  // the group's tiles, written by the moments sweep
  // The shift, read before the wait (the moments sweep does not write x): after it, this load
  // would follow the fold's barriers.
  const acc_t K = static_cast<acc_t>(o.x[a.x_segment(g, 0) * V]);
  wait_for_primary();
  const BlockMoments<acc_t> m = parts_moments<kSweepThreads>(a.split, static_cast<acc_t>(o.len),
      [&](int r) { return ChunkMoments<acc_t>{slots[3 * r], slots[3 * r + 1], slots[3 * r + 2]}; }, fold);
  // As the team forward: a NaN M2 stays NaN, an overflowed one gives NaN, not rstd 0.
  const acc_t var = !(m.m2 <= acc_t(0)) ? m.m2 / static_cast<acc_t>(o.len) : acc_t(0);
  const acc_t rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + o.eps);
  if (k == 0 && threadIdx.x == 0) {
    o.mean[g] = K + m.mean;
    o.rstd[g] = rstd;
  }
  const int64_t ng = div_nn(g, o.G);
  const OnePassOutput<scalar_t, V, A> out(o, ng, g - ng * o.G, K, m.mean, rstd);
  // The tile in channel segments of `seg` packs, each with one set of coefficients and within one
  // of x's segments: a channel (S is a multiple of V, the planner's condition) or, without
  // per-channel parameters where x is dense, the whole group. Offsets within a segment are 32-bit
  // (the planner keeps groups under 2^31 packs).
  const int64_t seg = o.uniform_channels() && a.x_seg == a.lenv ? a.lenv : o.S / V;
  for (int64_t s0 = v0 - g_begin; s0 < v1 - g_begin;) {
    const int64_t c = div_nn(s0, seg);
    const int64_t s1 = imin(v1 - g_begin, (c + 1) * seg);
    const Affine<acc_t> cf = out.channel(out.c_first + c);
    const int count = static_cast<int>(s1 - s0);
    const uint4* xs = reinterpret_cast<const uint4*>(
        reinterpret_cast<const P*>(o.x) + a.x_segment(g, 0) + c * a.x_seg_stride + (s0 - c * seg));
    const uint4* rs = reinterpret_cast<const uint4*>(offset_or_null(e.residual, g * o.len + s0 * V));
    const uint4* ms = reinterpret_cast<const uint4*>(offset_or_null(e.multiplier, g * o.len + s0 * V));
    uint4* ys = reinterpret_cast<uint4*>(reinterpret_cast<P*>(o.y) + g_begin + s0);
    const bool has_r = OPS && e.residual != nullptr;
    const bool has_m = OPS && e.multiplier != nullptr;
    // Fewer packs in flight with the operands (three streams).
    constexpr int U = OPS ? kSweepUnroll / 2 : kSweepUnroll;
    for (int i = static_cast<int>(threadIdx.x); i < count; i += U * kSweepThreads) {
      output_packs<U, scalar_t, V>(xs, rs, ms, ys, has_r, has_m,
          [&](int u) { return i + u * kSweepThreads < count; }, [&](int u) { return i + u * kSweepThreads; },
          [&](int j, const P& xp, const P& rp, const P& mp) {
            return out.element_with(cf.w, cf.b, xp, rp, has_r, mp, has_m, j);
          });
    }
    s0 = s1;
  }
}

}  // namespace

// Runs the sweep forward as planned (plan.path == Sweep; plan.reduce: the tiles).
template <typename scalar_t>
void sweep_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  using acc_t = acc_type<scalar_t>;
  // The planner gives it the 16-bit types alone (plan.cpp, sweep_forward).
  static_assert(sizeof(scalar_t) == 2, "the sweep kernels are instantiated for 16-bit types only");
  constexpr int V = pack_width<scalar_t>();
  SweepArgs<scalar_t> a{};
  OnePassArgs<scalar_t>& o = a.op;
  const bool made = make_one_pass_args<scalar_t, V>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, o);
  TORCH_INTERNAL_ASSERT(made && !o.cols, "sweep forward planned for arguments it cannot take");
  o.cluster = 1;
  const int64_t groups = sh.N * sh.G;
  a.lenv = o.len / V;
  // x dense, or (strided_rows_of, group_norm.h) rows of whole packs at strides of whole packs.
  if (x.is_contiguous()) {
    a.x_seg = a.lenv;
    a.x_seg_stride = sh.S / V;
    a.x_sample = sh.C * sh.S / V;
  } else {
    // (A batch or channel dimension of size 1 has any stride, unused.)
    TORCH_INTERNAL_ASSERT(strided_rows_of(x, V), "sweep forward planned for strided rows it cannot take");
    a.x_sample = x.size(0) == 1 ? 0 : x.stride(0) / V;
    a.x_seg_stride = x.size(1) == 1 ? 0 : x.stride(1) / V;
    a.x_seg = sh.S / V;
  }
  a.x_group = sh.D * a.x_seg_stride;
  a.chunk = pl.reduce.chunk;
  a.split = static_cast<int>(pl.reduce.split);
  const int64_t tiles = groups * a.split;
  TORCH_INTERNAL_ASSERT(tiles == pl.reduce.tiles && tiles <= std::numeric_limits<int>::max());
  if (tiles == 0) return;
  at::Tensor part = at::detail::empty_cuda({tiles * 3}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  a.part = part.data_ptr<acc_t>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  group_norm_sweep_moments_kernel<scalar_t, V><<<static_cast<unsigned>(tiles), kSweepThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool operands = o.epi.residual != nullptr || o.epi.multiplier != nullptr;
  dispatch_activation(ep.activation, [&](auto act) {
    constexpr Activation kA = decltype(act)::value;
    if (operands) {
      launch_maybe_dependent(group_norm_sweep_output_kernel<scalar_t, V, kA, true>, static_cast<unsigned>(tiles),
          kSweepThreads, stream, a);
    } else {
      launch_maybe_dependent(group_norm_sweep_output_kernel<scalar_t, V, kA, false>, static_cast<unsigned>(tiles),
          kSweepThreads, stream, a);
    }
  });
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_SWEEP(T)                                                                        \
  template void fusednorm::sweep_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,           \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&)
