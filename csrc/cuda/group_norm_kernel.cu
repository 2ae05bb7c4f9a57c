// Registration and dispatch of the CUDA kernels: each call is planned (csrc/plan.h) and carried
// out through the entry points of cuda/paths.h; this file compiles no kernel (docs/design.md,
// "Source layout"). The algorithm of the split passes, which every shape can fall back to:
//
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
//   element loop compiled for it (with_activation); in the channels-last passes an epilogue with
//   an activation alone has kernels of that activation (the plan's cols_act_kernel), others a
//   run-time switch per element.
//
// Most shapes skip all of the above; the planner (plan.h) says which path a shape takes. Groups
// that fit on chip are read once, in one launch per direction: the one-pass forwards
// (group_norm_one_pass.cuh: in registers, in a CTA's shared memory or a cluster's, channels-last
// too) and the one-CTA backward (one_cta_backward.cuh, ChannelsFirst); group_norm_team.cuh
// spreads larger ChannelsFirst groups over the shared memory of a team of persistent CTAs, in both
// directions; 16-bit ChannelsFirst groups of 9 MB and more take two streaming sweeps
// (sweep_path.cuh), channels-last inputs of 32 MB and more the channels-last sweep
// (cols_sweep_path.cuh). The passes above are the path for the rest: the channels-last backward,
// large groups where no team pays (the GroupNorm problem's backward), unaligned or odd sizes, double.
//
// Every kernel uses 1-D blocks of kThreads threads and a 1-D grid that strides over tiles, so no
// grid dimension limit is reached, and all indexing is 64-bit. Reductions combine partials in an
// order fixed by the shape (no atomics), so results are reproducible run to run. Temporaries come
// from the caching allocator and nothing synchronises with the host, so the ops can be captured
// in CUDA graphs.

#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/keep.cuh"
#include "cuda/paths.h"
#include "group_norm.h"
#include "plan.h"

#include <ATen/core/Tensor.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/add.h>
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
// Planning a call (plan.h): the call's problem, this device, and the residency answers the
// planner asks of the kernels it may launch.

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
// epilogue's activation, in the backward what its sums keep, in the forward the streams, whether
// the team kernel's packs straddle channels, whether it would add input_bias, and whether the
// channels-last one-pass kernel would: each its own instantiation).
template <typename scalar_t>
plan::Residency residency_of(Activation act, bool backward, Keep keep, int forward_streams, bool straddling = false,
    bool input_bias = false, bool team_input_bias = false) {
  using acc_t = acc_type<scalar_t>;
  plan::Residency r;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V > 1) {
    r.team_ctas_per_sm = [act, backward, keep, straddling, team_input_bias](int64_t smem) {
      return team_residency<scalar_t>(act, backward, static_cast<int>(keep), straddling, team_input_bias, smem);
    };
    r.cols_ctas_per_sm = [act, forward_streams, input_bias](int pack_bytes, int64_t smem) {
      return cols_one_pass_residency<scalar_t>(act, forward_streams, pack_bytes, smem, input_bias);
    };
  }
  r.param_grad_clusters = [](bool per_sample, int parts) { return param_grad_residency<acc_t>(per_sample, parts); };
  return r;
}

// Whether `input`, channels-first by its layout but not contiguous, is left as it lies for the
// sweep, which may read its rows through their strides (docs/design.md, "Sweep path"; the
// planner decides, Problem::strided_rows): 16-bit elements, contiguous rows of whole 16-byte
// packs, 16-byte aligned, at batch and channel strides of whole packs, rows the planner's sweep
// reads (plan::sweep_reads_strided_rows; others are copied here, not planned twice).
bool sweep_may_read_rows_of(const at::Tensor& input, Layout layout) {
  constexpr int V = 8;  // elements a 16-byte pack
  if (layout != Layout::ChannelsFirst || input.element_size() != 2 || input.numel() == 0 || input.is_contiguous() ||
      !strided_rows_of(input, V) || !aligned16(input.data_ptr())) {
    return false;
  }
  return plan::sweep_reads_strided_rows(input.numel() / (input.size(0) * input.size(1)), V);
}

