// The kernels templated on the accumulation type only, which every dtype and path shares
// (paths.h): the backward's dx coefficients of the split passes and the parameter gradients of
// every backward path, with the planner's residency question about the latter. Compiled once
// here rather than in each dtype's file (docs/design.md, "Source layout").

#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/host.cuh"
#include "cuda/paths.h"
#include "cuda/split_finalize.cuh"
#include "group_norm.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <array>
#include <cstdint>

namespace fusednorm {
namespace {

// Clusters of `parts` CTAs of the parameter-gradient finalize `kernel` the current device runs at
// once (a CTA takes a whole SM, a cluster's CTAs one GPC), asked once per device and size.
template <typename Kernel>
int resident_param_grad_clusters(Kernel kernel, int parts) {
  // Clusters of each size the device runs at once, per device (0: not asked yet, -1: none).
  static std::array<std::array<int, kMaxParamGradParts + 1>, 64> resident{};
  const int device = c10::cuda::current_device();
  if (device >= static_cast<int>(resident.size()) || parts > kMaxParamGradParts) return 0;
  int& clusters = resident[device][parts];
  if (clusters == 0) {
    const int n = max_active_clusters(kernel, kParamGradThreads, 0, parts);
    clusters = n > 0 ? n : -1;
  }
  return clusters;
}

}  // namespace

// grad_weight, grad_bias, grad_scale, grad_shift (those `mask` asks for) from the per-(n, k, c)
// partials and the (n, g) records of either backward path.
template <typename scalar_t>
void param_grads_pass(const at::Tensor& part_c, int64_t split, const at::Tensor& rec, const at::Tensor& weight,
    const at::Tensor& bias, const Epilogue& ep, const GroupNormShape& sh, const FusedGradMask& mask,
    FusedGrads& g, int parts) {
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  ParamGradArgs<acc_t> pg{};
  pg.part_c = part_c.data_ptr<acc_t>();
  pg.rec = rec.data_ptr<acc_t>();
  pg.dweight = GradRef{mask[1] ? g.weight.data_ptr() : nullptr, g.weight.scalar_type()};
  pg.dbias = GradRef{mask[2] ? g.bias.data_ptr() : nullptr, g.bias.scalar_type()};
  pg.C = sh.C;
  pg.G = sh.G;
  pg.D = sh.D;
  pg.split = split;
  pg.entries = sh.N * split;
  const bool per_sample = ep.scale.defined() || mask[3] || mask[4];
  const int64_t blocks = ceil_div(sh.C, kWarp);
  const auto plain_kernel = finalize_param_grads_kernel<acc_t, false>;
  const auto sample_kernel = finalize_param_grads_kernel<acc_t, true>;
  pg.parts = parts;  // the plan's
  const unsigned grid = static_cast<unsigned>(imin(blocks, grid_for(blocks * pg.parts) / pg.parts) * pg.parts);
  if (per_sample) {
    // With a scale each sample's share is weighted by 1 + scale[n, c], and grad_scale /
    // grad_shift are per (n, c).
    SampleParamGradArgs<acc_t> ps{pg};
    ps.scale = param_ref<scalar_t>(ep.scale);
    ps.weight = param_ref<scalar_t>(weight);
    ps.bias = param_ref<scalar_t>(bias);
    ps.dscale = GradRef{mask[3] ? g.scale.data_ptr() : nullptr, g.scale.scalar_type()};
    ps.dshift = GradRef{mask[4] ? g.shift.data_ptr() : nullptr, g.shift.scalar_type()};
    ps.N = sh.N;
    launch_clustered(sample_kernel, grid, kParamGradThreads, 0, pg.parts, stream, ps);
  } else {
    launch_clustered(plain_kernel, grid, kParamGradThreads, 0, pg.parts, stream, pg);
  }
}

template <typename acc_t>
void finalize_grad_coefs_pass(const at::Tensor& part, int64_t entries, const at::Tensor& mean,
    const at::Tensor& rstd, at::Tensor& rec, const GroupNormShape& sh) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  GradCoefArgs<acc_t> f{};
  f.part = part.data_ptr<acc_t>();
  f.mean = mean.data_ptr<acc_t>();
  f.rstd = rstd.data_ptr<acc_t>();
  f.rec = rec.data_ptr<acc_t>();
  f.items = sh.N * sh.G;
  f.entries = entries;
  f.M = static_cast<acc_t>(sh.D) * static_cast<acc_t>(sh.S);
  f.log_iw = log_item_width(entries);
  finalize_grad_coefs_kernel<acc_t><<<grid_for(ceil_div(f.items, kThreads >> f.log_iw)), kThreads, 0, stream>>>(f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename acc_t>
int param_grad_residency(bool per_sample, int parts) {
  return per_sample ? resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, true>, parts)
                    : resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, false>, parts);
}

#define FUSEDNORM_INSTANTIATE_PARAM_GRADS(T)                                                                    \
  template void param_grads_pass<T>(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,         \
      const at::Tensor&, const Epilogue&, const GroupNormShape&, const FusedGradMask&, FusedGrads&, int)
FUSEDNORM_INSTANTIATE_PARAM_GRADS(float);
FUSEDNORM_INSTANTIATE_PARAM_GRADS(double);
FUSEDNORM_INSTANTIATE_PARAM_GRADS(at::Half);
FUSEDNORM_INSTANTIATE_PARAM_GRADS(at::BFloat16);
#undef FUSEDNORM_INSTANTIATE_PARAM_GRADS

template void finalize_grad_coefs_pass<float>(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
    at::Tensor&, const GroupNormShape&);
template void finalize_grad_coefs_pass<double>(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
    at::Tensor&, const GroupNormShape&);
template int param_grad_residency<float>(bool, int);
template int param_grad_residency<double>(bool, int);

}  // namespace fusednorm
