// The single source of truth for fusednorm's operator schemas, and the composite ops that are
// built from the kernel ops (they run on every backend, so autograd, fake tensors, torch.compile
// and torch.export see only the kernel ops underneath).
//
// Kernel ops (CPU: cpu/group_norm_kernel.cpp, CUDA: cuda/group_norm_kernel.cu; autograd:
// autograd.cpp; fake kernels: ops/_registrations.py):
//   group_norm_forward  -> (output, mean, rstd); mean and rstd have shape (N, num_groups) and are
//                          float32 (float64 for float64 input) whatever the input dtype
//   group_norm_backward -> (grad_input, grad_weight, grad_bias); an output whose output_mask entry is
//                          false is returned as an empty tensor of shape (0,); grad_weight and
//                          grad_bias have the weight's dtype (float32 / float64 without weight)
//   fused_group_norm_forward / fused_group_norm_backward: the same with the epilogue of
//                          epilogue.h (scale, shift, residual, activation, multiplier), and the
//                          forward with the prologue input_bias (it normalizes input + input_bias,
//                          make_input_bias in group_norm.h; its backward is the autograd
//                          kernel's, on input + input_bias materialized); backward
//                          returns the gradients of input, weight, bias, scale, shift, residual and
//                          multiplier (FusedGrads in group_norm.h), each parameter's gradient in
//                          that parameter's dtype
//   add_group_norm_forward -> (output, sum, mean, rstd): the residual-add prologue (docs/design.md,
//                          "Residual-add prologue"): fused_group_norm_forward of
//                          sum = input + other (+ input_bias), which it also returns (the input's
//                          dtype and kernel layout); its backward is the autograd kernel's, on the
//                          sum materialized by ATen
//   replication_pad    -> F.pad(input, padding, mode="replicate") in the input's suggested memory
//                          format, the fusion backend's pad after a
//                          fused op (docs/design.md, "Replication pad"): CUDA's kernel in
//                          cuda/replication_pad_kernel.cu, ATen's pad on the CPU and wherever
//                          that kernel does not apply; autograd.cpp records ATen's pad instead
// Composite ops (this file):
//   group_norm     F.group_norm semantics, plus the optional epilogue keywords and input_bias
//   add_group_norm (group_norm(input + other, ...), input + other): the residual-add prologue
//   instance_norm  F.instance_norm semantics, running statistics updated in place, plus the
//                  optional epilogue keywords
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/mish.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/var.h>
#include <torch/library.h>

#include "group_norm.h"
#include "kernel_ops.h"

namespace fusednorm {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_group_norm_forward(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  static auto op = find_op<ForwardFn>("fusednorm::group_norm_forward");
  return op.call(input, num_groups, weight, bias, eps);
}

// Product of the spatial sizes, symbolic under torch.compile's dynamic shapes.
c10::SymInt spatial_numel(const at::Tensor& input) {
  c10::SymInt n = 1;
  for (int64_t d = 2; d < input.dim(); ++d) n = n * input.sym_size(d);
  return n;
}

// The plain kernel op when there is no epilogue and no input_bias (so graphs of plain calls stay
// plain), else the fused one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const EpilogueArgs& ep, const OptTensor& input_bias = c10::nullopt) {
  if (ep.empty() && !defined(input_bias)) return call_group_norm_forward(input, num_groups, weight, bias, eps);
  static auto op = find_op<FusedForwardFn>("fusednorm::fused_group_norm_forward");
  return op.call(input, num_groups, weight, bias, eps, ep.scale, ep.shift, ep.residual,
      ep.activation, ep.negative_slope, ep.multiplier, input_bias);
}

using OptString = c10::optional<c10::string_view>;

// The activation the kernel ops get: "none" for None, and "silu" for its alias "swish" (apex's
// name), so that graphs and saved contexts hold one name per activation.
c10::string_view activation_or_none(const OptString& activation) {
  if (!activation.has_value()) return "none";
  if (*activation == "swish") return "silu";
  return *activation;
}

// C = 0: eager's group_norm raises (its instance_norm, a batch norm over N * C channels, does not:
// nor does instance_norm here).
void check_has_channels(const at::Tensor& input) {
  TORCH_CHECK(input.sym_size(1) != 0, "Expected number of channels to be greater than 0, got 0");
}

