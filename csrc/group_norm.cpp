#include "group_norm.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/SmallVector.h>

#include <algorithm>

namespace fusednorm {
namespace {

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void check_same_device(const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK(t.device() == input.device(),
      "Expected all tensors to be on the same device, but found input on ", input.device(),
      " and ", name, " on ", t.device());
}

void check_param(const char* name, const at::Tensor& param, const at::Tensor& input) {
  check_same_device(name, param, input);
  TORCH_CHECK(param.dim() == 1 && param.sym_numel() == input.sym_size(1),
      "Expected ", name, " to be a vector of size equal to the number of channels in input, but got ",
      name, " of shape ", param.sym_sizes(), " and input of shape ", input.sym_sizes());
  const auto in = input.scalar_type();
  const auto p = param.scalar_type();
  const bool reduced_input = in == at::kBFloat16 || in == at::kHalf;
  // Mixed precision as on PyTorch's CPU kernels: bf16/fp16 input with fp32 parameters. Any other
  // mix is a RuntimeError, as eager's "mixed dtype" check raises.
  TORCH_CHECK(p == in || (reduced_input && p == at::kFloat),
      "Expected ", name, " to have the input's dtype (", in, ")",
      reduced_input ? " or float32" : "", ", but got ", p);
}

}  // namespace

void check_input_and_params(
    const at::Tensor& input,
    const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 2,
      "Expected at least 2 dimensions for input tensor but received ", input.dim());
  TORCH_CHECK_NOT_IMPLEMENTED(is_supported_dtype(input.scalar_type()),
      "\"fusednorm::group_norm\" not implemented for '", input.scalar_type(),
      "': expected float32, float64, bfloat16 or float16 input");
  if (weight.has_value() && weight->defined()) check_param("weight", *weight, input);
  if (bias.has_value() && bias->defined()) check_param("bias", *bias, input);
}

GroupNormShape check_group_norm_args(
    const at::Tensor& input,
    int64_t num_groups,
    const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias) {
  check_input_and_params(input, weight, bias);
  TORCH_CHECK(num_groups > 0, "Expected num_groups to be positive, but got num_groups=", num_groups);
  const int64_t N = input.size(0);
  const int64_t C = input.size(1);
  TORCH_CHECK(C % num_groups == 0,
      "Expected number of channels in input to be divisible by num_groups, but got input of shape ",
      input.sizes(), " and num_groups=", num_groups);
  int64_t spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.size(d);
  return GroupNormShape{N, C, spatial, num_groups, C / num_groups};
}

GroupNormShape check_group_norm_backward_args(
    const at::Tensor& grad_out,
    const at::Tensor& input,
    const at::Tensor& mean,
    const at::Tensor& rstd,
    const c10::optional<at::Tensor>& weight,
    int64_t num_groups) {
  const GroupNormShape shape = check_group_norm_args(input, num_groups, weight, c10::nullopt);
  TORCH_CHECK(grad_out.sizes() == input.sizes(),
      "Expected grad_out of the input's shape ", input.sizes(), ", but got ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(),
      "Expected grad_out of the input's dtype ", input.scalar_type(), ", but got ",
      grad_out.scalar_type());
  for (const auto* stat : {&mean, &rstd}) {
    const char* name = stat == &mean ? "mean" : "rstd";
    TORCH_CHECK(stat->dim() == 2 && stat->size(0) == shape.N && stat->size(1) == shape.G &&
                    stat->scalar_type() == stats_dtype(input.scalar_type()),
        "Expected ", name, " to be a ", stats_dtype(input.scalar_type()), " tensor of shape (", shape.N, ", ", shape.G,
        "), but got ", stat->scalar_type(), " of shape ", stat->sizes());
  }
  for (const auto* t : {&grad_out, &mean, &rstd}) {
    TORCH_CHECK(t->device() == input.device(),
        "Expected all tensors to be on the same device, but found input on ", input.device(),
        " and another argument on ", t->device());
  }
  return shape;
}

