// The fused epilogue (epilogue.h) on the device: its operands as the kernels take them, the
// per-(n, c) modulation, the activations and their derivatives (docs/design.md, "Activations").
#pragma once

#include "cuda/common/base.cuh"
#include "epilogue.h"

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

// ---------------------------------------------------------------------------------------------
// The fused epilogue (epilogue.h), as the EPI instantiations take it. Absent operands are null
// pointers, tested per launch (uniform branches), so that presence does not multiply the
// instantiations; the residual is also null where p is not needed.

// The prologue input_bias (group_norm.h, make_input_bias; docs/design.md, "Input bias"), in the
// input's dtype: (C,) (sample_stride 0) or (N, C) (sample_stride C); null: absent. Only the
// channels-last sweep and one-pass forwards and the team forward read it (the other paths are
// given input + input_bias).
template <typename scalar_t>
struct InputBiasRef {
  const scalar_t* ptr;
  int64_t sample_stride;

  // input_bias at (n, c), 0 where absent.
  template <typename acc_t>
  __device__ __forceinline__ acc_t at(int64_t n, int64_t c) const {
    return ptr == nullptr ? acc_t(0) : static_cast<acc_t>(ptr[n * sample_stride + c]);
  }
};

template <typename scalar_t>
struct EpiArgs {
  using acc_t = acc_type<scalar_t>;
  ParamRef scale;              // (N, C) contiguous in any floating dtype, index n * C + c; null: absent
  ParamRef shift;              // (N, C)
  const scalar_t* residual;    // x's shape and layout
  const scalar_t* multiplier;  // x's shape and layout
  scalar_t* grad_residual;     // backward apply: outputs in x's layout, null if not requested
  scalar_t* grad_multiplier;
  Activation act;
  acc_t slope;                 // leaky_relu's negative slope
  // Backward reduce: the saved rstd (N, G) and the bias, which p is recomputed from (the apply
  // pass has them already).
  const acc_t* rstd;
  ParamRef bias;
  InputBiasRef<scalar_t> input_bias;  // forward only
};

// The argument struct of an EPI kernel: the plain kernel's, then the epilogue. The plain
// instantiations keep exactly their own struct: its size alone changes the code nvcc emits.
template <typename Args, typename scalar_t>
struct WithEpi : Args {
  EpiArgs<scalar_t> epi;
};

template <typename Args, typename scalar_t, bool EPI>
using KernelArgs = std::conditional_t<EPI, WithEpi<Args, scalar_t>, Args>;

// Packs per operand stream in flight per thread in the EPI kernels where kUnroll would not fit:
// they carry up to four streams (x, dz, residual, multiplier) and the activation's temporaries.
// Chosen from ptxas's report (no spills under the kernels' register caps): the apply kernels and
// reduce_rows with 8-wide packs take kEpiUnroll; the ChannelsLast kernels, which keep per-lane
// state, take epi_unroll_lanes (one 8-wide pack).
constexpr int kEpiUnroll = 2;
template <int V>
constexpr int epi_unroll_lanes() {
  return V >= 8 ? 1 : kEpiUnroll;
}

// The per-(n, c) affine map of the normalization with the modulation folded in:
// u * (1 + scale) + shift = xhat * w_eff + b_eff.
template <typename acc_t>
struct Affine {
  acc_t w, b;
};

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ Affine<acc_t> modulate(const EpiArgs<scalar_t>& e, int64_t nc, acc_t w, acc_t b) {
  Affine<acc_t> m{w, b};
  if (e.scale.ptr != nullptr) {
    const acc_t gain = acc_t(1) + load_param(e.scale, nc, acc_t(0));
    m.w = w * gain;
    // A zero bias adds nothing to u = xhat * w + bias, so it must not meet an infinite gain:
    // 0 * inf would make the whole channel NaN where eager's u * (1 + scale) is +-inf
    // (docs/deviations.md, "Non-finite epilogue operands"). For a finite gain b * gain is 0 too.
    m.b = b == acc_t(0) ? b : b * gain;
  }
  m.b += load_param(e.shift, nc, acc_t(0));
  return m;
}

// The activation of an EPI element loop as a template argument A: an Activation fixed at compile
// time (the switch of activation_forward / activation_derivative folds away, so the loop is
// straight-line code whose elements the scheduler can interleave, holding only that activation's
// temporaries), or kAnyAct: the run-time switch per element.
constexpr int kAnyAct = -1;

template <Activation A>
using ActConst = std::integral_constant<int, static_cast<int>(A)>;

template <int A>
__device__ __forceinline__ Activation act_of(Activation runtime) {
  return A == kAnyAct ? runtime : static_cast<Activation>(A);
}