// An empty spatial size: eager's group_norm raises from torch 2.14 on (ATen's
// check_group_norm_inputs), as for C = 0. Only the user-facing ops check it: the kernel ops take
// it, as a spatially sharded norm's empty slice needs (fusednorm.distributed).
void check_has_spatial_values(const at::Tensor& input) {
  TORCH_CHECK(spatial_numel(input) != 0, "Expected HxW to be greater than 0, got 0");
}

// F.group_norm's own checks, in its order (the composite ops also run where the Python wrapper
// does not, e.g. in TorchScript).
void check_group_norm_call(const at::Tensor& input, int64_t num_groups) {
  TORCH_CHECK(input.dim() >= 2,
      "Expected at least 2 dimensions for input tensor but received ", input.dim());
  TORCH_CHECK(num_groups > 0, "Expected num_groups to be positive, but got num_groups=", num_groups);
  check_has_channels(input);
  check_has_spatial_values(input);
  TORCH_CHECK_VALUE(input.sym_size(0) * input.sym_size(1) / num_groups * spatial_numel(input) != 1,
      "Expected more than 1 value per channel when training, got input size ", input.sym_sizes());
}

at::Tensor group_norm(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, OptString activation, double negative_slope, const OptTensor& scale,
    const OptTensor& shift, const OptTensor& residual, const OptTensor& multiplier,
    const OptTensor& input_bias) {
  check_group_norm_call(input, num_groups);
  const EpilogueArgs ep{activation_or_none(activation), negative_slope, scale, shift, residual, multiplier};
  return std::get<0>(call_forward(input, num_groups, weight, bias, eps, ep, input_bias));
}

std::tuple<at::Tensor, at::Tensor> add_group_norm(
    const at::Tensor& input, const at::Tensor& other, int64_t num_groups, const OptTensor& weight,
    const OptTensor& bias, double eps, OptString activation, double negative_slope, const OptTensor& scale,
    const OptTensor& shift, const OptTensor& residual, const OptTensor& multiplier,
    const OptTensor& input_bias) {
  check_group_norm_call(input, num_groups);  // (on the sum's shape, the input's)
  static auto op = find_op<AddForwardFn>("fusednorm::add_group_norm_forward");
  auto [output, sum, mean, rstd] = op.call(input, other, num_groups, weight, bias, eps, scale, shift, residual,
      activation_or_none(activation), negative_slope, multiplier, input_bias);
  return {output, sum};
}

// Per-channel view (C, 1, ..., 1) of a (C,) tensor, broadcastable against (N, C, *).
at::Tensor per_channel(const at::Tensor& t, int64_t rank) {
  std::vector<int64_t> shape(rank - 1, 1);
  shape[0] = -1;
  return t.reshape(shape);
}

// Eval mode with running statistics: a per-channel affine map, computed in float32 or better.
at::Tensor instance_norm_with_running_stats(
    const at::Tensor& input, const at::Tensor& running_mean, const at::Tensor& running_var,
    const OptTensor& weight, const OptTensor& bias, double eps, const EpilogueArgs& ep) {
  const auto compute_dtype = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor scale = (running_var.to(compute_dtype) + eps).rsqrt();
  if (defined(weight)) scale = scale * weight->to(compute_dtype);
  at::Tensor shift = -running_mean.to(compute_dtype) * scale;
  if (defined(bias)) shift = shift + bias->to(compute_dtype);
  const int64_t rank = input.dim();
  at::Tensor z = input.to(compute_dtype) * per_channel(scale, rank) + per_channel(shift, rank);
  return apply_epilogue(z, input, ep).to(input.scalar_type());
}

