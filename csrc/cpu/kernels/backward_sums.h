// The per-(n, c) sums of the CPU backward and the coefficients and parameter gradients made from
// them, shared by its paths (backward.cpp, one_element_per_channel.h).
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cpu/kernels/affine_params.h"
#include "cpu/kernels/uninit_vector.h"
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
  UninitVector<double> db, dsc, dev;  // [N][C] each: sum dp, sum dp * (x - m), sum (x - m)
  explicit GradSums(int64_t n) : db(n), dsc(n), dev(n) {}
};

// Per-(n, c) coefficients of dx = a * dp + b * (x - m) + e; also those of the recomputed
// pre-activation p = (x - m) * a + pc + residual.
template <typename acc_t>
struct GradInputCoeffs {
  UninitVector<acc_t> a, b, e, mean, pc;
};

// The sum of f(i) over [begin, end) in four interleaved partial sums, added (s0 + s1) + (s2 + s3):
// a chain of D / 4 dependent double additions a group instead of D, which bounded the per-group
// work of short rows (docs/design.md, 'CPU kernels'). A fixed order: the same bits on any thread.
// The partial sums are named, not an array: the tail's index, known only at run time, kept an
// array in memory, a chain of stores and loads that made the per-group coefficients of
// (64,64,7,7) (D = 2) take twice their time (docs/design.md, "CPU kernels").
template <typename V, typename F>
V sum4(int64_t begin, int64_t end, F f) {
  V s0{}, s1{}, s2{}, s3{};
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    s0 += f(i);
    s1 += f(i + 1);
    s2 += f(i + 2);
    s3 += f(i + 3);
  }
  const int64_t rest = end - i;
  if (rest > 0) s0 += f(i);
  if (rest > 1) s1 += f(i + 1);
  if (rest > 2) s2 += f(i + 2);
  return (s0 + s1) + (s2 + s3);
}

// A group's totals over its channels, taken in one pass: sum (x - m), A = sum w * db and
// sum w * dsc before recentring. (In three passes, one a total, the per-group work of
// (64,64,7,7), D = 2, took twice its time: docs/design.md, "CPU kernels".)
struct GroupTotals {
  double dev = 0.0, a = 0.0, b = 0.0;
  GroupTotals& operator+=(const GroupTotals& o) {
    dev += o.dev;
    a += o.a;
    b += o.b;
    return *this;
  }
  GroupTotals operator+(const GroupTotals& o) const { return GroupTotals(*this) += o; }
};

// The coefficients that do not depend on the sums (a, mean, pc): what the first pass needs to
// recompute p; and `w_eff`, weight * (1 + scale) per (n, c). Elementwise, in parallel: serial,
// these loops were a fixed cost as large as a thread's pass over short rows (docs/design.md,
// 'CPU kernels').
template <typename acc_t>
GradInputCoeffs<acc_t> pre_activation_coeffs(
    const GroupNormShape& sh, const std::vector<acc_t>& w, const std::vector<acc_t>& b,
    const Modulation<acc_t>& mod, const acc_t* mean, const acc_t* rstd, std::vector<acc_t>& w_eff) {
  GradInputCoeffs<acc_t> k;
  for (auto* v : {&k.a, &k.b, &k.e, &k.mean, &k.pc}) v->resize(sh.N * sh.C);
  w_eff.resize(sh.N * sh.C);
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(sh.D, 1));
  const bool plain = mod.gain.empty() && mod.shift.empty();
  at::parallel_for(0, sh.N * sh.G, grain, [&](int64_t begin, int64_t end) {
    if (plain) {  // (locals only: a loop the compiler vectorises)
      acc_t *we = w_eff.data(), *a = k.a.data(), *m = k.mean.data(), *pc = k.pc.data();
      const acc_t *wp = w.data(), *bp = b.data();
      for (int64_t ng = begin, g = begin % sh.G; ng < end; ++ng, g = g + 1 == sh.G ? 0 : g + 1) {
        const int64_t c0 = g * sh.D, o = ng * sh.D;
        const acc_t r = rstd[ng], mu = mean[ng];
        for (int64_t d = 0; d < sh.D; ++d) {
          we[o + d] = wp[c0 + d];
          a[o + d] = wp[c0 + d] * r;
          m[o + d] = mu;
          pc[o + d] = bp[c0 + d] * acc_t(1) + acc_t(0);  // b * gain + shift as below (-0 -> +0)
        }
      }
      return;
    }
    for (int64_t ng = begin; ng < end; ++ng) {
      const int64_t n = ng / sh.G;
      for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) {
        const int64_t c = nc - n * sh.C;
        w_eff[nc] = w[c] * mod.gain_at(nc);
        k.a[nc] = w_eff[nc] * rstd[ng];
        k.mean[nc] = mean[ng];
        k.pc[nc] = b[c] * mod.gain_at(nc) + mod.shift_at(nc);
      }
    }
  });
  return k;
}