// Calls f(std::integral_constant<int, A>{}) with `act` as a compile-time A: one uniform branch per
// row or tile instead of a switch per element. Each activation listed here is one more copy of
// the caller's element loop in every EPI kernel, and a kernel's register count is that of its
// largest copy: the cheap and common ones only (GELU's and GELUTanh's loops, each near the
// register cap alone, spilled together); the others share the kAnyAct loop.
template <typename F>
__device__ __forceinline__ void with_activation(Activation act, const F& f) {
  switch (act) {
    case Activation::None:
      f(ActConst<Activation::None>{});
      break;
    case Activation::SiLU:
      f(ActConst<Activation::SiLU>{});
      break;
    case Activation::ReLU:
      f(ActConst<Activation::ReLU>{});
      break;
    default:
      f(std::integral_constant<int, kAnyAct>{});
  }
}

// 2^x by one MUFU.EX2 (2^-22 relative error), results below 2^-126 flushed to 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x));
  return e;
}

// e^-p as __expf(-p) takes it (p times -log2(e), then MUFU.EX2), in the flush-to-zero form of
// the ex2: __expf's handling of results below 2^-126 (a compare and two predicated multiplies an
// element, 3 of SiLU's 8 instructions) only changes e^-p where p > 87, and there 1 + e^-p rounds
// to 1 either way: SiLU and its derivative keep their bits (88 cases of every path compared
// bitwise on an H200; docs/design.md, "Activations").
__device__ __forceinline__ float exp_neg_ftz(float p) { return exp2_ftz(p * -1.44269504088896341f); }

// Phi(p) = (1 + erf(p / sqrt2)) / 2, GELU's factor, without erff: Phi(-|p|) = erfc(t) / 2 = 2^s(t),
// t = |p| / sqrt2, s a degree-10 polynomial (one MUFU.EX2), and Phi(|p|) = 1 - Phi(-|p|). erff
// evaluates two polynomials and an exponential and selects: GELU added 26 instructions an
// element to the forward, this about 18: the VAE fp16 GELU forward went from 1.53x to 1.35x the
// plain one, the backward from 1.60x to 1.38x (docs/design.md, "Activations").
// The coefficients and the tail are scripts/fit_gelu_cdf.py's, which reports the error: at most
// ~1e-7 absolute (eager's float (1 + erf) / 2 has ~7e-8 with erf rounded once, erff is documented
// to 2 ulp), plus MUFU.EX2's 2^-22 relative; relative 6e-6 in the tail for p < 0, where eager's
// 1 + erf keeps a few bits or none. Past kGeluTail, where float's 1 + erf(-t) is 0 (erfc(t) <
// 2^-25), Phi(-|p|) is 0 as eager's: GELU(-inf) = -inf * 0 = NaN as eager's; NaN stays NaN.
constexpr float kGeluTail = 3.9192059f;

__device__ __forceinline__ float gelu_cdf(float p) {
  const float t = fabsf(p) * 0.70710678118654752440f;
  const float tc = fminf(t, kGeluTail);  // NaN -> kGeluTail, then discarded below
  float s = -7.736570069e-07f;
  s = fmaf(s, tc, 1.668550613e-05f);
  s = fmaf(s, tc, -1.544922416e-04f);
  s = fmaf(s, tc, 7.790157106e-04f);
  s = fmaf(s, tc, -2.032450400e-03f);
  s = fmaf(s, tc, -2.876257349e-04f);
  s = fmaf(s, tc, 2.801883034e-02f);
  s = fmaf(s, tc, -1.484254450e-01f);
  s = fmaf(s, tc, -9.184220433e-01f);
  s = fmaf(s, tc, -1.627908349e+00f);
  s = fmaf(s, tc, -1.0f);
  const float lower = t < kGeluTail ? exp2_ftz(s) : 0.0f;  // Phi(-|p|)
  return p >= 0.0f ? 1.0f - lower : lower;
}

// activation_forward / activation_derivative on the device. SiLU in float takes __expf's e^-p
// (exp_neg_ftz: MUFU.EX2) and the approximate division (MUFU.RCP) instead of expf and an IEEE
// division: those cost ~25 instructions per element, in passes that should run at memory speed.
// The error is a few ulp near 0, growing with |p| as __expf's (relative ~1e-5 near p = -80,
// where silu is ~1e-33): far below half / bf16 rounding. The extremes are those of epilogue.h's
// formulas: for p < -88.7, 1 + exp(-p) = inf and the division is p * 0, -0 for finite p and NaN
// for p = -inf (as torch's -inf / inf); p = +inf gives inf (silu) and 1 (silu'); NaN gives NaN.
// (The approximate division also returns 0 for divisors in (2^126, 2^128), where the exact
// quotient is below 1e-36.) GELU in float takes gelu_cdf instead of erff, and its derivative's
// density e^(-p^2 / 2) the ex2 (0 for |p| > 13, where p times it is below 1e-36; p = +-inf gives
// inf * 0 = NaN, as epilogue.h's formula). double keeps the exact formulas.
template <typename T>
__device__ __forceinline__ T device_activation_forward(Activation a, T p, T slope) {
  if constexpr (std::is_same_v<T, float>) {
    if (a == Activation::SiLU) return __fdividef(p, 1.0f + exp_neg_ftz(p));
    if (a == Activation::GELU) return p * gelu_cdf(p);
  }
  return activation_forward(a, p, slope);
}

