// The split passes' host side (docs/design.md, "Split passes"): tiling and launches of the reduce
// and apply passes, and the whole split forward and backward as planned (paths.h), instantiated
// per dtype in kernels_<dtype>.cu.
#pragma once

#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/paths.h"
#include "cuda/split_apply.cuh"
#include "cuda/split_finalize.cuh"
#include "cuda/split_reduce.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

// ---------------------------------------------------------------------------------------------
// Host side: tiling plans and launches.

template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_rows(const KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  reduce_rows_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// act_kernel (EPI, 16-byte packs): the plan's cols_act_kernel, the kernel of the activation.
template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_cols(const KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI>& a, bool act_kernel) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (EPI && V == pack_width<scalar_t>()) {
    if (act_kernel) {
      const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
        reduce_cols_kernel<scalar_t, V, GRADS, EPI, static_cast<int>(decltype(act)::value)>
            <<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
      });
      TORCH_INTERNAL_ASSERT(launched, "cols_act_kernel planned for an activation without its kernel");
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  reduce_cols_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

static_assert((1 << kLogApplyRowsPlainThreads) == plan::kApplyRowsPlainThreads,
    "the planner's tiles of the plain apply-rows kernels are in their CTAs");

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_rows(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  apply_rows_kernel<scalar_t, V, M>
      <<<grid_of_every_tile(a.tiles), 1 << apply_rows_log_threads<M>(), 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_cols(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  apply_cols_kernel<scalar_t, V, M><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The plan's cols_act_kernel (no residual, no multiplier, a common activation): apply_cols_act_kernel.
template <typename scalar_t, int V, ApplyMode M>
void launch_apply_cols_act(const WithEpi<ApplyArgs<scalar_t>, scalar_t>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
    apply_cols_act_kernel<scalar_t, V, M, static_cast<int>(decltype(act)::value)>
        <<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  });
  TORCH_INTERNAL_ASSERT(launched, "cols_act_kernel planned for an activation without its kernel");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(std::integral_constant<ApplyMode, M>{}) with the EPI apply mode of the direction.
template <typename F>
void with_epi_mode(bool backward, const F& f) {
  if (backward) {
    f(std::integral_constant<ApplyMode, ApplyMode::EpiBackward>{});
  } else {
    f(std::integral_constant<ApplyMode, ApplyMode::EpiForward>{});
  }
}

// Pass 1 of either direction. Fills `part` (3 values per (n, piece, k), pieces of 2^log_q
// channels) and, for GRADS, `part_c` (2 values per (n, k, c)); returns the number of partials
// per group and the number of chunks.
struct Partials {
  at::Tensor part, part_c;
  int64_t entries = 0;  // partials per (n, g) in `part`
  int64_t split = 1;    // chunks of the reduced extent
};

// EPI (backward only): dy is dz, made into dp with the epilogue `ep`, whose p needs the saved
// rstd and the bias; the weight sums use w_eff. cols_act_kernel: the plan's (the channels-last
// kernel of the activation, where packs are 16 bytes).
template <typename scalar_t, bool GRADS, bool EPI>
Partials reduce_pass(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean,
    const at::Tensor& weight, const GroupNormShape& sh, Layout layout, const at::Tensor& rstd,
    const at::Tensor& bias, const Epilogue* ep, bool cols_act_kernel = false) {
  static_assert(GRADS || !EPI, "the forward statistics are those of x alone");
  using acc_t = acc_type<scalar_t>;
  constexpr int VW = pack_width<scalar_t>();
  const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* dyp = GRADS ? dy.data_ptr<scalar_t>() : nullptr;
  // p, and so the residual, is needed here only for act'(p).
  EpiArgs<scalar_t> epi{};
  if (EPI) {
    epi = epi_args<scalar_t>(*ep, ep->activation != Activation::None);
    epi.rstd = rstd.data_ptr<acc_t>();
    epi.bias = param_ref<scalar_t>(bias);
  }
  const bool ptrs_aligned = aligned16(xp) && (!GRADS || aligned16(dyp)) && epi_aligned(epi);
  Partials out;
  if (layout == Layout::ChannelsFirst) {
    KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI> a{};
    a.x = xp;
    a.dy = dyp;
    a.C = sh.C;
    a.D = sh.D;
    // Forward: one row per group, the pieces are whole groups. Backward: one row per (n, c),
    // pieces are channels.
    a.rows = GRADS ? sh.N * sh.C : sh.N * sh.G;
    a.len = GRADS ? sh.S : sh.D * sh.S;
    const bool vec = VW > 1 && ptrs_aligned && a.len % VW == 0;
    const int V = vec ? VW : 1;
    // Backward: a group merges D * split partials, a channel's gradients N * split.
    const int64_t max_split =
        GRADS ? imax(1, imin(kMaxEntries / sh.D, kMaxParamEntries / sh.N)) : kMaxEntries;
    const Tiling t = tile_rows(a.rows, a.len / V, max_split);
    a.split = t.split;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    out.part = at::detail::empty_cuda({a.rows * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::detail::empty_cuda({sh.N * t.split * sh.C * 2}, acc_opts);
      a.part_c = out.part_c.data_ptr<acc_t>();
      a.mean = mean.data_ptr<acc_t>();
      a.weight = param_ref<scalar_t>(weight);
    }
    if constexpr (EPI) a.epi = epi;
    out.entries = GRADS ? sh.D * t.split : t.split;
    out.split = t.split;
    if (vec) {
      launch_reduce_rows<scalar_t, VW, GRADS, EPI>(a);
    } else {
      launch_reduce_rows<scalar_t, 1, GRADS, EPI>(a);
    }
  } else {
    KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI> a{};
    a.x = xp;
    a.dy = dyp;
    a.S = sh.S;
    a.C = sh.C;
    a.G = sh.G;
    a.D = sh.D;
    const bool vec = VW > 1 && ptrs_aligned && sh.C % VW == 0;
    const int V = vec ? VW : 1;
    const int64_t cvn = sh.C / V;
    a.log_tx = ceil_log2(imin(cvn, kThreads));
    a.log_q = log_piece(sh.D, a.log_tx, V);
    const int64_t pieces_per_group = sh.D >> a.log_q;
    const int64_t max_split =
        GRADS ? imax(1, imin(kMaxEntries / pieces_per_group, kMaxParamEntries / sh.N))
              : imax(1, kMaxEntries / pieces_per_group);
    const Tiling t = tile_cols(sh.N, sh.S, cvn, max_split, /*forward=*/!GRADS);
    TORCH_INTERNAL_ASSERT(t.log_tx == a.log_tx);
    a.split = t.split;
    a.chunk = t.chunk;
    a.ncb = t.ncb;
    a.tiles = t.tiles;
    out.part = at::detail::empty_cuda({sh.N * (sh.C >> a.log_q) * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::detail::empty_cuda({sh.N * t.split * sh.C * 2}, acc_opts);
      a.part_c = out.part_c.data_ptr<acc_t>();
      a.mean = mean.data_ptr<acc_t>();
      a.weight = param_ref<scalar_t>(weight);
    }
    if constexpr (EPI) a.epi = epi;
    out.entries = pieces_per_group * t.split;
    out.split = t.split;
    if (vec) {
      launch_reduce_cols<scalar_t, VW, GRADS, EPI>(a, cols_act_kernel);
    } else {
      launch_reduce_cols<scalar_t, 1, GRADS, EPI>(a, false);
    }
  }
  return out;
}

// The elementwise pass: y (dy undefined) or dx. With `epi` (the EPI kernels): the forward's z,
// or the backward's dx (`out`, may then be null), grad_residual and grad_multiplier; `bias` is
// then needed in the backward too (for p).
template <typename scalar_t>
void apply_pass(const at::Tensor& x, const at::Tensor& dy, scalar_t* out, const at::Tensor& rec,
    const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh, Layout layout,
    const EpiArgs<scalar_t>* epi = nullptr, bool cols_act_kernel = false) {
  using acc_t = acc_type<scalar_t>;
  constexpr int VW = pack_width<scalar_t>();
  ApplyArgs<scalar_t> a{};
  a.x = x.data_ptr<scalar_t>();
  a.dy = dy.defined() ? dy.data_ptr<scalar_t>() : nullptr;
  a.out = out;
  a.rec = rec.data_ptr<acc_t>();
  a.weight = param_ref<scalar_t>(weight);
  a.bias = param_ref<scalar_t>(bias);
  a.C = sh.C;
  a.S = sh.S;
  a.G = sh.G;
  a.D = sh.D;
  const bool ptrs_aligned = aligned16(a.x) && aligned16(a.out) && (a.dy == nullptr || aligned16(a.dy)) &&
                            (epi == nullptr || epi_aligned(*epi));
  // The EPI kernels' arguments, used only with `epi`.
  auto with_epi = [&] { return WithEpi<ApplyArgs<scalar_t>, scalar_t>{a, *epi}; };
  // With S == 1 both layouts are (N, C) rows; the column kernel then keeps whole rows busy.
  if (layout == Layout::ChannelsFirst && sh.S != 1) {
    a.rows = sh.N * sh.C;
    a.len = sh.S;
    const bool vec = VW > 1 && ptrs_aligned && sh.S % VW == 0;
    const Tiling t = tile_apply_rows(a.rows, vec ? sh.S / VW : sh.S, a.dy != nullptr, epi != nullptr,
                                     sizeof(scalar_t) == 2);
    a.split = t.split;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    if (epi != nullptr) {
      with_epi_mode(a.dy != nullptr, [&](auto mode) {
        if (vec) {
          launch_apply_rows<scalar_t, VW, decltype(mode)::value>(with_epi());
        } else {
          launch_apply_rows<scalar_t, 1, decltype(mode)::value>(with_epi());
        }
      });
    } else if (vec) {
      launch_apply_rows<scalar_t, VW, ApplyMode::Plain>(a);
    } else {
      launch_apply_rows<scalar_t, 1, ApplyMode::Plain>(a);
    }
  } else {
    a.rows = sh.N * sh.S;
    a.len = sh.C;
    // The EPI backward column kernel keeps six coefficients per lane (a, b, hi, lo, c and the
    // folded bias): with 8 lanes they do not fit its register cap beside every activation and
    // operand, so 2-byte types take 4-wide (8-byte) packs there. The forward, with a
    // compile-time activation, and the backward's cols_act_kernel fit 16-byte packs (the latter
    // only those: where they do not apply it takes the shared kernel's packs).
    constexpr int VE = VW > 4 ? 4 : VW;
    const auto packs_of = [&](int width) {
      const size_t bytes = static_cast<size_t>(width) * sizeof(scalar_t);
      return width > 1 && sh.C % width == 0 &&
             (epi == nullptr ? ptrs_aligned
                             : aligned_to(a.x, bytes) && aligned_to(a.out, bytes) && aligned_to(a.dy, bytes) &&
                                   epi_aligned(*epi, bytes));
    };
    const bool epi_backward = epi != nullptr && a.dy != nullptr;
    const bool act_kernel = cols_act_kernel && (!epi_backward || packs_of(VW));
    const int width = epi_backward && !act_kernel ? VE : VW;
    const bool vec = packs_of(width);
    const Tiling t = tile_apply_cols(a.rows, vec ? sh.C / width : sh.C, /*forward=*/a.dy == nullptr);
    a.split = t.ncb;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    if (epi != nullptr) {
      with_epi_mode(a.dy != nullptr, [&](auto mode) {
        constexpr ApplyMode kMode = decltype(mode)::value;
        constexpr bool kForward = kMode == ApplyMode::EpiForward;
        if (act_kernel) {
          if (vec) {
            launch_apply_cols_act<scalar_t, VW, kMode>(with_epi());
          } else if constexpr (kForward) {  // the backward's take 16-byte packs only (act_kernel)
            launch_apply_cols_act<scalar_t, 1, kMode>(with_epi());
          }
        } else if (vec) {
          launch_apply_cols<scalar_t, kForward ? VW : VE, kMode>(with_epi());
        } else {
          launch_apply_cols<scalar_t, 1, kMode>(with_epi());
        }
      });
    } else if (vec) {
      launch_apply_cols<scalar_t, VW, ApplyMode::Plain>(a);
    } else {
      launch_apply_cols<scalar_t, 1, ApplyMode::Plain>(a);
    }
  }
}


int finalize_grid(int64_t items, int log_iw) {
  return grid_for(ceil_div(items, kThreads >> log_iw));
}

// Pass 2 of the forward: merges each group's `entries` partial moments (3 per entry, (n, g) after
// (n, g), in `part`) into its mean and rstd and returns the apply pass's records (kRec per (n, g)).
// The channels-last sweep's moments end here too (cols_sweep_path.cuh), the finalize then a
// programmatic dependent of its moments kernel (`dependent`).
template <typename scalar_t>
at::Tensor finalize_moments_pass(const at::Tensor& part, int64_t entries, const at::Tensor& x, double eps,
    const GroupNormShape& sh, Layout layout, at::Tensor& mean, at::Tensor& rstd, bool dependent = false,
    const InputBiasRef<scalar_t>& input_bias = {nullptr, 0}) {
  using acc_t = acc_type<scalar_t>;
  at::Tensor rec = at::detail::empty_cuda({sh.N * sh.G * kRec}, part.options());
  MomentsFinalizeArgs<scalar_t> f{};
  f.part = part.data_ptr<acc_t>();
  f.x = x.data_ptr<scalar_t>();
  f.items = sh.N * sh.G;
  f.entries = entries;
  f.G = sh.G;
  f.sample_stride = sh.C * sh.S;
  f.group_stride = layout == Layout::ChannelsFirst ? sh.D * sh.S : sh.D;
  f.D = sh.D;
  f.input_bias = input_bias;
  f.eps = static_cast<acc_t>(eps);
  f.mean = mean.data_ptr<acc_t>();
  f.rstd = rstd.data_ptr<acc_t>();
  f.rec = rec.data_ptr<acc_t>();
  f.log_iw = log_item_width(entries);
  const unsigned grid = static_cast<unsigned>(finalize_grid(f.items, f.log_iw));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (dependent) {
    launch_maybe_dependent(finalize_moments_kernel<scalar_t>, grid, kThreads, stream, f);
  } else {
    finalize_moments_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return rec;
}

}  // namespace

template <typename scalar_t>
void split_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  const Partials p = reduce_pass<scalar_t, false, false>(x, at::Tensor(), at::Tensor(), at::Tensor(),
      sh, layout, at::Tensor(), at::Tensor(), nullptr);

  const at::Tensor rec = finalize_moments_pass<scalar_t>(p.part, p.entries, x, eps, sh, layout, mean, rstd);

  if (ep.empty()) {
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout);
  } else {
    const EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, /*with_residual=*/true);
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout, &e, pl.cols_act_kernel);
  }
}