at::Tensor instance_norm(
    const at::Tensor& input, const OptTensor& running_mean, const OptTensor& running_var,
    const OptTensor& weight, const OptTensor& bias, bool use_input_stats, double momentum,
    double eps, OptString activation, double negative_slope, const OptTensor& scale,
    const OptTensor& shift, const OptTensor& residual, const OptTensor& multiplier) {
  const EpilogueArgs ep{activation_or_none(activation), negative_slope, scale, shift, residual, multiplier};
  check_input_and_params(input, weight, bias);
  const c10::SymInt C = input.sym_size(1);
  // The same checks, in the same order, as ATen's instance_norm.
  TORCH_CHECK(use_input_stats || (defined(running_mean) && defined(running_var)),
      "Expected running_mean and running_var to be defined when use_input_stats is false");
  TORCH_CHECK_VALUE(defined(running_mean) == defined(running_var),
      "running_mean and running_var must either both be None or neither be None");
  for (const auto* stat : {&running_mean, &running_var}) {
    if (!defined(*stat)) continue;
    const char* name = stat == &running_mean ? "running_mean" : "running_var";
    TORCH_CHECK((*stat)->dim() == 1 && (*stat)->sym_numel() == C,
        "Expected ", name, " to be a vector of size equal to the number of channels in input (", C,
        "), but got ", name, " of shape ", (*stat)->sym_sizes());
    TORCH_CHECK((*stat)->device() == input.device(),
        "Expected all tensors to be on the same device, but found input on ", input.device(),
        " and ", name, " on ", (*stat)->device());
    // As eager (batch_norm's derivative formula) in both modes; under no_grad it takes them.
    // The update below runs under a NoGradGuard, which would otherwise accept them.
    TORCH_CHECK(!(at::GradMode::is_enabled() && (*stat)->requires_grad()),
        "The function 'instance_norm' is not differentiable with respect to argument '", name,
        "'. This input cannot have requires_grad True.");
  }
  if (!use_input_stats) {
    return instance_norm_with_running_stats(input, *running_mean, *running_var, weight, bias, eps, ep);
  }
  const c10::SymInt spatial = spatial_numel(input);
  TORCH_CHECK_VALUE(spatial != 1,
      "Expected more than 1 spatial element when training, got input size ", input.sym_sizes());
  if (C == 0) {
    // No channels: nothing to normalize and no statistics to update, as in eager (a group norm
    // of 0 groups would be refused).
    return at::empty_like(input, input.suggest_memory_format());
  }

  // Instance norm is group norm with one channel per group.
  auto [output, mean, rstd] =
      call_forward(input, C.guard_int(__FILE__, __LINE__), weight, bias, eps, ep);

  // No update from an empty batch or from no spatial elements: eager's batch_norm leaves the
  // statistics as they are when it has no values to take them from.
  if ((defined(running_mean) || defined(running_var)) && input.sym_size(0) != 0 && spatial != 0) {
    // As PyTorch: running = (1 - momentum) * running + momentum * mean over the batch of the
    // per-instance statistic, with the per-instance variance unbiased.
    at::NoGradGuard no_grad;
    if (defined(running_mean)) {
      const at::Tensor batch_mean = mean.mean(0);
      running_mean->mul_(1 - momentum).add_(batch_mean.to(running_mean->scalar_type()), momentum);
    }
    if (defined(running_var)) {
      // The variance itself, as eager computes it: from rstd it would be rstd^-2 - eps, which
      // cancels to noise (even below zero) when the variance is small against eps. It costs a
      // pass over the input, only in calls that update running statistics (docs/deviations.md).
      std::vector<int64_t> spatial_dims(input.dim() - 2);
      for (size_t d = 0; d < spatial_dims.size(); ++d) spatial_dims[d] = static_cast<int64_t>(d) + 2;
      const auto opmath = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      const at::Tensor unbiased = at::var(input.to(opmath), spatial_dims, /*unbiased=*/true, /*keepdim=*/false);
      running_var->mul_(1 - momentum).add_(unbiased.mean(0).to(running_var->scalar_type()), momentum);
    }
  }
  return output;
}

}  // namespace

