// CUDA kernels of fusednorm::group_norm_forward / group_norm_backward and of their fused variants
// fused_group_norm_forward / fused_group_norm_backward (the epilogue of epilogue.h).
//
// The input is viewed as (N, C, S) with G groups of D = C / G channels (group_norm.h), stored in
// one of two layouts that the kernels read and write in place, as a contiguous matrix:
//   ChannelsFirst: rows (n, c) of S elements;  ChannelsLast: rows (n, s) of C elements.
//
// Forward (2 reads of x, 1 write of y; three launches):
//   1. reduce:   tiles of the tensor write partial moments (count, mean, M2) of x - K, K being the
//                first element of the group (so the mean of a group at 1e4 with std 1 keeps its
//                digits, and a constant group gives exactly M2 = 0). ChannelsFirst: a group is one
//                contiguous run of D*S elements, split into chunks. ChannelsLast: a tile is
//                (sample, chunk of rows, block of channels); each channel column is reduced over
//                the rows, then neighbouring columns of one group are merged into a "piece".
//   2. finalize: one warp or one CTA per (n, g) merges its partials in a fixed order.
//   3. apply:    y = ((x - K) - mean') * (rstd * w[c]) + b[c], coefficients hoisted out of the
//                element loops (per row in ChannelsFirst, per column in ChannelsLast).
// Backward (2 reads of x and dy, 1 write of dx; up to four launches):
//   1. reduce:   per (n, c, chunk) sums of dy and dy * (x - m) (for the weight/bias gradients), and
//                per (n, piece, chunk) the same weighted by w[c] plus sum(x - m) (for dx).
//   2. finalize per (n, g): the dx coefficients. m is the saved mean, rounded to the stats dtype;
//                delta = mean(x - m) recentres the sums on the true mean, as the CPU kernel does.
//   3. finalize per channel: grad_weight, grad_bias.
//   4. apply:    dx = w[c]*rstd*dy + b1 * ((x - m) - delta) + b2.
//
// The fused epilogue (scale/shift per (n, c), residual, activation, multiplier; epilogue.h) rides
// on the same launches, through `EPI` instantiations of the backward reduce kernels and the
// EpiForward / EpiBackward ones of the apply kernels (ApplyMode); the plain ops use the EPI = false
// and Plain instantiations, i.e. exactly the code above.
//   Forward: the statistics are those of x alone; only the apply pass changes. scale and shift
//     fold into its per-(n, c) coefficients, b = rstd * w * (1 + scale), c = bias * (1 + scale)
//     + shift, so that p = b * ((x - K) - mean') + c + residual and y = act(p) * multiplier.
//   Backward: the plain backward runs on dp = dz * multiplier * act'(p) with the per-(n, c) weight
//     w_eff = w * (1 + scale). The reduce pass makes dp on the fly, recomputing
//     p = rstd * w_eff * (x - m) + pc + residual (pc = bias * (1 + scale) + shift) from the saved
//     statistics, and weights the dx sums by w_eff; the finalize passes are unchanged; the apply
//     pass makes dp again and writes dx, grad_residual = dp and grad_multiplier = dz * act(p).
//     The per-(n, c) sums of dp and dp * (x - m) that the reduce pass leaves for the parameter
//     gradients then give grad_weight, grad_bias, grad_scale and grad_shift in pass 3, through its
//     PER_SAMPLE instantiation when scale is present or grad_scale / grad_shift are wanted (they
//     are per (n, c) and weighted per sample).
//   Which operands are present is a uniform run-time choice (null pointers), not a template
//   parameter. The activation is dispatched once per row in the ChannelsFirst apply pass to an
//   element loop compiled for it (with_activation; a run-time switch per element elsewhere).
//
// Groups that fit in shared memory (ChannelsFirst, 16-byte aligned) skip all of the above:
// group_norm_one_pass.cuh reads them once, in one launch per direction (a cluster of CTAs shares a
// large group in the forward), and group_norm_team.cuh spreads larger ones over the shared memory
// of a team of persistent CTAs, in both directions. The passes above are the path for everything
// else (ChannelsLast, unaligned or odd sizes, double).
//
// Every kernel uses 1-D blocks of kThreads threads and a 1-D grid that strides over tiles, so no
// grid dimension limit is reached, and all indexing is 64-bit. Reductions combine partials in an
// order fixed by the shape (no atomics), so results are reproducible run to run. Temporaries come
// from the caching allocator and nothing synchronises with the host, so the ops can be captured
// in CUDA graphs.

