// The one-pass forward, for groups small enough to sit in one CTA's shared memory or registers
// (docs/design.md, "One-pass forward", "Register kernel", "Channels-last one-pass"): the dispatch
// of a plan to its kernel (forward_one_pass) and the entry points of paths.h.
//
// The split forward reads x twice and takes three launches; for small groups that is mostly
// latency and launch overhead (Stable Diffusion UNet shapes, problem 3's rows of 8192). The
// one-pass kernels read x from DRAM once, in one launch, each kernel in a header of its own:
//   one_pass_shared_kernel.cuh    ChannelsFirst groups in a CTA's shared memory, or a cluster's
//                                 (paths Shared and Cluster);
//   one_pass_register_kernel.cuh  groups that fit in registers (path Registers; at most 4 packs a
//                                 thread of 512: problem 3's rows of 8192, UNet's small groups);
//   cols_one_pass_kernel.cuh      ChannelsLast groups in shared memory (path ColsShared).
// They share their arguments and output stage (one_pass_output.cuh) and their block and cluster
// moments (one_pass_moments.cuh) with the team, sweep and one-CTA backward kernels.

#pragma once

#include "cuda/cols_one_pass_kernel.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/host.cuh"
#include "cuda/one_pass_output.cuh"
#include "cuda/one_pass_register_kernel.cuh"
#include "cuda/one_pass_shared_kernel.cuh"
#include "cuda/paths.h"
#include "group_norm.h"
#include "plan.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace fusednorm {
namespace {

// Runs the one-pass forward as planned: path Registers, Shared or Cluster, or with
// `channels_last_path` path ColsShared. The two are separate entry points (paths.h), so that each
// is instantiated in a translation unit of its own (docs/design.md, "Source layout").
template <typename scalar_t, bool channels_last_path>
void forward_one_pass(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    TORCH_INTERNAL_ASSERT(false, "one-pass forward planned for double");
  } else {
    TORCH_INTERNAL_ASSERT((pl.path == plan::Path::ColsShared) == channels_last_path,
        "one-pass forward entry called for another path");
    OnePassArgs<scalar_t> a{};
    const bool made = make_one_pass_args<scalar_t, V>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, a);
    TORCH_INTERNAL_ASSERT(made, "one-pass forward planned for arguments it cannot take");
    const int64_t items = sh.N * sh.G;
    a.cluster = 1;
    if constexpr (channels_last_path) {
      launch_cols_one_pass<scalar_t>(a, items, pl);
    } else {
      if (!a.cols) a.chunk = ceil_div(a.len / V, pl.path == plan::Path::Registers ? 1 : pl.cluster);
      if (pl.path == plan::Path::Registers) return launch_registers_planned<scalar_t, V>(a, items, pl);
      a.cluster = pl.cluster;
      const size_t smem = static_cast<size_t>(pl.smem);
      if (a.epi.input_bias.ptr == nullptr) {
        dispatch_activation(ep.activation, [&](auto act) {
          launch_one_pass<scalar_t, V, decltype(act)::value, false>(a, items, smem);
        });
      } else {
        const bool launched = dispatch_common_activation(ep.activation, [&](auto act) {
          launch_one_pass<scalar_t, V, decltype(act)::value, true>(a, items, smem);
        });
        TORCH_INTERNAL_ASSERT(launched, "one-pass kernel given input_bias with an activation it has no kernel for");
      }
    }
  }
}

}  // namespace

// The one-pass entry points of paths.h, instantiated per dtype in kernels/<dtype>_one_pass.cu and
// kernels/<dtype>_cols_one_pass.cu.
template <typename scalar_t>
void one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  forward_one_pass<scalar_t, false>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
}

template <typename scalar_t>
void cols_one_pass_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y,
    at::Tensor& mean, at::Tensor& rstd) {
  forward_one_pass<scalar_t, true>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
}

template <typename scalar_t>
int cols_one_pass_residency(Activation act, int streams, int pack_bytes, int64_t smem, bool input_bias) {
  return cols_one_pass_ctas_per_sm<scalar_t>(act, streams, pack_bytes, smem, input_bias);
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(T)                                                             \
  template void fusednorm::one_pass_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,       \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&)
#define FUSEDNORM_INSTANTIATE_COLS_ONE_PASS(T)                                                                \
  template void fusednorm::cols_one_pass_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,  \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&);                                                                                           \
  template int fusednorm::cols_one_pass_residency<T>(Activation, int, int, int64_t, bool)