template <typename scalar_t>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  plan::Problem prob = problem_of<scalar_t>(sh, layout, ep, weight, bias);
  prob.strided_rows = layout == Layout::ChannelsFirst && !x.is_contiguous();
  const void* residual = ep.residual.defined() ? ep.residual.data_ptr() : nullptr;
  const void* multiplier = ep.multiplier.defined() ? ep.multiplier.data_ptr() : nullptr;
  prob.aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(residual) && aligned16(multiplier);
  const plan::DeviceInfo dev = device_info();
  const int streams = 1 + (residual != nullptr) + (multiplier != nullptr && multiplier != residual);
  const bool team_input_bias = team_adds_input_bias(sh, pack_width<scalar_t>(), ep);
  const plan::Residency res = residency_of<scalar_t>(ep.activation, /*backward=*/false, Keep::None, streams,
      /*straddling=*/team_packs_straddle(sh, pack_width<scalar_t>(), weight, bias, ep),
      /*input_bias=*/ep.input_bias.defined() && streams == 1,
      team_input_bias);
  plan::Plan pl = plan::plan_forward(prob, dev, res, plan::overrides());
  if (pl.path == plan::Path::None) {
    // Strided rows the sweep does not take (forward_cuda kept them for it): copied dense.
    return forward_impl<scalar_t>(to_layout(x, layout), weight, bias, eps, sh, layout, ep, y, mean, rstd);
  }
  if (ep.addend.defined() && (pl.path != plan::Path::ColsSweep || !aligned16(ep.addend.data_ptr()) ||
                                 !aligned16(ep.sum.data_ptr()))) {
    // Only the channels-last sweep computes the residual-add prologue's sum on the fly
    // (docs/design.md, "Residual-add prologue"); the others normalize it written out by ATen.
    at::Tensor sum = ep.sum;
    at::add_out(sum, x, ep.addend);
    if (ep.input_bias.defined()) sum.add_(input_bias_column(x, ep.input_bias));
    Epilogue rest = ep;
    rest.addend = rest.sum = rest.input_bias = at::Tensor();
    return forward_impl<scalar_t>(ep.sum, weight, bias, eps, sh, layout, rest, y, mean, rstd);
  }
  // Only the channels-last sweep and one-pass kernels (the latter without a residual or
  // multiplier), the team forward (team_adds_input_bias) and the channels-first shared-memory
  // one-pass kernel (one_pass_adds_input_bias) add input_bias on the fly (docs/design.md,
  // "Input bias"); the others normalize input + input_bias materialized.
  const auto adds_input_bias = [&](plan::Path path) {
    return path == plan::Path::ColsSweep || (path == plan::Path::ColsShared && streams == 1) ||
           (path == plan::Path::Team && team_input_bias) ||
           ((path == plan::Path::Shared || path == plan::Path::Cluster) &&
               one_pass_adds_input_bias(sh, pack_width<scalar_t>(), ep));
  };
  const auto given_the_sum = [&] {
    Epilogue rest = ep;
    rest.input_bias = at::Tensor();
    forward_impl<scalar_t>(to_layout(add_input_bias(x, ep.input_bias), layout), weight, bias, eps, sh, layout, rest,
        y, mean, rstd);
  };
  if (ep.input_bias.defined() && !adds_input_bias(pl.path)) return given_the_sum();
  if (pl.path == plan::Path::Team) {
    if (team_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd)) return;
    prob.team_refused = true;  // another context holds part of the device
    pl = plan::plan_forward(prob, dev, res, plan::overrides());
    if (ep.input_bias.defined() && !adds_input_bias(pl.path)) return given_the_sum();
  }
  switch (pl.path) {
    case plan::Path::Split: return split_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
    case plan::Path::Sweep:
      // Instantiated for the 16-bit types alone, the only ones the planner gives it.
      if constexpr (sizeof(scalar_t) == 2) {
        return sweep_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
      }
      TORCH_INTERNAL_ASSERT(false, "sweep forward planned for a type of more than 16 bits");
    case plan::Path::ColsSweep:
      // Instantiated for the 2- and 4-byte types alone, the only ones the planner gives it.
      if constexpr (sizeof(scalar_t) <= 4) {
        return cols_sweep_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
      }
      TORCH_INTERNAL_ASSERT(false, "channels-last sweep forward planned for double");
    case plan::Path::ColsShared:
      // Not instantiated for double, which has no 16-byte packs (kernels/double.cu).
      if constexpr (pack_width<scalar_t>() > 1) {
        return cols_one_pass_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
      }
      TORCH_INTERNAL_ASSERT(false, "channels-last one-pass forward planned for double");
    default: return one_pass_forward<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
  }
}