namespace {

// The dimensions of a dense rank-`dims` tensor in `layout`, innermost first: channels-first the
// last to the first; channels-last the channels, the spatial dimensions last to first, the batch.
c10::SmallVector<int64_t, 8> dims_innermost_first(int64_t dims, Layout layout) {
  c10::SmallVector<int64_t, 8> order;
  if (layout == Layout::ChannelsLast) order.push_back(1);
  for (int64_t d = dims - 1; d >= 0; --d) {
    if (layout == Layout::ChannelsFirst || d != 1) order.push_back(d);
  }
  return order;
}

// Whether the dimensions `dims` of t, innermost first, are dense among themselves: each one's
// stride the product of the sizes before it in `dims` (size-1 dimensions ignored).
bool dense_over(const at::Tensor& t, c10::ArrayRef<int64_t> dims) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  int64_t expected = 1;
  for (const int64_t d : dims) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= std::max<int64_t>(sizes[d], 1);
  }
  return true;
}

}  // namespace

// Read from the sizes and strides themselves: is_contiguous() calls every empty tensor
// contiguous, and a movedim view for the check would cost host time on every call
// (docs/design.md, "Host time").
bool has_strides_of(const at::Tensor& t, Layout layout) {
  return dense_over(t, dims_innermost_first(t.dim(), layout));
}

bool strided_rows_of(const at::Tensor& t, int64_t pack) {
  if (t.dim() < 3) return false;
  c10::SmallVector<int64_t, 8> row_dims;
  int64_t row = 1;
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    row_dims.push_back(d);
    row *= t.size(d);
  }
  const auto whole_packs = [&](int64_t d) { return t.size(d) == 1 || t.stride(d) % pack == 0; };
  return dense_over(t, row_dims) && row % pack == 0 && whole_packs(0) && whole_packs(1);
}

Layout layout_for(const at::Tensor& t) {
  // The output keeps the input's layout, as eager's norms keep its suggested memory format
  // (docs/deviations.md, 'Memory format'); the kernels keep dense channels-last at any rank >= 3.
  if (t.numel() == 0) {
    // Nothing to compute: the layout its strides say, so that an empty batch comes back as a
    // full one does.
    return t.dim() >= 3 && !has_strides_of(t, Layout::ChannelsFirst) && has_strides_of(t, Layout::ChannelsLast)
        ? Layout::ChannelsLast
        : Layout::ChannelsFirst;
  }
  if (t.is_contiguous()) return Layout::ChannelsFirst;
  if (t.dim() >= 3 && has_strides_of(t, Layout::ChannelsLast)) return Layout::ChannelsLast;
  // Not dense in either layout (a slice): copied to the layout eager would return.
  const auto suggested = t.suggest_memory_format();
  return suggested == at::MemoryFormat::ChannelsLast || suggested == at::MemoryFormat::ChannelsLast3d
      ? Layout::ChannelsLast
      : Layout::ChannelsFirst;
}

namespace {

LayoutCopy& cuda_layout_copy() {
  static LayoutCopy copy = nullptr;
  return copy;
}

}  // namespace

void register_cuda_layout_copy(LayoutCopy copy) {
  cuda_layout_copy() = copy;
}

at::Tensor to_layout(const at::Tensor& t, Layout layout) {
  if (layout == Layout::ChannelsFirst ? t.is_contiguous() : has_strides_of(t, Layout::ChannelsLast)) return t;
  if (t.is_cuda() && cuda_layout_copy() != nullptr && t.dim() >= 3 && t.numel() > 0) {
    at::Tensor copy = cuda_layout_copy()(t, layout);
    if (copy.defined()) return copy;
  }
  if (layout == Layout::ChannelsFirst) return t.contiguous();
  return t.movedim(1, -1).contiguous().movedim(-1, 1);
}

at::Tensor empty_in_layout(const at::Tensor& t, Layout layout, at::ScalarType dtype) {
  const auto options = t.options().dtype(dtype);
  if (layout == Layout::ChannelsFirst) return at::empty(t.sizes(), options);
  // The strides of a contiguous tensor of the sizes with the channels moved last (each stride the
  // product of the inner sizes, a 0 counted as 1, as at::empty gives), in the sizes' order.
  const auto sizes = t.sizes();
  c10::SmallVector<int64_t, 8> strides(sizes.size());
  int64_t next = 1;
  for (const int64_t d : dims_innermost_first(t.dim(), layout)) {
    strides[d] = next;
    next *= std::max<int64_t>(sizes[d], 1);
  }
  return at::empty_strided(sizes, strides, options);
}

}  // namespace fusednorm