#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/group_norm_one_pass.cuh"
#include "cuda/group_norm_team.cuh"
#include "cuda/one_cta_backward.cuh"
#include "cuda/split_apply.cuh"
#include "cuda/split_finalize.cuh"
#include "cuda/split_reduce.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <type_traits>

namespace fusednorm {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// ---------------------------------------------------------------------------------------------
// Host side: tiling plans and launches.

template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_rows(const KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  reduce_rows_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_cols(const KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  reduce_cols_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_rows(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  apply_rows_kernel<scalar_t, V, M><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_cols(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a, bool act_kernel) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (M == ApplyMode::EpiForward) {
    // The plan's cols_act_kernel: no residual, no multiplier, a common activation.
    if (act_kernel) {
      const auto launch = [&](auto kernel) {
        kernel<<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
        launch(apply_cols_act_kernel<scalar_t, V, static_cast<int>(decltype(act)::value)>);
      });
      if (launched) return;  // the other activations: the shared kernel
    }
  }
  apply_cols_kernel<scalar_t, V, M><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
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
// rstd and the bias; the weight sums use w_eff.
template <typename scalar_t, bool GRADS, bool EPI>
Partials reduce_pass(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean,
    const at::Tensor& weight, const GroupNormShape& sh, Layout layout, const at::Tensor& rstd,
    const at::Tensor& bias, const Epilogue* ep) {
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
    out.part = at::empty({a.rows * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::empty({sh.N * t.split * sh.C * 2}, acc_opts);
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
    const Tiling t = tile_cols(sh.N, sh.S, cvn, max_split);
    TORCH_INTERNAL_ASSERT(t.log_tx == a.log_tx);
    a.split = t.split;
    a.chunk = t.chunk;
    a.ncb = t.ncb;
    a.tiles = t.tiles;
    out.part = at::empty({sh.N * (sh.C >> a.log_q) * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::empty({sh.N * t.split * sh.C * 2}, acc_opts);
      a.part_c = out.part_c.data_ptr<acc_t>();
      a.mean = mean.data_ptr<acc_t>();
      a.weight = param_ref<scalar_t>(weight);
    }
    if constexpr (EPI) a.epi = epi;
    out.entries = pieces_per_group * t.split;
    out.split = t.split;
    if (vec) {
      launch_reduce_cols<scalar_t, VW, GRADS, EPI>(a);
    } else {
      launch_reduce_cols<scalar_t, 1, GRADS, EPI>(a);
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
    const Tiling t = tile_rows(a.rows, vec ? sh.S / VW : sh.S, std::numeric_limits<int64_t>::max());
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
    // folded bias): with 8 lanes they do not fit its register cap, so 2-byte types take 4-wide
    // (8-byte) packs there. The forward, with a compile-time activation, fits 16-byte packs.
    constexpr int VE = VW > 4 ? 4 : VW;
    const int width = epi != nullptr && a.dy != nullptr ? VE : VW;
    const size_t bytes = static_cast<size_t>(width) * sizeof(scalar_t);
    const bool vec = width > 1 && sh.C % width == 0 &&
                     (epi == nullptr ? ptrs_aligned
                                     : aligned_to(a.x, bytes) && aligned_to(a.out, bytes) &&
                                           aligned_to(a.dy, bytes) && epi_aligned(*epi, bytes));
    const Tiling t = tile_apply_cols(a.rows, vec ? sh.C / width : sh.C);
    a.split = t.ncb;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    if (epi != nullptr) {
      with_epi_mode(a.dy != nullptr, [&](auto mode) {
        constexpr ApplyMode kMode = decltype(mode)::value;
        if (vec) {
          launch_apply_cols<scalar_t, kMode == ApplyMode::EpiForward ? VW : VE, kMode>(with_epi(), cols_act_kernel);
        } else {
          launch_apply_cols<scalar_t, 1, decltype(mode)::value>(with_epi(), cols_act_kernel);
        }
      });
    } else if (vec) {
      launch_apply_cols<scalar_t, VW, ApplyMode::Plain>(a, false);
    } else {
      launch_apply_cols<scalar_t, 1, ApplyMode::Plain>(a, false);
    }
  }
}


int finalize_grid(int64_t items, int log_iw) {
  return grid_for(ceil_div(items, kThreads >> log_iw));
}

// ---------------------------------------------------------------------------------------------
// Planning a call (plan.h): the call's problem, this device, and the residency answers the
// planner asks of the kernels it may launch.

// Clusters of `parts` CTAs of the parameter-gradient finalize `kernel` the current device runs at
// once (a CTA takes a whole SM, a cluster's CTAs one GPC), asked once per device and size.
template <typename Kernel>
int resident_param_grad_clusters(Kernel kernel, int parts) {
  // Clusters of each size the device runs at once, per device (0: not asked yet, -1: none).
  static std::array<std::array<int, kMaxParamGradParts + 1>, 64> resident{};
  const int device = c10::cuda::current_device();
  if (device >= static_cast<int>(resident.size()) || parts > kMaxParamGradParts) return 0;
  int& clusters = resident[device][parts];
  if (clusters == 0) {
    const int n = max_active_clusters(kernel, kParamGradThreads, 0, parts);
    clusters = n > 0 ? n : -1;
  }
  return clusters;
}

plan::DeviceInfo device_info() {
  const cudaDeviceProp& prop = *at::cuda::getCurrentDeviceProperties();
  plan::DeviceInfo d;
  d.sms = prop.multiProcessorCount;
  d.major = prop.major;
  d.minor = prop.minor;
  d.smem_optin = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  d.smem_per_sm = static_cast<int64_t>(prop.sharedMemPerMultiprocessor);
  d.l2_bytes = prop.l2CacheSize;
  d.cooperative_launch = prop.cooperativeLaunch != 0;
  d.clusters_of_16 = prop.major >= 9 && clusters_of_16(prop);
  return d;
}

template <typename scalar_t>
plan::Problem problem_of(const GroupNormShape& sh, Layout layout, const Epilogue& ep, const at::Tensor& weight,
    const at::Tensor& bias) {
  plan::Problem p;
  p.N = sh.N;
  p.C = sh.C;
  p.S = sh.S;
  p.G = sh.G;
  p.elem_bytes = static_cast<int>(sizeof(scalar_t));
  p.bfloat16 = std::is_same_v<scalar_t, at::BFloat16>;
  p.channels_last = layout == Layout::ChannelsLast;
  p.act = static_cast<plan::Act>(static_cast<int>(ep.activation));
  p.weight = weight.defined();
  p.bias = bias.defined();
  p.scale = ep.scale.defined();
  p.shift = ep.shift.defined();
  p.residual = ep.residual.defined();
  p.multiplier = ep.multiplier.defined();
  p.multiplier_is_residual = p.residual && p.multiplier && ep.residual.data_ptr() == ep.multiplier.data_ptr();
  return p;
}

// The CUDA answers to the planner's residency questions about this call's kernels (scalar_t, the
// epilogue's activation, in the backward what its sums keep, in the forward the streams).
template <typename scalar_t>
plan::Residency residency_of(Activation act, bool backward, Keep keep, int forward_streams) {
  using acc_t = acc_type<scalar_t>;
  plan::Residency r;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V > 1) {
    r.team_ctas_per_sm = [act, backward, keep](int64_t smem) {
      int per_sm = 0;
      dispatch_activation(act, [&](auto a) {
        constexpr Activation kA = decltype(a)::value;
        if (!backward) {
          per_sm = team_ctas_per_sm(group_norm_team_kernel<scalar_t, V, kA>, smem);
        } else {
          dispatch_keep<kA>(keep, [&](auto k) {
            per_sm = team_ctas_per_sm(group_norm_team_backward_kernel<scalar_t, V, kA, decltype(k)::value>, smem);
          });
        }
      });
      return per_sm;
    };
    r.cols_ctas_per_sm = [act, forward_streams](int pack_bytes, int64_t smem) {
      return cols_one_pass_ctas_per_sm<scalar_t>(act, forward_streams, pack_bytes, smem);
    };
  }
  r.param_grad_clusters = [](bool per_sample, int parts) {
    return per_sample ? resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, true>, parts)
                      : resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, false>, parts);
  };
  return r;
}

template <typename scalar_t>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  plan::Problem prob = problem_of<scalar_t>(sh, layout, ep, weight, bias);
  const void* residual = ep.residual.defined() ? ep.residual.data_ptr() : nullptr;
  const void* multiplier = ep.multiplier.defined() ? ep.multiplier.data_ptr() : nullptr;
  prob.aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(residual) && aligned16(multiplier);
  const plan::DeviceInfo dev = device_info();
  const int streams = 1 + (residual != nullptr) + (multiplier != nullptr && multiplier != residual);
  const plan::Residency res = residency_of<scalar_t>(ep.activation, /*backward=*/false, Keep::None, streams);
  plan::Plan pl = plan::plan_forward(prob, dev, res, plan::overrides());
  if (pl.path == plan::Path::Team) {
    if (forward_team<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd)) return;
    prob.team_refused = true;  // another context holds part of the device
    pl = plan::plan_forward(prob, dev, res, plan::overrides());
  }
  if (pl.path != plan::Path::Split) {
    forward_one_pass<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
    return;
  }
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const Partials p = reduce_pass<scalar_t, false, false>(x, at::Tensor(), at::Tensor(), at::Tensor(),
      sh, layout, at::Tensor(), at::Tensor(), nullptr);

  at::Tensor rec = at::empty({sh.N * sh.G * kRec}, p.part.options());
  MomentsFinalizeArgs<scalar_t> f{};
  f.part = p.part.data_ptr<acc_t>();
  f.x = x.data_ptr<scalar_t>();
  f.items = sh.N * sh.G;
  f.entries = p.entries;
  f.G = sh.G;
  f.sample_stride = sh.C * sh.S;
  f.group_stride = layout == Layout::ChannelsFirst ? sh.D * sh.S : sh.D;
  f.eps = static_cast<acc_t>(eps);
  f.mean = mean.data_ptr<acc_t>();
  f.rstd = rstd.data_ptr<acc_t>();
  f.rec = rec.data_ptr<acc_t>();
  f.log_iw = log_item_width(p.entries);
  finalize_moments_kernel<scalar_t><<<finalize_grid(f.items, f.log_iw), kThreads, 0, stream>>>(f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (ep.empty()) {
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout);
  } else {
    const EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, /*with_residual=*/true);
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout, &e, pl.cols_act_kernel);
  }
}

