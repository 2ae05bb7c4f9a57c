// The CPU kernels of the fusednorm ops: argument checks and layout here, then the build of the
// kernels that fits this CPU (capability.h; docs/design.md, 'CPU capabilities'). The plain ops
// are the fused ones with an empty epilogue; replication_pad is ATen's. Also the private op _cpu_capability.
#include <ATen/core/Tensor.h>
#include <ATen/ops/pad.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>

#include "cpu/capability.h"
#include "cpu/kernels.h"
#include "group_norm.h"

namespace fusednorm::cpu {
namespace {

using OptTensor = c10::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cpu(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  return kernels().forward(to_layout(input, layout), weight, bias, eps, sh, layout, Epilogue{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_cpu(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    const OptTensor& input_bias) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  at::Tensor x = to_layout(input, layout);
  const Epilogue ep =
      make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
  // The CPU kernels normalize input + input_bias materialized (docs/design.md, "Input bias").
  if (defined(input_bias)) {
    check_input_bias(x, *input_bias);
    x = to_layout(add_input_bias(x, *input_bias), layout);
  }
  return kernels().forward(x, weight, bias, eps, sh, layout, ep);
}

// The CPU kernels normalize the residual-add prologue's sum materialized (docs/design.md,
// "Residual-add prologue").
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_group_norm_forward_cpu(
    const at::Tensor& input, const at::Tensor& other, int64_t num_groups, const OptTensor& weight,
    const OptTensor& bias, double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier, const OptTensor& input_bias) {
  check_group_norm_args(input, num_groups, weight, bias);
  const at::Tensor sum = to_layout(add_operands(input, other, input_bias), layout_for(input));
  auto [output, mean, rstd] = fused_group_norm_forward_cpu(sum, num_groups, weight, bias, eps, scale, shift,
      residual, activation, negative_slope, multiplier, c10::nullopt);
  return {output, sum, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, int64_t num_groups,
    std::array<bool, 3> output_mask) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  const Layout layout = layout_for(input);
  const FusedGradMask mask{output_mask[0], output_mask[1], output_mask[2], false, false, false, false};
  const FusedGrads g = kernels().backward(grad_out, to_layout(input, layout), mean, rstd, weight,
      c10::nullopt, sh, layout, Epilogue{}, mask, /*sum_residual_multiplier_grads=*/false);
  return {g.input, g.weight, g.bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_group_norm_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    std::array<bool, 7> output_mask, bool sum_residual_multiplier_grads) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep =
      make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
  const FusedGrads g = kernels().backward(grad_out, x, mean, rstd, weight, bias, sh, layout, ep,
      kernel_grad_mask(output_mask, sum_residual_multiplier_grads), sum_residual_multiplier_grads);
  return fused_grads_outputs(g, sum_residual_multiplier_grads);
}

// ATen's own pad (the op exists for the CUDA kernel), in the input's suggested memory format as
// on every device (docs/design.md, "Replication pad"); ATen's CPU pad already keeps it.
at::Tensor replication_pad_cpu(const at::Tensor& input, at::IntArrayRef padding) {
  return at::pad(input, padding, "replicate").contiguous(input.suggest_memory_format());
}

// The capability the CPU kernels use now: "avx512", "avx2" or "default".
std::string cpu_capability() {
  return capability_name(capability());
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("group_norm_forward", &group_norm_forward_cpu);
  m.impl("group_norm_backward", &group_norm_backward_cpu);
  m.impl("fused_group_norm_forward", &fused_group_norm_forward_cpu);
  m.impl("add_group_norm_forward", &add_group_norm_forward_cpu);
  m.impl("fused_group_norm_backward", &fused_group_norm_backward_cpu);
  m.impl("replication_pad", &replication_pad_cpu);
}

// A private op (no tensors: it runs on no backend in particular), for diagnostics and tests.
TORCH_LIBRARY_FRAGMENT(fusednorm, m) {
  m.def("_cpu_capability() -> str", &cpu_capability);
}

}  // namespace fusednorm::cpu