// Fills the requested entries of `g` (mask in schema order: input, weight, bias, scale, shift,
// residual, multiplier). The plain op comes here with an empty epilogue and mask[3..6] false, and
// then runs exactly the EPI = false kernels it always ran.
template <typename scalar_t>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g) {
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
  {
    // Groups in one CTA's shared memory, or spread over a team's.
    at::Tensor rec;
    at::Tensor part_c;  // the per-(n, c) sums of either path, for the parameter gradients
    bool done = false;
    if (pl.path == plan::Path::Team) {
      done = team_backward<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          part_c, rec);
      if (!done) {
        prob.team_refused = true;  // another context holds part of the device
        pl = plan::plan_backward(prob, dev, res, plan::overrides());
      }
    }
    if (pl.path == plan::Path::OneCta) {
      one_cta_backward<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          part_c, rec);
      done = true;
    }
    if (done) {
      if (want_params) param_grads_pass<scalar_t>(part_c, 1, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
      return;
    }
  }
  split_backward<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, epi_sums, want_params);
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
  const at::Tensor x = sweep_may_read_rows_of(input, layout) ? input : to_layout(input, layout);
  const Epilogue ep = make_ep(x, sh, layout);
  at::Tensor y = empty_in_layout(x, layout, x.scalar_type());
  const auto stat_opts = x.options().dtype(stats_dtype(x.scalar_type()));
  at::Tensor mean = at::detail::empty_cuda({sh.N, sh.G}, stat_opts);
  at::Tensor rstd = at::detail::empty_cuda({sh.N, sh.G}, stat_opts);
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
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    const OptTensor& input_bias) {
  return forward_cuda(input, num_groups, weight, bias, eps,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        Epilogue ep = make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
        if (defined(input_bias)) ep.input_bias = make_input_bias(x, sh, *input_bias);
        return ep;
      });
}

// The residual-add prologue: the forward of sum = input + other (+ input_bias), returned too
// (docs/design.md, "Residual-add prologue").
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_group_norm_forward_cuda(
    const at::Tensor& input, const at::Tensor& other, int64_t num_groups, const OptTensor& weight,
    const OptTensor& bias, double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier, const OptTensor& input_bias) {
  at::Tensor sum;
  auto [output, mean, rstd] = forward_cuda(input, num_groups, weight, bias, eps,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        check_addend(x, other);  // (after group_norm's own checks, as the sum's)
        Epilogue ep = make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
        if (defined(input_bias)) ep.input_bias = make_input_bias(x, sh, *input_bias);
        ep.addend = to_layout(other, layout);
        ep.sum = sum = empty_in_layout(x, layout, x.scalar_type());
        return ep;
      });
  return {output, sum, mean, rstd};
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
  m.impl("add_group_norm_forward", &add_group_norm_forward_cuda);
}

}  // namespace fusednorm