// grad_weight, grad_bias, grad_scale, grad_shift (those `mask` asks for) from the per-(n, k, c)
// partials and the (n, g) records of either backward path.
template <typename scalar_t>
void param_grads_pass(const Partials& p, const at::Tensor& rec, const at::Tensor& weight,
    const at::Tensor& bias, const Epilogue& ep, const GroupNormShape& sh, const FusedGradMask& mask,
    FusedGrads& g, int parts) {
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  ParamGradArgs<acc_t> pg{};
  pg.part_c = p.part_c.data_ptr<acc_t>();
  pg.rec = rec.data_ptr<acc_t>();
  pg.dweight = GradRef{mask[1] ? g.weight.data_ptr() : nullptr, g.weight.scalar_type()};
  pg.dbias = GradRef{mask[2] ? g.bias.data_ptr() : nullptr, g.bias.scalar_type()};
  pg.C = sh.C;
  pg.G = sh.G;
  pg.D = sh.D;
  pg.split = p.split;
  pg.entries = sh.N * p.split;
  const bool per_sample = ep.scale.defined() || mask[3] || mask[4];
  const int64_t blocks = ceil_div(sh.C, kWarp);
  const auto plain_kernel = finalize_param_grads_kernel<acc_t, false>;
  const auto sample_kernel = finalize_param_grads_kernel<acc_t, true>;
  pg.parts = parts;  // the plan's
  const unsigned grid = static_cast<unsigned>(imin(blocks, grid_for(blocks * pg.parts) / pg.parts) * pg.parts);
  if (per_sample) {
    // With a scale each sample's share is weighted by 1 + scale[n, c], and grad_scale /
    // grad_shift are per (n, c).
    SampleParamGradArgs<acc_t> ps{pg};
    ps.scale = param_ref<scalar_t>(ep.scale);
    ps.weight = param_ref<scalar_t>(weight);
    ps.bias = param_ref<scalar_t>(bias);
    ps.dscale = GradRef{mask[3] ? g.scale.data_ptr() : nullptr, g.scale.scalar_type()};
    ps.dshift = GradRef{mask[4] ? g.shift.data_ptr() : nullptr, g.shift.scalar_type()};
    ps.N = sh.N;
    launch_clustered(sample_kernel, grid, kParamGradThreads, 0, pg.parts, stream, ps);
  } else {
    launch_clustered(plain_kernel, grid, kParamGradThreads, 0, pg.parts, stream, pg);
  }
}

