// Shared host-side pieces of the group-norm family: argument checks, the shape every kernel
// works on, and the two memory layouts the kernels read and write without a copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <array>

#include "epilogue.h"

namespace fusednorm {

// Whether an optional tensor argument was given (and is defined).
inline bool defined(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined();
}

// Every input of rank >= 2 is viewed as (N, C, S) with S = prod(spatial sizes).
// Group g of sample n covers channels [g * D, (g + 1) * D) over all S positions.
struct GroupNormShape {
  int64_t N;  // batch
  int64_t C;  // channels
  int64_t S;  // spatial elements per channel
  int64_t G;  // groups
  int64_t D;  // channels per group, C / G
};

// The layouts the kernels handle directly. Any other strides are copied to ChannelsFirst.
//   ChannelsFirst: (N, C, S) contiguous, what torch calls contiguous_format.
//   ChannelsLast:  (N, S, C) contiguous, i.e. channels_last / channels_last_3d, for any rank >= 3.
enum class Layout { ChannelsFirst, ChannelsLast };

// Validates the input's rank and dtype and the weight's and bias's device, shape and dtype.
// Works on symbolic shapes too (the composite ops call it while torch.compile traces them).
void check_input_and_params(
    const at::Tensor& input,
    const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias);

// Validates input, num_groups, weight and bias for the forward op and returns the shape.
// Raises the exception types PyTorch raises for the same mistakes.
GroupNormShape check_group_norm_args(
    const at::Tensor& input,
    int64_t num_groups,
    const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias);

// Validates the backward op's arguments against each other and returns the shape.
GroupNormShape check_group_norm_backward_args(
    const at::Tensor& grad_out,
    const at::Tensor& input,
    const at::Tensor& mean,
    const at::Tensor& rstd,
    const c10::optional<at::Tensor>& weight,
    int64_t num_groups);

// The layout the kernels use for `t`: ChannelsFirst if `t` is contiguous, ChannelsLast if it is
// dense with the channel dimension innermost, otherwise ChannelsFirst after a copy.
Layout layout_for(const at::Tensor& t);

// Whether t's strides are those of a dense tensor in `layout` (size-1 dimensions ignored).
bool has_strides_of(const at::Tensor& t, Layout layout);

// Whether each row (n, c) of `t` (rank >= 3) is contiguous: its dimensions after the channels
// dense among themselves (size-1 dimensions ignored), the batch's and channels' strides any (the
// frames of an NCDHW video, a slice of channels), and the rows' length and the batch's and
// channels' strides (of dimensions of size > 1) whole multiples of `pack` elements.
bool strided_rows_of(const at::Tensor& t, int64_t pack);

// `t` in `layout`, copied only when its strides are not already those of `layout`. A CUDA tensor
// is copied by the registered layout copy (below) where there is one and it takes the tensor.
at::Tensor to_layout(const at::Tensor& t, Layout layout);

// The copy of a CUDA tensor of rank >= 3 with elements, not in the layout given, into that
// layout; an undefined result leaves the copy to ATen. The CUDA build registers its kernels at
// load (csrc/cuda/layout_copy_kernel.cu: a tensor dense in the other layout, or one whose rows
// are contiguous into channels-first; docs/design.md, "Layout copies"); host code built without
// CUDA has none.
using LayoutCopy = at::Tensor (*)(const at::Tensor& t, Layout layout);
void register_cuda_layout_copy(LayoutCopy copy);

// An uninitialised tensor of `t`'s shape in `layout`, with the given dtype.
at::Tensor empty_in_layout(const at::Tensor& t, Layout layout, at::ScalarType dtype);

// dtype of the saved mean and rstd: float32, or float64 for float64 inputs.
inline at::ScalarType stats_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// The activation named `name` ("none", "silu", "gelu", "gelu_tanh", "relu", "leaky_relu",
// "mish"); anything else raises ValueError listing the valid names.
Activation parse_activation(c10::string_view name);

// Operands of the fused epilogue (epilogue.h), checked against the input and put in the form the
// kernels read.
struct Epilogue {
  at::Tensor scale, shift;          // undefined, or (N, C) contiguous in their own floating dtype
  at::Tensor residual, multiplier;  // undefined, or the input's shape and dtype in its kernel layout
  // The prologue: the operand added to the input before the normalization (make_input_bias),
  // undefined, or (C,) or (N, C) contiguous in the input's dtype. empty() does not look at it.
  at::Tensor input_bias;
  // The residual-add prologue (add_group_norm_forward): the kernels normalize
  // sum = input + addend (+ input_bias) and write that sum out. Undefined, or the input's shape,
  // dtype and kernel layout (addend) and an output buffer of the same (sum).
  at::Tensor addend, sum;
  Activation activation = Activation::None;
  double negative_slope = 0.01;

