// The entry points of each kernel path, one translation unit per path and dtype (the parallel
// build, docs/design.md, "Source layout"): the registration file (group_norm_kernel.cu) plans a
// call and calls these; each is defined in its path's header and explicitly instantiated, once,
// in the .cu file named beside it, so every kernel is compiled in exactly one translation unit.
// The kernels themselves keep internal linkage in the file that launches them.
#pragma once

#include "group_norm.h"
#include "plan.h"

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusednorm {

// One-pass forward: paths Registers, Shared and Cluster (kernels/<dtype>_one_pass.cu).
template <typename scalar_t>
void one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd);
// Whether the device schedules clusters of 16 one-pass CTAs (kernels/float_one_pass.cu, whose
// float kernel it asks about).
bool clusters_of_16(const cudaDeviceProp& prop);

// Channels-last one-pass forward: path ColsShared (kernels/<dtype>_cols_one_pass.cu).
template <typename scalar_t>
void cols_one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y,
    at::Tensor& mean, at::Tensor& rstd);
// The planner's residency question about the channels-last one-pass kernel of a call (with
// input_bias: the kernel that adds it, streams == 1 only).
template <typename scalar_t>
int cols_one_pass_residency(Activation act, int streams, int pack_bytes, int64_t smem, bool input_bias);

// One-CTA backward: path OneCta (kernels/<dtype>_team.cu).
template <typename scalar_t>
void one_cta_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params,
    at::Tensor& part_c, at::Tensor& rec);

// Team path, both directions (kernels/<dtype>_team.cu). False where the
// device refuses the grid.
template <typename scalar_t>
bool team_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd);
template <typename scalar_t>
bool team_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params,
    at::Tensor& part_c, at::Tensor& rec);
// Whether a team forward's 16-byte packs of `V` elements straddle channels of different
// coefficients: S not a multiple of V, and a per-channel parameter (OnePassArgs::uniform_packs
// false). Such a call launches the team kernel built for straddling packs.
inline bool team_packs_straddle(const GroupNormShape& sh, int V, const at::Tensor& weight, const at::Tensor& bias,
    const Epilogue& ep) {
  return sh.S % V != 0 && (weight.defined() || bias.defined() || ep.scale.defined() || ep.shift.defined());
}
// Whether the team forward adds the call's input_bias on the fly (docs/design.md, "Input bias"):
// packs within one channel (S a multiple of V), x read alone, a common activation
// (plan::common_activation). Such a call launches the team kernel built for it; other calls with
// input_bias are given input + input_bias.
inline bool team_adds_input_bias(const GroupNormShape& sh, int V, const Epilogue& ep) {
  return ep.input_bias.defined() && sh.S % V == 0 && !ep.residual.defined() && !ep.multiplier.defined() &&
         plan::common_activation(static_cast<plan::Act>(static_cast<int>(ep.activation)));
}
// Whether the channels-first shared-memory one-pass kernel (paths Shared and Cluster) adds the
// call's input_bias (docs/design.md, "Input bias"): packs within one channel, a common
// activation, the instantiations it has; other calls with input_bias are given the sum.
inline bool one_pass_adds_input_bias(const GroupNormShape& sh, int V, const Epilogue& ep) {
  return ep.input_bias.defined() && sh.S % V == 0 &&
         plan::common_activation(static_cast<plan::Act>(static_cast<int>(ep.activation)));
}
// The planner's residency question about the team kernel a call launches (backward: `keep`, the
// backward's Keep, picks it; forward: `straddling`, team_packs_straddle, and `input_bias`,
// team_adds_input_bias).
template <typename scalar_t>
int team_residency(Activation act, bool backward, int keep, bool straddling, bool input_bias, int64_t smem);

// Sweep forward: path Sweep, 16-bit types only (kernels/<dtype>_sweep.cu).
template <typename scalar_t>
void sweep_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd);

// Channels-last sweep forward: path ColsSweep, 2- and 4-byte types (kernels/<dtype>_cols_sweep.cu).
template <typename scalar_t>
void cols_sweep_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd);

// Split passes: path Split, both directions (kernels/<dtype>_split.cu). The backward runs from the
// reduce pass on: dx, grad_residual, grad_multiplier and the parameter gradients `mask` asks for.
template <typename scalar_t>
void split_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd);
template <typename scalar_t>
void split_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool epi_sums, bool want_params);

// The kernels templated on the accumulation type only, shared by every dtype and path
// (param_grads.cu): the parameter gradients from the per-(n, k, c) partials `part_c` (`split`
// chunks) and the (n, g) records; the backward's dx coefficients of the split passes; and the
// planner's residency question about the parameter-gradient kernel.
template <typename scalar_t>
void param_grads_pass(const at::Tensor& part_c, int64_t split, const at::Tensor& rec, const at::Tensor& weight,
    const at::Tensor& bias, const Epilogue& ep, const GroupNormShape& sh, const FusedGradMask& mask,
    FusedGrads& g, int parts);
template <typename acc_t>
void finalize_grad_coefs_pass(const at::Tensor& part, int64_t entries, const at::Tensor& mean,
    const at::Tensor& rstd, at::Tensor& rec, const GroupNormShape& sh);
template <typename acc_t>
int param_grad_residency(bool per_sample, int parts);

}  // namespace fusednorm