// Fills the requested entries of `g` (mask in schema order: input, weight, bias, scale, shift,
// residual, multiplier). The plain op comes here with an empty epilogue and mask[3..6] false, and
// then runs exactly the EPI = false kernels it always ran.
template <typename scalar_t>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g) {
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  // dp differs from dz, or w_eff from w: the reduce pass needs the epilogue. (A shift or a
  // residual alone changes neither: the plain kernels then give dx and the sums.)
  const bool epi_sums =
      ep.scale.defined() || ep.multiplier.defined() || ep.activation != Activation::None;
  const bool want_params = mask[1] || mask[2] || mask[3] || mask[4];
  plan::Problem prob = problem_of<scalar_t>(sh, layout, ep, weight, bias);
  prob.backward = true;
  prob.mask = mask;
  {
    // The one-CTA and team backwards' pointers (make_one_pass_backward_args): the residual only
    // where p is needed.
    EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, ep.activation != Activation::None || mask[6]);
    e.grad_residual = mask[5] ? g.residual.data_ptr<scalar_t>() : nullptr;
    e.grad_multiplier = mask[6] ? g.multiplier.data_ptr<scalar_t>() : nullptr;
    prob.aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) &&
        aligned_to(mask[0] ? g.input.data_ptr() : nullptr, 16) && epi_aligned(e);
    // The split reduce pass's (reduce_pass): the epilogue's only with epi_sums.
    const EpiArgs<scalar_t> r =
        epi_sums ? epi_args<scalar_t>(ep, ep.activation != Activation::None) : EpiArgs<scalar_t>{};
    prob.split_aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) && epi_aligned(r);
  }
  const Keep keep = keep_for(ep.activation, ep.multiplier.defined(), mask[5] || mask[6]);
  const plan::DeviceInfo dev = device_info();
  const plan::Residency res = residency_of<scalar_t>(ep.activation, /*backward=*/true, keep, 0);
  plan::Plan pl = plan::plan_backward(prob, dev, res, plan::overrides());
  at::Tensor rec;
  {
    // Groups in one CTA's shared memory, or spread over a team's.
    Partials one;
    bool done = false;
    if (pl.path == plan::Path::Team) {
      done = backward_team<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          one.part_c, rec);
      if (!done) {
        prob.team_refused = true;  // another context holds part of the device
        pl = plan::plan_backward(prob, dev, res, plan::overrides());
      }
    }
    if (pl.path == plan::Path::OneCta) {
      backward_one_pass<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          one.part_c, rec);
      done = true;
    }
    if (done) {
      if (want_params) param_grads_pass<scalar_t>(one, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
      return;
    }
  }
  if (mask[0] || want_params) {
    const Partials p = epi_sums
        ? reduce_pass<scalar_t, true, true>(x, dy, mean, weight, sh, layout, rstd, bias, &ep)
        : reduce_pass<scalar_t, true, false>(x, dy, mean, weight, sh, layout, rstd, bias, nullptr);
    TORCH_INTERNAL_ASSERT(p.split == pl.reduce.split, "the split reduce pass left the planned tiling");

    // The (n, g) records are needed by dx and by grad_weight (for delta).
    rec = at::empty({sh.N * sh.G * kRec}, p.part.options());
    GradCoefArgs<acc_t> f{};
    f.part = p.part.data_ptr<acc_t>();
    f.mean = mean.data_ptr<acc_t>();
    f.rstd = rstd.data_ptr<acc_t>();
    f.rec = rec.data_ptr<acc_t>();
    f.items = sh.N * sh.G;
    f.entries = p.entries;
    f.M = static_cast<acc_t>(sh.D) * static_cast<acc_t>(sh.S);
    f.log_iw = log_item_width(p.entries);
    finalize_grad_coefs_kernel<acc_t><<<finalize_grid(f.items, f.log_iw), kThreads, 0, stream>>>(f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    if (want_params) param_grads_pass<scalar_t>(p, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
  } else {
    // Only grad_residual / grad_multiplier: they need p (hi = m, a = rstd * w_eff), not the dx
    // coefficients, so no reduction at all.
    const at::Tensor zero = at::zeros_like(mean);
    rec = at::stack({mean, zero, rstd, zero, zero}, 2).view({-1});
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
      apply_pass<scalar_t>(x, dy, dx, rec, weight, bias, sh, layout, &e);
    }
  }
}