at::Tensor apply_epilogue(at::Tensor z, const at::Tensor& input, const EpilogueArgs& ep) {
  const int64_t rank = input.dim();
  auto per_sample_channel = [&](const char* name, const at::Tensor& t) {
    bool ok = t.dim() >= 2 && t.dim() <= rank && t.sym_size(0) == input.sym_size(0) &&
              t.sym_size(1) == input.sym_size(1);
    for (int64_t d = 2; ok && d < t.dim(); ++d) ok = t.sym_size(d) == 1;
    TORCH_CHECK(ok, "Expected ", name, " of shape (N, C) or (N, C, 1, ..., 1) with (N, C) = (",
        input.sym_size(0), ", ", input.sym_size(1), "), but got ", name, " of shape ", t.sym_sizes());
    std::vector<c10::SymInt> shape(rank, 1);
    shape[0] = input.sym_size(0);
    shape[1] = input.sym_size(1);
    return t.reshape_symint(shape).to(z.scalar_type());
  };
  auto like_input = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.sym_sizes() == input.sym_sizes(), "Expected ", name, " of the input's shape ",
        input.sym_sizes(), ", but got ", t.sym_sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type(), "Expected ", name,
        " to have the input's dtype (", input.scalar_type(), "), but got ", t.scalar_type());
    return t.to(z.scalar_type());
  };
  if (defined(ep.scale)) z = z * (per_sample_channel("scale", *ep.scale) + 1);
  if (defined(ep.shift)) z = z + per_sample_channel("shift", *ep.shift);
  if (defined(ep.residual)) z = z + like_input("residual", *ep.residual);
  switch (parse_activation(ep.activation)) {
    case Activation::SiLU: z = at::silu(z); break;
    case Activation::GELU: z = at::gelu(z); break;
    case Activation::GELUTanh: z = at::gelu(z, "tanh"); break;
    case Activation::ReLU: z = at::relu(z); break;
    case Activation::LeakyReLU: z = at::leaky_relu(z, ep.negative_slope); break;
    case Activation::Mish: z = at::mish(z); break;
    case Activation::None: break;
  }
  if (defined(ep.multiplier)) z = z * like_input("multiplier", *ep.multiplier);
  return z;
}

TORCH_LIBRARY(fusednorm, m) {
  m.def(
      "group_norm_forward(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " int num_groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_group_norm_forward(Tensor input, int num_groups, Tensor? weight, Tensor? bias,"
      " float eps, Tensor? scale, Tensor? shift, Tensor? residual, str activation,"
      " float negative_slope, Tensor? multiplier, Tensor? input_bias=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd,"
      " Tensor? weight, Tensor? bias, int num_groups, Tensor? scale, Tensor? shift,"
      " Tensor? residual, str activation, float negative_slope, Tensor? multiplier,"
      " bool[7] output_mask, bool sum_residual_multiplier_grads=False)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_group_norm_forward(Tensor input, Tensor other, int num_groups, Tensor? weight, Tensor? bias,"
      " float eps, Tensor? scale, Tensor? shift, Tensor? residual, str activation,"
      " float negative_slope, Tensor? multiplier, Tensor? input_bias=None)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "group_norm(Tensor input, int num_groups, Tensor? weight=None, Tensor? bias=None,"
      " float eps=1e-05, *, str? activation=None, float negative_slope=0.01,"
      " Tensor? scale=None, Tensor? shift=None, Tensor? residual=None, Tensor? multiplier=None,"
      " Tensor? input_bias=None) -> Tensor");
  m.def(
      "add_group_norm(Tensor input, Tensor other, int num_groups, Tensor? weight=None, Tensor? bias=None,"
      " float eps=1e-05, *, str? activation=None, float negative_slope=0.01,"
      " Tensor? scale=None, Tensor? shift=None, Tensor? residual=None, Tensor? multiplier=None,"
      " Tensor? input_bias=None) -> (Tensor, Tensor)");
  m.def(
      "instance_norm(Tensor input, Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None,"
      " Tensor? weight=None, Tensor? bias=None, bool use_input_stats=True, float momentum=0.1,"
      " float eps=1e-05, *, str? activation=None, float negative_slope=0.01,"
      " Tensor? scale=None, Tensor? shift=None, Tensor? residual=None, Tensor? multiplier=None)"
      " -> Tensor");
  m.def("replication_pad(Tensor input, int[] padding) -> Tensor");
  // Private: the CUDA kernel planner (plan.h, plan_op.cpp).
  m.def(
      "_plan(int[] sizes, int num_groups, ScalarType dtype, bool channels_last=False,"
      " str activation='none', str operands='', bool backward=False, int[] device=[]) -> str");
  m.def("_reload_kernel_overrides() -> str");
}

TORCH_LIBRARY_IMPL(fusednorm, CompositeImplicitAutograd, m) {
  m.impl("group_norm", &group_norm);
  m.impl("add_group_norm", &add_group_norm);
  m.impl("instance_norm", &instance_norm);
}

// torch.func.vmap: functorch's fallback refuses ops with mutable arguments (instance_norm's
// running statistics), so instance_norm decomposes under vmap as everywhere else, into the kernel
// ops, which the fallback batches. (group_norm needs nothing: the fallback takes it.)
TORCH_LIBRARY_IMPL(fusednorm, FuncTorchBatched, m) {
  m.impl("instance_norm", &instance_norm);
}

}  // namespace fusednorm
