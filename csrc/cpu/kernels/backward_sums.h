// The per-(n, c) sums of the CPU backward and the coefficients and parameter gradients made from
// them, shared by its paths (backward.cpp, one_element_per_channel.h).
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cpu/kernels/affine_params.h"
#include "cpu/kernels/vec_io.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// The plain group-norm backward runs on dp, the gradient at the epilogue's pre-activation
// (epilogue.h; dp = dy without an elementwise epilogue), with the per-(n, c) weight
// w = weight * (1 + scale). Per (n, c): db = sum_s dp and dsc = sum_s dp * (x - mean). With
// M = D * S and per group A = sum_c w * db, B = sum_c w * dsc:
//   dx = w * rstd * dp - rstd^3 / M * B * (x - mean) - rstd / M * A
//   grad_weight[c] = sum_n (1 + scale) * dsc * rstd,  grad_bias[c] = sum_n (1 + scale) * db,
//   grad_scale = weight * rstd * dsc + bias * db,      grad_shift = db.
//
// The saved mean m is the true mean rounded to float32, off by up to half an ulp of |mean| (5e-4 at
// 1e4), which would shift dsc by that much times db. The first pass also sums x - m, whose group
// average is exactly that rounding error delta; dsc and dx are then centred on m + delta.
//
// With an elementwise epilogue, dp is computed block by block into a small buffer (it stays in
// cache) from dy, x and the epilogue's operands, in each of the two passes.

struct GradSums {
  std::vector<double> db, dsc, dev;  // [N][C] each: sum dp, sum dp * (x - m), sum (x - m)
  explicit GradSums(int64_t n) : db(n), dsc(n), dev(n) {}
};

// Per-(n, c) coefficients of dx = a * dp + b * (x - m) + e; also those of the recomputed
// pre-activation p = (x - m) * a + pc + residual.
template <typename acc_t>
struct GradInputCoeffs {
  std::vector<acc_t> a, b, e, mean, pc;
};

// Recentres the sums of group ng on its true mean; returns its delta.
inline double recentre_group(const GroupNormShape& sh, int64_t ng, GradSums& sums) {
  const double M = static_cast<double>(sh.D * sh.S);
  if (M == 0) return 0.0;
  double delta = 0.0;
  for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) delta += sums.dev[nc];
  delta /= M;
  for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) sums.dsc[nc] -= delta * sums.db[nc];
  return delta;
}

// Recentres the sums on the true mean; returns delta per (n, g). (Channel nc = ng * D + d belongs
// to group ng: no division per channel, which dominated when S == 1 and N * C is large.)
inline std::vector<double> recentre(const GroupNormShape& sh, GradSums& sums) {
  std::vector<double> delta(sh.N * sh.G, 0.0);
  for (int64_t ng = 0; ng < sh.N * sh.G; ++ng) delta[ng] = recentre_group(sh, ng, sums);
  return delta;
}

// The coefficients that do not depend on the sums (a, mean, pc): what the first pass needs to
// recompute p. `w_eff` is weight * (1 + scale) per (n, c).
template <typename acc_t>
GradInputCoeffs<acc_t> pre_activation_coeffs(
    const GroupNormShape& sh, const std::vector<acc_t>& w_eff, const std::vector<acc_t>& b,
    const Modulation<acc_t>& mod, const acc_t* mean, const acc_t* rstd) {
  GradInputCoeffs<acc_t> k;
  for (auto* v : {&k.a, &k.b, &k.e, &k.mean, &k.pc}) v->assign(sh.N * sh.C, acc_t(0));
  for (int64_t ng = 0; ng < sh.N * sh.G; ++ng) {
    for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) {
      k.a[nc] = w_eff[nc] * rstd[ng];
      k.mean[nc] = mean[ng];
    }
  }
  for (int64_t n = 0; n < sh.N; ++n) {
    for (int64_t c = 0; c < sh.C; ++c) {
      const int64_t nc = n * sh.C + c;
      k.pc[nc] = b[c] * mod.gain_at(nc) + mod.shift_at(nc);
    }
  }
  return k;
}

// Fills b and e of `k` for group ng = (n, g) from its recentred sums.
template <typename acc_t>
void grad_input_coeffs_group(const GroupNormShape& sh, int64_t ng, const std::vector<acc_t>& w_eff,
    const acc_t* rstd, const GradSums& sums, double delta, GradInputCoeffs<acc_t>& k) {
  const double M = static_cast<double>(sh.D * sh.S);
  if (M == 0) return;
  double A = 0, B = 0;
  for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) {
    A += w_eff[nc] * sums.db[nc];
    B += w_eff[nc] * sums.dsc[nc];
  }
  const double r = rstd[ng];
  const double b = -r * r * r / M * B;
  for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) {
    k.b[nc] = static_cast<acc_t>(b);
    k.e[nc] = static_cast<acc_t>(-r / M * A - b * delta);
  }
}

// Fills b and e of `k` from the recentred sums.
template <typename acc_t>
void grad_input_coeffs(
    const GroupNormShape& sh, const std::vector<acc_t>& w_eff, const acc_t* rstd,
    const GradSums& sums, const std::vector<double>& delta, GradInputCoeffs<acc_t>& k) {
  for (int64_t ng = 0; ng < sh.N * sh.G; ++ng) grad_input_coeffs_group(sh, ng, w_eff, rstd, sums, delta[ng], k);
}

// Accumulates dp, dp * (x - m) and x - m.
template <typename Vec>
void accumulate_grad_sums(std::array<Vec, 3>& acc, const Vec& dp, const Vec& centred) {
  acc[0] += dp;
  acc[1] = at::vec::fmadd(dp, centred, acc[1]);
  acc[2] += centred;
}

// Parameter and modulation gradients from the recentred per-(n, c) sums, summed over the batch
// in a fixed order, in double.
template <typename acc_t>
void param_grads(const GroupNormShape& sh, const GradSums& sums, const acc_t* rstd,
    const std::vector<acc_t>& w, const std::vector<acc_t>& b, const Modulation<acc_t>& mod,
    FusedGrads& grads) {
  std::vector<double> dw(sh.C, 0.0), dbias(sh.C, 0.0);
  std::vector<double> dscale(grads.scale.numel() > 0 ? sh.N * sh.C : 0);
  std::vector<double> dshift(grads.shift.numel() > 0 ? sh.N * sh.C : 0);
  for (int64_t n = 0; n < sh.N; ++n) {
    for (int64_t c = 0, g = 0, d = 0; c < sh.C; ++c) {  // channel c = g * D + d
      const int64_t nc = n * sh.C + c;
      const double xhat_sum = sums.dsc[nc] * static_cast<double>(rstd[n * sh.G + g]);
      if (++d == sh.D) {
        d = 0;
        ++g;
      }
      const double gain = mod.gain_at(nc);
      dw[c] += gain * xhat_sum;
      dbias[c] += gain * sums.db[nc];
      if (!dscale.empty()) dscale[nc] = w[c] * xhat_sum + b[c] * sums.db[nc];
      if (!dshift.empty()) dshift[nc] = sums.db[nc];
    }
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  auto fill = [&](at::Tensor& out, std::vector<double>& v) {
    if (out.numel() > 0) out.copy_(at::from_blob(v.data(), out.sizes(), f64));
  };
  fill(grads.weight, dw);
  fill(grads.bias, dbias);
  fill(grads.scale, dscale);
  fill(grads.shift, dshift);
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