  bool modulated() const { return scale.defined() || shift.defined(); }
  // True when some operand works per element (the kernels then need p or q, see epilogue.h).
  bool elementwise() const {
    return residual.defined() || multiplier.defined() || activation != Activation::None;
  }
  bool empty() const { return !modulated() && !elementwise(); }
};

// Validates the epilogue operands of the fused ops:
//   scale, shift: shape (N, C) or (N, C, 1, ..., 1), any floating dtype, the input's device;
//   residual, multiplier: the input's shape, dtype and device (any strides: copied to `layout`).
Epilogue make_epilogue(
    const at::Tensor& input,
    const GroupNormShape& shape,
    Layout layout,
    const c10::optional<at::Tensor>& scale,
    const c10::optional<at::Tensor>& shift,
    const c10::optional<at::Tensor>& residual,
    c10::string_view activation,
    double negative_slope,
    const c10::optional<at::Tensor>& multiplier);

// Validates the fused forward's prologue operand: the kernels normalize input + input_bias, with
// input_bias of shape (C,) (a convolution's bias) or (N, C) or (N, C, 1, ..., 1) (a bias plus a
// per-sample embedding), the input's dtype and device. Works on symbolic shapes too.
void check_input_bias(const at::Tensor& input, const at::Tensor& input_bias);

// check_input_bias, then input_bias as the kernels read it: (C,) or (N, C), contiguous.
at::Tensor make_input_bias(const at::Tensor& input, const GroupNormShape& shape, const at::Tensor& input_bias);

// input_bias (any shape check_input_bias accepts) as a view of shape (1 or N, C, 1, ..., 1),
// broadcastable against the input.
at::Tensor input_bias_column(const at::Tensor& input, const at::Tensor& input_bias);

// input + input_bias (any shape check_input_bias accepts) broadcast over the spatial dimensions,
// in the input's dtype and memory format, with differentiable ATen ops: the prologue
// materialized, for the kernels that do not add it on the fly and for autograd (docs/design.md,
// "Input bias").
at::Tensor add_input_bias(const at::Tensor& input, const at::Tensor& input_bias);

// Validates the residual-add prologue's `other` (add_group_norm_forward): the input's shape, dtype
// and device. Works on symbolic shapes too.
void check_addend(const at::Tensor& input, const at::Tensor& other);

// input + other (+ input_bias, as add_input_bias) with differentiable ATen ops, in the input's
// dtype (the memory format ATen's add gives): the residual-add prologue's sum materialized, for the kernels that do
// not compute it on the fly and for autograd (docs/design.md, "Residual-add prologue").
at::Tensor add_operands(const at::Tensor& input, const at::Tensor& other, const c10::optional<at::Tensor>& input_bias);

// The epilogue keywords of the composite ops, as passed ("none" for no activation).
struct EpilogueArgs {
  c10::string_view activation;
  double negative_slope;
  const c10::optional<at::Tensor>& scale;
  const c10::optional<at::Tensor>& shift;
  const c10::optional<at::Tensor>& residual;
  const c10::optional<at::Tensor>& multiplier;

  bool empty() const {
    return parse_activation(activation) == Activation::None && !defined(scale) && !defined(shift) &&
           !defined(residual) && !defined(multiplier);
  }
};

// The epilogue of epilogue.h on an already normalized z, with differentiable ATen ops (ops.cpp):
// the eval path of instance_norm, which is not a kernel op, and the double backward
// (autograd.cpp). Operands are checked as make_epilogue does, on symbolic shapes too.
at::Tensor apply_epilogue(at::Tensor z, const at::Tensor& input, const EpilogueArgs& ep);

// Outputs of fused_group_norm_backward, in schema order. An output whose output_mask entry is
// false is an empty tensor of shape (0,).
//   grad_input, grad_residual, grad_multiplier: the input's shape and dtype, in its kernel layout;
//   grad_weight, grad_bias: (C,);  grad_scale, grad_shift: (N, C).
// Each parameter gradient has its parameter's dtype (the kernels accumulate in float32 or double
// and round once on the store), so that autograd launches no cast after the op: grad_weight the
// weight's, grad_bias the bias's (the weight's for the plain op, which is not given the bias),
// grad_scale / grad_shift the scale's / shift's; stats_dtype where there is no such parameter.
struct FusedGrads {
  at::Tensor input, weight, bias, scale, shift, residual, multiplier;
};
constexpr int kNumFusedGrads = 7;
using FusedGradMask = std::array<bool, kNumFusedGrads>;

// With sum_residual_multiplier_grads, output 5 is grad_residual + grad_multiplier (wanted when
// output_mask asks for either) and output 6 is empty: the gradient of a tensor that is both the
// residual and the multiplier (problem 3's (h + y) * y), which autograd would otherwise add up in a
// pass of its own. The backends then compute both gradients (kernel_grad_mask) into one buffer
// (empty_fused_grads aliases them), and their kernels write the sum once where the two output
// pointers are equal; fused_grads_outputs empties output 6.
FusedGradMask kernel_grad_mask(const FusedGradMask& output_mask, bool sum_residual_multiplier_grads);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_grads_outputs(const FusedGrads& g, bool sum_residual_multiplier_grads);

// dtype of grad_bias (grad_weight: pass no bias): the bias's, else the weight's, else
// stats_dtype(input_dtype).
at::ScalarType param_grad_dtype(const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, at::ScalarType input_dtype);

// Allocates the requested gradients (uninitialised) for an input laid out as `x`, with dtypes as
// above; grad_multiplier is grad_residual's buffer with sum_residual_multiplier_grads.
FusedGrads empty_fused_grads(const at::Tensor& x, const GroupNormShape& shape, Layout layout,
    const FusedGradMask& mask, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const Epilogue& ep, bool sum_residual_multiplier_grads = false);

}  // namespace fusednorm