template <typename scalar_t>
void split_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool epi_sums, bool want_params) {
  using acc_t = acc_type<scalar_t>;
  at::Tensor rec;
  if (mask[0] || want_params) {
    const Partials p = epi_sums
        ? reduce_pass<scalar_t, true, true>(x, dy, mean, weight, sh, layout, rstd, bias, &ep, pl.cols_act_kernel)
        : reduce_pass<scalar_t, true, false>(x, dy, mean, weight, sh, layout, rstd, bias, nullptr);
    TORCH_INTERNAL_ASSERT(p.split == pl.reduce.split, "the split reduce pass left the planned tiling");

    // The (n, g) records are needed by dx and by grad_weight (for delta).
    rec = at::detail::empty_cuda({sh.N * sh.G * kRec}, p.part.options());
    finalize_grad_coefs_pass<acc_t>(p.part, p.entries, mean, rstd, rec, sh);

    if (want_params) param_grads_pass<scalar_t>(p.part_c, p.split, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
  } else {
    // Only grad_residual / grad_multiplier: they need p (hi = m, a = rstd * w_eff), not the dx
    // coefficients, so no reduction at all.
    // The records (mean, 0, rstd, 0, 0) per (n, g), written by a memset and two strided copies
    // on the stream (no ATen ops here: the kernel headers stay light, docs/design.md, "Source
    // layout").
    TORCH_INTERNAL_ASSERT(mean.scalar_type() == c10::CppTypeToScalarType<acc_t>::value &&
        rstd.scalar_type() == mean.scalar_type() && mean.is_contiguous() && rstd.is_contiguous());
    rec = at::detail::empty_cuda({sh.N * sh.G * kRec}, mean.options());
    const auto stream = at::cuda::getCurrentCUDAStream();
    const size_t item = sizeof(acc_t);
    const size_t groups = static_cast<size_t>(sh.N * sh.G);
    acc_t* r = rec.data_ptr<acc_t>();
    C10_CUDA_CHECK(cudaMemsetAsync(r, 0, groups * kRec * item, stream));
    C10_CUDA_CHECK(cudaMemcpy2DAsync(r + 0, kRec * item, mean.data_ptr<acc_t>(), item, item, groups,
        cudaMemcpyDeviceToDevice, stream));
    C10_CUDA_CHECK(cudaMemcpy2DAsync(r + 2, kRec * item, rstd.data_ptr<acc_t>(), item, item, groups,
        cudaMemcpyDeviceToDevice, stream));
  }

  if (mask[0] || mask[5] || mask[6]) {
    scalar_t* dx = mask[0] ? g.input.data_ptr<scalar_t>() : nullptr;
    if (!epi_sums && !mask[5] && !mask[6]) {
      apply_pass<scalar_t>(x, dy, dx, rec, weight, at::Tensor(), sh, layout);
    } else {
      // p is needed for act'(p) and for grad_multiplier = dz * act(p); only then the residual.
      EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, ep.activation != Activation::None || mask[6]);
      e.grad_residual = mask[5] ? g.residual.data_ptr<scalar_t>() : nullptr;
      e.grad_multiplier = mask[6] ? g.multiplier.data_ptr<scalar_t>() : nullptr;
      apply_pass<scalar_t>(x, dy, dx, rec, weight, bias, sh, layout, &e, pl.cols_act_kernel);
    }
  }
}

}  // namespace fusednorm

// The split path of one dtype (kernels_<dtype>.cu).
#define FUSEDNORM_INSTANTIATE_SPLIT(T)                                                                        \
  template void fusednorm::split_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,          \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&);                                                                                           \
  template void fusednorm::split_backward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,         \
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const GroupNormShape&,    \
      Layout, const Epilogue&, const FusedGradMask&, FusedGrads&, bool, bool)