// The plain ops' epilogue.
Epilogue no_epilogue(const at::Tensor&, const GroupNormShape&, Layout) {
  return Epilogue();
}

// Both forward ops. make_ep(x, shape, layout) validates and returns the epilogue once x is in its
// kernel layout.
template <typename MakeEpilogue>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(const at::Tensor& input, int64_t num_groups,
    const OptTensor& weight, const OptTensor& bias, double eps, const MakeEpilogue& make_ep) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(input));
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep = make_ep(x, sh, layout);
  at::Tensor y = empty_in_layout(x, layout, x.scalar_type());
  const auto stat_opts = x.options().dtype(stats_dtype(x.scalar_type()));
  at::Tensor mean = at::empty({sh.N, sh.G}, stat_opts);
  at::Tensor rstd = at::empty({sh.N, sh.G}, stat_opts);
  if (sh.N == 0) return {y, mean, rstd};
  if (x.numel() == 0) {
    // Empty groups (S == 0 or C == 0): mean 0 and variance 0.
    mean.zero_();
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, mean, rstd};
  }
  const at::Tensor w = defined(weight) ? weight->contiguous() : at::Tensor();
  const at::Tensor b = defined(bias) ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fusednorm_group_norm_forward_cuda", [&] {
    forward_impl<scalar_t>(x, w, b, eps, sh, layout, ep, y, mean, rstd);
  });
  return {y, mean, rstd};
}