template <typename T>
__device__ __forceinline__ T device_activation_derivative(Activation a, T p, T slope) {
  if constexpr (std::is_same_v<T, float>) {
    if (a == Activation::SiLU) {
      const float s = __fdividef(1.0f, 1.0f + exp_neg_ftz(p));
      return s * (1.0f + p * (1.0f - s));
    }
    if (a == Activation::GELU) {
      // e^(-p^2 / 2) / sqrt(2 pi), the exponent in base 2.
      const float pdf = exp2_ftz(p * p * -0.72134752044448170368f) * 0.39894228040143267794f;
      return gelu_cdf(p) + p * pdf;
    }
  }
  return activation_derivative(a, p, slope);
}

// dp from dzm = dz * multiplier. The reduce and apply passes both call this, on the same p, so
// that the sums behind the dx coefficients are sums of the dp that dx is made of.
template <int A, typename acc_t>
__device__ __forceinline__ acc_t grad_at_p(Activation runtime_act, acc_t slope, acc_t dzm, acc_t p) {
  const Activation act = act_of<A>(runtime_act);
  // ReLU's gradient is a select, as eager's threshold_backward: 0 where p <= 0 whatever dzm is
  // (a NaN or inf multiplier there would otherwise reach the group sums as NaN).
  if (act == Activation::ReLU) return p <= acc_t(0) ? acc_t(0) : dzm;
  return act == Activation::None ? dzm : dzm * device_activation_derivative(act, p, slope);
}

// dp = dz * multiplier * act'(p) at one element, p = ea * (x - m) + pc + residual made only where
// an activation or q needs it (xc = x - m); q = act(p) when want_q, for grad_multiplier = dz * q.
// Every backward takes dp from here (the split passes' dz_to_dp and apply_epi_pack, the one-CTA
// and team backwards' element_dp), so each pass's sums are sums of the dp its dx is made of.
template <int A, typename acc_t>
__device__ __forceinline__ acc_t epi_dp(Activation runtime_act, acc_t slope, acc_t xc, acc_t dz, acc_t r, acc_t m,
    acc_t ea, acc_t pc, bool want_q, acc_t& q) {
  const Activation act = act_of<A>(runtime_act);
  acc_t g = dz * m;
  if (act != Activation::None || want_q) {
    const acc_t p = (ea * xc + pc) + r;
    g = grad_at_p<A>(act, slope, g, p);
    if (want_q) q = device_activation_forward(act, p, slope);
  }
  return g;
}

// grad_residual = dp and grad_multiplier = dz * q at one element, before their rounding; their
// sum into gr when the two are one buffer (one tensor was both operands).
template <typename acc_t>
__device__ __forceinline__ void operand_grads_at(bool sum, acc_t dp, acc_t dz, acc_t q, acc_t& gr, acc_t& gm) {
  gr = sum ? dp + dz * q : dp;
  gm = dz * q;
}

template <typename T>
__device__ __forceinline__ T* offset_or_null(T* p, int64_t off) {
  return p == nullptr ? p : p + off;
}

// An elementwise operand at the packs of a batch (as load_packs), or `absent` where `base` is null.
template <int U, int V, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_operand(
    const scalar_t* base, int64_t first, int64_t step, int nvalid, acc_t absent, acc_t (&out)[U][V]) {
  if (base != nullptr) {
    load_packs<U, V>(base, first, step, nvalid, out);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) out[u][j] = absent;
    }
  }
}

// Backward reduce: a batch of dz (loaded as x was, from `first` by `step`) becomes dp in place.
// residual and multiplier point where x's batch base does (null: absent; the host passes the
// residual only with an activation, the one case where p is needed here). Lane l recomputes the
// forward's p = ea[l] * (x - center[l]) + pc[l] + residual, with ea = rstd * w_eff and pc the
// folded bias (both per (n, c)) and center the saved mean. A: see kAnyAct.
template <int U, int V, int L, int A = kAnyAct, typename scalar_t, typename acc_t>
__device__ __forceinline__ void dz_to_dp(const EpiArgs<scalar_t>& e, const scalar_t* residual,
    const scalar_t* multiplier, int64_t first, int64_t step, int nvalid, const acc_t (&x)[U][V],
    const acc_t (&center)[L], const acc_t (&ea)[L], const acc_t (&pc)[L], acc_t (&d)[U][V]) {
  if (multiplier == nullptr && act_of<A>(e.act) == Activation::None) return;  // dp = dz (scale only)
  acc_t m[U][V];
  acc_t r[U][V];
  load_operand<U, V>(multiplier, first, step, nvalid, acc_t(1), m);
  load_operand<U, V>(residual, first, step, nvalid, acc_t(0), r);
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int l = L == 1 ? 0 : j;
      acc_t q;  // unused: no grad_multiplier here
      d[u][j] = epi_dp<A>(e.act, e.slope, x[u][j] - center[l], d[u][j], r[u][j], m[u][j], ea[l], pc[l], false, q);
    }
  }
}

}  // namespace
}  // namespace fusednorm