namespace fusednorm {

Activation parse_activation(c10::string_view name) {
  for (int i = 0; i < kNumActivations; ++i) {
    const auto a = static_cast<Activation>(i);
    if (name == activation_name(a)) return a;
  }
  std::string valid;
  for (int i = 0; i < kNumActivations; ++i) {
    valid += std::string(i ? ", " : "") + "'" + activation_name(static_cast<Activation>(i)) + "'";
  }
  TORCH_CHECK_VALUE(false, "Unknown activation '", std::string(name.data(), name.size()),
      "': expected one of ", valid);
}

namespace {

// scale / shift: (N, C) or (N, C, 1, ..., 1) -> (N, C) contiguous in the stats dtype.
at::Tensor per_sample_channel(const char* name, const at::Tensor& t, const at::Tensor& input,
    const GroupNormShape& sh) {
  check_same_device(name, t, input);
  // No more dims than the input: eager's z * (1 + scale) would broadcast to a higher rank.
  bool ok = t.dim() >= 2 && t.dim() <= input.dim() && t.size(0) == sh.N && t.size(1) == sh.C;
  for (int64_t d = 2; ok && d < t.dim(); ++d) ok = t.size(d) == 1;
  TORCH_CHECK(ok, "Expected ", name, " of shape (N, C) or (N, C, 1, ..., 1) with (N, C) = (",
      sh.N, ", ", sh.C, "), but got ", name, " of shape ", t.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()),
      "Expected ", name, " to be a floating-point tensor, but got ", t.scalar_type());
  // Kept in its own dtype: the kernels convert on load (a cast here is one more launch per call).
  return t.reshape({sh.N, sh.C}).contiguous();
}

// residual / multiplier: the input's shape and dtype, in the kernels' layout.
at::Tensor like_input(const char* name, const at::Tensor& t, const at::Tensor& input, Layout layout) {
  check_same_device(name, t, input);
  TORCH_CHECK(t.sizes() == input.sizes(), "Expected ", name, " of the input's shape ",
      input.sizes(), ", but got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type(), "Expected ", name,
      " to have the input's dtype (", input.scalar_type(), "), but got ", t.scalar_type());
  return to_layout(t, layout);
}

}  // namespace

Epilogue make_epilogue(
    const at::Tensor& input,
    const GroupNormShape& shape,
    Layout layout,
    const c10::optional<at::Tensor>& scale,
    const c10::optional<at::Tensor>& shift,
    const c10::optional<at::Tensor>& residual,
    c10::string_view activation,
    double negative_slope,
    const c10::optional<at::Tensor>& multiplier) {
  Epilogue ep;
  ep.activation = parse_activation(activation);
  ep.negative_slope = negative_slope;
  if (defined(scale)) ep.scale = per_sample_channel("scale", *scale, input, shape);
  if (defined(shift)) ep.shift = per_sample_channel("shift", *shift, input, shape);
  if (defined(residual)) ep.residual = like_input("residual", *residual, input, layout);
  if (defined(multiplier)) ep.multiplier = like_input("multiplier", *multiplier, input, layout);
  return ep;
}

void check_input_bias(const at::Tensor& input, const at::Tensor& input_bias) {
  const at::Tensor& t = input_bias;
  check_same_device("input_bias", t, input);
  bool ok = t.dim() == 1 ? t.sym_size(0) == input.sym_size(1)
                         : t.dim() >= 2 && t.dim() <= input.dim() && t.sym_size(0) == input.sym_size(0) &&
                               t.sym_size(1) == input.sym_size(1);
  for (int64_t d = 2; ok && d < t.dim(); ++d) ok = t.sym_size(d) == 1;
  TORCH_CHECK(ok, "Expected input_bias of shape (C,), (N, C) or (N, C, 1, ..., 1) with (N, C) = (",
      input.sym_size(0), ", ", input.sym_size(1), "), but got input_bias of shape ", t.sym_sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type(), "Expected input_bias to have the input's dtype (",
      input.scalar_type(), "), but got ", t.scalar_type());
}

