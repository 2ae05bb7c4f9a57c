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
//                          epilogue.h (scale, shift, residual, activation, multiplier); backward
//                          returns the gradients of input, weight, bias, scale, shift, residual and
//                          multiplier (FusedGrads in group_norm.h), each parameter's gradient in
//                          that parameter's dtype
// Composite ops (this file):
//   group_norm     F.group_norm semantics, plus the optional epilogue keywords
//   instance_norm  F.instance_norm semantics, running statistics updated in place, plus the
//                  optional epilogue keywords
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "group_norm.h"

namespace fusednorm {
namespace {

using OptTensor = c10::optional<at::Tensor>;
using ForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double);

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_group_norm_forward(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusednorm::group_norm_forward", "")
                       .typed<ForwardFn>();
  return op.call(input, num_groups, weight, bias, eps);
}

// Product of the spatial sizes, symbolic under torch.compile's dynamic shapes.
c10::SymInt spatial_numel(const at::Tensor& input) {
  c10::SymInt n = 1;
  for (int64_t d = 2; d < input.dim(); ++d) n = n * input.sym_size(d);
  return n;
}

using FusedForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double, const OptTensor&,
    const OptTensor&, const OptTensor&, c10::string_view, double, const OptTensor&);

// The plain kernel op when there is no epilogue (so graphs of plain calls stay plain), else the
// fused one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const EpilogueArgs& ep) {
  if (ep.empty()) return call_group_norm_forward(input, num_groups, weight, bias, eps);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusednorm::fused_group_norm_forward", "")
                       .typed<FusedForwardFn>();
  return op.call(input, num_groups, weight, bias, eps, ep.scale, ep.shift, ep.residual,
      ep.activation, ep.negative_slope, ep.multiplier);
}

using OptString = c10::optional<c10::string_view>;

c10::string_view activation_or_none(const OptString& activation) {
  return activation.has_value() ? *activation : c10::string_view("none");
}

at::Tensor group_norm(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, OptString activation, double negative_slope, const OptTensor& scale,
    const OptTensor& shift, const OptTensor& residual, const OptTensor& multiplier) {
  // As F.group_norm (it also runs where the Python wrapper does not, e.g. in TorchScript).
  TORCH_CHECK(input.dim() >= 2,
      "Expected at least 2 dimensions for input tensor but received ", input.dim());
  TORCH_CHECK(num_groups > 0, "Expected num_groups to be positive, but got num_groups=", num_groups);
  TORCH_CHECK_VALUE(input.sym_size(0) * input.sym_size(1) / num_groups * spatial_numel(input) != 1,
      "Expected more than 1 value per channel when training, got input size ", input.sym_sizes());
  const EpilogueArgs ep{activation_or_none(activation), negative_slope, scale, shift, residual, multiplier};
  return std::get<0>(call_forward(input, num_groups, weight, bias, eps, ep));
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
  }
  if (!use_input_stats) {
    return instance_norm_with_running_stats(input, *running_mean, *running_var, weight, bias, eps, ep);
  }
  const c10::SymInt spatial = spatial_numel(input);
  TORCH_CHECK_VALUE(spatial != 1,
      "Expected more than 1 spatial element when training, got input size ", input.sym_sizes());

  // Instance norm is group norm with one channel per group.
  auto [output, mean, rstd] =
      call_forward(input, C.guard_int(__FILE__, __LINE__), weight, bias, eps, ep);

  if ((defined(running_mean) || defined(running_var)) && input.sym_size(0) != 0) {
    // As PyTorch: running = (1 - momentum) * running + momentum * mean over the batch of the
    // per-instance statistic, with the per-instance variance unbiased.
    at::NoGradGuard no_grad;
    if (defined(running_mean)) {
      const at::Tensor batch_mean = mean.mean(0);
      running_mean->mul_(1 - momentum).add_(batch_mean.to(running_mean->scalar_type()), momentum);
    }
    if (defined(running_var)) {
      // rstd = 1 / sqrt(var + eps), so var = rstd^-2 - eps.
      const at::Tensor var = rstd.pow(-2).sub_(eps);
      const at::Tensor unbiased = var.mul_(c10::Scalar(spatial)).div_(c10::Scalar(spatial - 1));
      running_var->mul_(1 - momentum).add_(unbiased.mean(0).to(running_var->scalar_type()), momentum);
    }
  }
  return output;
}

}  // namespace

at::Tensor apply_epilogue(at::Tensor z, const at::Tensor& input, const EpilogueArgs& ep) {
  const int64_t rank = input.dim();
  auto per_sample_channel = [&](const char* name, const at::Tensor& t) {
    bool ok = t.dim() >= 2 && t.sym_size(0) == input.sym_size(0) && t.sym_size(1) == input.sym_size(1);
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
      " float negative_slope, Tensor? multiplier) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd,"
      " Tensor? weight, Tensor? bias, int num_groups, Tensor? scale, Tensor? shift,"
      " Tensor? residual, str activation, float negative_slope, Tensor? multiplier,"
      " bool[7] output_mask, bool sum_residual_multiplier_grads=False)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "group_norm(Tensor input, int num_groups, Tensor? weight=None, Tensor? bias=None,"
      " float eps=1e-05, *, str? activation=None, float negative_slope=0.01,"
      " Tensor? scale=None, Tensor? shift=None, Tensor? residual=None, Tensor? multiplier=None)"
      " -> Tensor");
  m.def(
      "instance_norm(Tensor input, Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None,"
      " Tensor? weight=None, Tensor? bias=None, bool use_input_stats=True, float momentum=0.1,"
      " float eps=1e-05, *, str? activation=None, float negative_slope=0.01,"
      " Tensor? scale=None, Tensor? shift=None, Tensor? residual=None, Tensor? multiplier=None)"
      " -> Tensor");
  // Private: the CUDA kernel planner (plan.h, plan_op.cpp).
  m.def(
      "_plan(int[] sizes, int num_groups, ScalarType dtype, bool channels_last=False,"
      " str activation='none', str operands='', bool backward=False, int[] device=[]) -> str");
  m.def("_reload_kernel_overrides() -> str");
}

TORCH_LIBRARY_IMPL(fusednorm, CompositeImplicitAutograd, m) {
  m.impl("group_norm", &group_norm);
  m.impl("instance_norm", &instance_norm);
}

}  // namespace fusednorm