// Finishes group ng = (n, g) once its sums are taken: recentres them on its true mean (dsc -=
// delta * db, delta = sum (x - m) / M) and, given `k`, fills b and e of its coefficients, with
// B = sum w * (dsc - delta * db) = sum w * dsc - delta * A.
template <typename acc_t>
void finish_group(const GroupNormShape& sh, int64_t ng, const std::vector<acc_t>& w_eff, const acc_t* rstd,
    GradSums& sums, GradInputCoeffs<acc_t>* k) {
  const double M = static_cast<double>(sh.D * sh.S);
  if (M == 0) return;
  const acc_t* w = w_eff.data();
  double* const dsc = sums.dsc.data();
  const double *db = sums.db.data(), *dev = sums.dev.data();
  const int64_t c0 = ng * sh.D, c1 = c0 + sh.D;
  const GroupTotals t = sum4<GroupTotals>(c0, c1, [=](int64_t nc) {
    const double wc = w[nc];
    return GroupTotals{dev[nc], wc * db[nc], wc * dsc[nc]};
  });
  const double delta = t.dev / M;
  for (int64_t nc = c0; nc < c1; ++nc) dsc[nc] -= delta * db[nc];
  if (k == nullptr) return;
  const double r = rstd[ng];
  const double b = -r * r * r / M * (t.b - delta * t.a);
  const acc_t kb = static_cast<acc_t>(b), ke = static_cast<acc_t>(-r / M * t.a - b * delta);
  for (int64_t nc = c0; nc < c1; ++nc) {
    k->b[nc] = kb;
    k->e[nc] = ke;
  }
}

// finish_group for every group.
template <typename acc_t>
void finish_groups(const GroupNormShape& sh, const std::vector<acc_t>& w_eff, const acc_t* rstd, GradSums& sums,
    GradInputCoeffs<acc_t>* k) {
  for (int64_t ng = 0; ng < sh.N * sh.G; ++ng) finish_group(sh, ng, w_eff, rstd, sums, k);
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
  // Channel by channel, each summed over n in order: any split over threads gives the same bits
  // (serial, this was a fixed ~10 cycles a row; docs/design.md, 'CPU kernels'). Without
  // modulation, blocks of kParamBlock channels go down the batch together (gain = 1: the same
  // sums), so the additions of different channels overlap instead of one chain of N a channel.
  constexpr int64_t kParamBlock = 64;
  const bool plain = mod.gain.empty() && dscale.empty() && dshift.empty();
  at::parallel_for(0, sh.C, std::max<int64_t>(1, 2048 / std::max<int64_t>(sh.N, 1)), [&](int64_t c0, int64_t c1) {
    if (plain) {
      const double *dsc = sums.dsc.data(), *db = sums.db.data();
      for (int64_t cb = c0; cb < c1; cb += kParamBlock) {
        const int64_t len = std::min(kParamBlock, c1 - cb);
        double dwc[kParamBlock] = {}, dbc[kParamBlock] = {}, r[kParamBlock];
        int64_t group[kParamBlock];  // each channel's group, once a block (not a division an (n, c))
        for (int64_t j = 0; j < len; ++j) group[j] = (cb + j) / sh.D;
        for (int64_t n = 0; n < sh.N; ++n) {
          const acc_t* rstd_n = rstd + n * sh.G;
          for (int64_t j = 0; j < len; ++j) r[j] = static_cast<double>(rstd_n[group[j]]);
          const double *dscn = dsc + n * sh.C + cb, *dbn = db + n * sh.C + cb;
          for (int64_t j = 0; j < len; ++j) {
            dwc[j] += dscn[j] * r[j];
            dbc[j] += dbn[j];
          }
        }
        for (int64_t j = 0; j < len; ++j) {
          dw[cb + j] = dwc[j];
          dbias[cb + j] = dbc[j];
        }
      }
      return;
    }
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g = c / sh.D;
      double dwc = 0.0, dbc = 0.0;
      for (int64_t n = 0; n < sh.N; ++n) {
        const int64_t nc = n * sh.C + c;
        const double xhat_sum = sums.dsc[nc] * static_cast<double>(rstd[n * sh.G + g]);
        const double gain = mod.gain_at(nc);
        dwc += gain * xhat_sum;
        dbc += gain * sums.db[nc];
        if (!dscale.empty()) dscale[nc] = w[c] * xhat_sum + b[c] * sums.db[nc];
        if (!dshift.empty()) dshift[nc] = sums.db[nc];
      }
      dw[c] = dwc;
      dbias[c] = dbc;
    }
  });
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  // Written in place where the output is a contiguous CPU tensor: copy_ from a from_blob
  // tensor cost ~10 us a call, a fixed cost larger than a short-row pass (docs/design.md,
  // 'CPU kernels'). Both convert each double with static_cast.
  auto fill = [&](at::Tensor& out, std::vector<double>& v) {
    if (out.numel() == 0) return;
    if (out.is_cpu() && out.is_contiguous()) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "param_grads_fill", [&] {
        scalar_t* o = out.data_ptr<scalar_t>();
        for (size_t i = 0; i < v.size(); ++i) o[i] = static_cast<scalar_t>(v[i]);
      });
      return;
    }
    out.copy_(at::from_blob(v.data(), out.sizes(), f64));
  };
  fill(grads.weight, dw);
  fill(grads.bias, dbias);
  fill(grads.scale, dscale);
  fill(grads.shift, dshift);
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