at::Tensor make_input_bias(const at::Tensor& input, const GroupNormShape& sh, const at::Tensor& input_bias) {
  check_input_bias(input, input_bias);
  return input_bias.dim() == 1 ? input_bias.contiguous() : input_bias.reshape({sh.N, sh.C}).contiguous();
}

at::Tensor input_bias_column(const at::Tensor& input, const at::Tensor& input_bias) {
  // (1, C) or (N, C), then a 1 a spatial dimension: no sizes read (symbolic under torch.compile).
  at::Tensor p = input_bias.dim() == 1 ? input_bias.unsqueeze(0) : input_bias.flatten(1);
  for (int64_t d = 2; d < input.dim(); ++d) p = p.unsqueeze(-1);
  return p;
}

at::Tensor add_input_bias(const at::Tensor& input, const at::Tensor& input_bias) {
  return at::add(input, input_bias_column(input, input_bias));
}

void check_addend(const at::Tensor& input, const at::Tensor& other) {
  check_same_device("other", other, input);
  TORCH_CHECK(other.sym_sizes() == input.sym_sizes(), "Expected other of the input's shape ", input.sym_sizes(),
      ", but got other of shape ", other.sym_sizes());
  TORCH_CHECK_TYPE(other.scalar_type() == input.scalar_type(), "Expected other to have the input's dtype (",
      input.scalar_type(), "), but got ", other.scalar_type());
}

at::Tensor add_operands(const at::Tensor& input, const at::Tensor& other, const c10::optional<at::Tensor>& input_bias) {
  check_addend(input, other);
  at::Tensor sum = at::add(input, other);
  if (defined(input_bias)) {
    check_input_bias(input, *input_bias);
    sum = add_input_bias(sum, *input_bias);
  }
  return sum;
}

at::ScalarType param_grad_dtype(const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, at::ScalarType input_dtype) {
  if (defined(bias)) return bias->scalar_type();
  if (defined(weight)) return weight->scalar_type();
  return stats_dtype(input_dtype);
}

FusedGradMask kernel_grad_mask(const FusedGradMask& output_mask, bool sum_residual_multiplier_grads) {
  FusedGradMask mask = output_mask;
  if (sum_residual_multiplier_grads) mask[5] = mask[6] = output_mask[5] || output_mask[6];
  return mask;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_grads_outputs(const FusedGrads& g, bool sum_residual_multiplier_grads) {
  const at::Tensor multiplier = sum_residual_multiplier_grads ? at::empty({0}, g.input.options()) : g.multiplier;
  return {g.input, g.weight, g.bias, g.scale, g.shift, g.residual, multiplier};
}

FusedGrads empty_fused_grads(const at::Tensor& x, const GroupNormShape& sh, Layout layout,
    const FusedGradMask& mask, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const Epilogue& ep, bool sum_residual_multiplier_grads) {
  const auto none = at::empty({0}, x.options());
  const at::ScalarType stats = stats_dtype(x.scalar_type());
  auto like_x = [&](bool wanted) { return wanted ? empty_in_layout(x, layout, x.scalar_type()) : none; };
  auto per_channel = [&](bool wanted, at::ScalarType dtype) {
    return at::empty({wanted ? sh.C : 0}, x.options().dtype(dtype));
  };
  auto per_sample_channel = [&](bool wanted, const at::Tensor& operand) {
    const auto opts = x.options().dtype(operand.defined() ? operand.scalar_type() : stats);
    return wanted ? at::empty({sh.N, sh.C}, opts) : at::empty({0}, opts);
  };
  FusedGrads g;
  g.input = like_x(mask[0]);
  g.weight = per_channel(mask[1], param_grad_dtype(weight, c10::nullopt, x.scalar_type()));
  g.bias = per_channel(mask[2], param_grad_dtype(weight, bias, x.scalar_type()));
  g.scale = per_sample_channel(mask[3], ep.scale);
  g.shift = per_sample_channel(mask[4], ep.shift);
  g.residual = like_x(mask[5]);
  g.multiplier = sum_residual_multiplier_grads ? g.residual : like_x(mask[6]);
  return g;
}

}  // namespace fusednorm