// Both backward ops; see backward_impl.
template <typename MakeEpilogue>
FusedGrads backward_cuda(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const MakeEpilogue& make_ep, const FusedGradMask& mask, bool sum_residual_multiplier_grads = false) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  if (defined(bias)) check_input_and_params(input, c10::nullopt, bias);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(input));
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep = make_ep(x, sh, layout);
  FusedGrads g = empty_fused_grads(x, sh, layout, mask, weight, bias, ep, sum_residual_multiplier_grads);
  if (std::none_of(mask.begin(), mask.end(), [](bool wanted) { return wanted; })) return g;
  if (x.numel() == 0) {
    // The elementwise gradients are empty too; the others are sums over nothing.
    g.weight.zero_();
    g.bias.zero_();
    g.scale.zero_();
    g.shift.zero_();
    return g;
  }
  const at::Tensor dy = to_layout(grad_out, layout);
  const at::Tensor m = mean.contiguous();
  const at::Tensor r = rstd.contiguous();
  const at::Tensor w = defined(weight) ? weight->contiguous() : at::Tensor();
  const at::Tensor b = defined(bias) ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fusednorm_group_norm_backward_cuda", [&] {
    backward_impl<scalar_t>(dy, x, m, r, w, b, sh, layout, ep, mask, g);
  });
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cuda(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  return forward_cuda(input, num_groups, weight, bias, eps, no_epilogue);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, int64_t num_groups,
    std::array<bool, 3> output_mask) {
  const FusedGradMask mask{output_mask[0], output_mask[1], output_mask[2], false, false, false, false};
  const FusedGrads g =
      backward_cuda(grad_out, input, mean, rstd, weight, c10::nullopt, num_groups, no_epilogue, mask);
  return {g.input, g.weight, g.bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_cuda(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier) {
  return forward_cuda(input, num_groups, weight, bias, eps,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        return make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_group_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    std::array<bool, 7> output_mask, bool sum_residual_multiplier_grads) {
  const FusedGrads g = backward_cuda(grad_out, input, mean, rstd, weight, bias, num_groups,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        return make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
      },
      kernel_grad_mask(output_mask, sum_residual_multiplier_grads), sum_residual_multiplier_grads);
  return fused_grads_outputs(g, sum_residual_multiplier_grads);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("group_norm_forward", &group_norm_forward_cuda);
  m.impl("group_norm_backward", &group_norm_backward_cuda);
  m.impl("fused_group_norm_forward", &fused_group_norm_forward_cuda);
  m.impl("fused_group_norm_backward", &fused_group_norm_backward_cuda);
}

}  // namespace fusednorm
