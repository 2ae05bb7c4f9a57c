// The CPU kernels' entry points, compiled once per CPU capability (csrc/cpu/kernels/, each build
// in the namespace of its capability) and chosen at run time by capability.h (docs/design.md,
// 'CPU capabilities'). Arguments are checked and in the kernels' layout (registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "group_norm.h"

namespace fusednorm::cpu {

// The fused forward (the plain op's: an empty epilogue) of x, which is in `layout`: returns the
// output (in `layout`), mean and rstd, as fused_group_norm_forward.
using ForwardKernel = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor& x,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const GroupNormShape& shape, Layout layout, const Epilogue& epilogue);

// The fused backward: the gradients that `mask` asks for (group_norm.h, FusedGrads) of the forward
// of x (in `layout`) with the saved mean and rstd.
using BackwardKernel = FusedGrads(const at::Tensor& grad_out, const at::Tensor& x,
    const at::Tensor& mean, const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const GroupNormShape& shape, Layout layout,
    const Epilogue& epilogue, const FusedGradMask& mask, bool sum_residual_multiplier_grads);

// Declares one capability's build of the kernels (a namespace named as ATen's CPU_CAPABILITY).
#define FUSEDNORM_DECLARE_CPU_KERNELS(capability) \
  namespace capability {                           \
  ForwardKernel fused_forward;                     \
  BackwardKernel fused_backward;                   \
  }

FUSEDNORM_DECLARE_CPU_KERNELS(DEFAULT)
FUSEDNORM_DECLARE_CPU_KERNELS(AVX2)
FUSEDNORM_DECLARE_CPU_KERNELS(AVX512)

#undef FUSEDNORM_DECLARE_CPU_KERNELS

}  // namespace fusednorm::cpu
