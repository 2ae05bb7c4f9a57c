// The C++ types of the kernel ops whose schemas ops.cpp defines, and their dispatcher lookup:
// the composite ops (ops.cpp) and the autograd kernels (autograd.cpp) call them through the
// dispatcher, each with the same typed handle.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <array>
#include <tuple>

namespace fusednorm {

using OptTensor = c10::optional<at::Tensor>;

// group_norm_forward(input, num_groups, weight, bias, eps) -> (output, mean, rstd)
using ForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double);
// group_norm_backward(grad_out, input, mean, rstd, weight, num_groups, output_mask)
using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, std::array<bool, 3>);
// fused_group_norm_forward(input, num_groups, weight, bias, eps, scale, shift, residual,
// activation, negative_slope, multiplier, input_bias) -> (output, mean, rstd)
using FusedForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, int64_t,
    const OptTensor&, const OptTensor&, double, const OptTensor&, const OptTensor&, const OptTensor&,
    c10::string_view, double, const OptTensor&, const OptTensor&);
// fused_group_norm_backward(grad_out, input, mean, rstd, weight, bias, num_groups, scale, shift,
// residual, activation, negative_slope, multiplier, output_mask, sum_residual_multiplier_grads)
using FusedBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
    at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    const OptTensor&, int64_t, const OptTensor&, const OptTensor&, const OptTensor&, c10::string_view, double,
    const OptTensor&, std::array<bool, 7>, bool);
// add_group_norm_forward(input, other, num_groups, weight, bias, eps, scale, shift, residual,
// activation, negative_slope, multiplier, input_bias) -> (output, sum, mean, rstd)
using AddForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
    const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double, const OptTensor&, const OptTensor&,
    const OptTensor&, c10::string_view, double, const OptTensor&, const OptTensor&);
// replication_pad(input, padding) -> output
using ReplicationPadFn = at::Tensor(const at::Tensor&, at::IntArrayRef);

// The typed handle of kernel op `name` ("fusednorm::..."); callers keep it in a function-local
// static.
template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

}  // namespace fusednorm
