// Host-side helpers of every path's launcher: the device's SMs and the split passes' tiling on
// it (the planner's, plan.h), pointer alignment, parameters and epilogue operands as the kernels
// take them, and the compile-time dispatch of the activation.
#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

int num_sms() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// The split passes' tiling is the planner's (plan.cpp; docs/design.md, "Split passes"), on this
// device.
static_assert(kThreads == plan::kSplitThreads && kUnroll == plan::kSplitUnroll && kMaxEntries == plan::kMaxEntries &&
                  kMaxParamEntries == plan::kMaxParamEntries && kBlocksPerSM == plan::kSplitBlocksPerSM &&
                  kMinBlocks == plan::kSplitMinBlocks,
    "the planner's split-pass constants are the kernels'");
using plan::ceil_log2;
using plan::grid_of_every_tile;
using plan::log_piece;
using plan::tile_apply_rows;
using plan::Tiling;

int grid_for(int64_t tiles) { return plan::grid_for(tiles, num_sms()); }

Tiling tile_rows(int64_t rows, int64_t lenv, int64_t max_split) {
  return plan::tile_rows(rows, lenv, max_split, num_sms());
}

Tiling tile_cols(int64_t N, int64_t S, int64_t cvn, int64_t max_split, bool forward) {
  return plan::tile_cols(N, S, cvn, max_split, num_sms(), forward);
}

Tiling tile_apply_cols(int64_t rows, int64_t cvn, bool forward) {
  return plan::tile_apply_cols(rows, cvn, num_sms(), forward);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Threads per finalize item: a warp, or the whole block for items with many partials.
int log_item_width(int64_t entries) {
  return entries > 4 * kWarp ? kLogThreads : kLogWarp;
}

template <typename scalar_t>
ParamRef param_ref(const at::Tensor& t) {
  return ParamRef{t.defined() ? t.data_ptr() : nullptr,
      t.defined() ? t.scalar_type() : c10::CppTypeToScalarType<scalar_t>::value};
}

template <typename scalar_t>
InputBiasRef<scalar_t> input_bias_ref(const at::Tensor& t) {
  if (!t.defined()) return {nullptr, 0};
  return {t.data_ptr<scalar_t>(), t.dim() == 2 ? t.size(1) : 0};
}

// Host side: calls f(std::integral_constant<Activation, act>()), the activation as a template
// argument of the one-pass and team kernels (every activation: their loops are small).
template <typename F>
void dispatch_activation(Activation act, const F& f) {
  switch (act) {
    case Activation::SiLU: return f(std::integral_constant<Activation, Activation::SiLU>());
    case Activation::GELU: return f(std::integral_constant<Activation, Activation::GELU>());
    case Activation::GELUTanh: return f(std::integral_constant<Activation, Activation::GELUTanh>());
    case Activation::ReLU: return f(std::integral_constant<Activation, Activation::ReLU>());
    case Activation::LeakyReLU: return f(std::integral_constant<Activation, Activation::LeakyReLU>());
    case Activation::Mish: return f(std::integral_constant<Activation, Activation::Mish>());
    default: return f(std::integral_constant<Activation, Activation::None>());
  }
}

// As dispatch_activation, for the kernels instantiated for the common activations only
// (plan::common_activation: none, SiLU, ReLU; the register, channels-last one-pass and
// channels-last activation kernels and the team forward with input_bias, where each activation is
// one more copy of an unrolled element loop). Returns false, calling nothing, for the others: the
// caller takes a more general kernel.
template <typename F>
bool dispatch_common_activation(Activation act, const F& f) {
  switch (act) {
    case Activation::None:
      f(std::integral_constant<Activation, Activation::None>());
      return true;
    case Activation::SiLU:
      f(std::integral_constant<Activation, Activation::SiLU>());
      return true;
    case Activation::ReLU:
      f(std::integral_constant<Activation, Activation::ReLU>());
      return true;
    default:
      return false;
  }
}

// The epilogue's operands as the kernels take them. The residual is passed only where p is
// needed (`with_residual`); the gradient outputs are the caller's to set.
template <typename scalar_t>
EpiArgs<scalar_t> epi_args(const Epilogue& ep, bool with_residual) {
  using acc_t = acc_type<scalar_t>;
  EpiArgs<scalar_t> e{};
  e.scale = param_ref<scalar_t>(ep.scale);
  e.shift = param_ref<scalar_t>(ep.shift);
  e.residual = with_residual && ep.residual.defined() ? ep.residual.data_ptr<scalar_t>() : nullptr;
  e.multiplier = ep.multiplier.defined() ? ep.multiplier.data_ptr<scalar_t>() : nullptr;
  e.grad_residual = nullptr;
  e.grad_multiplier = nullptr;
  e.act = ep.activation;
  e.slope = static_cast<acc_t>(ep.negative_slope);
  e.input_bias = input_bias_ref<scalar_t>(ep.input_bias);
  return e;
}

// Whether every elementwise pointer of `e` allows packs of `bytes` bytes (null ones do).
template <typename scalar_t>
bool epi_aligned(const EpiArgs<scalar_t>& e, size_t bytes = 16) {
  return aligned_to(e.residual, bytes) && aligned_to(e.multiplier, bytes) &&
         aligned_to(e.grad_residual, bytes) && aligned_to(e.grad_multiplier, bytes);
}

}  // namespace
}  // namespace fusednorm
