// The epilogue's activations and their derivatives on at::vec vectors, with a hand-written exp
// for AVX2 / AVX-512 float vectors. Compiled once per CPU capability.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <utility>

#include "epilogue.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// Epilogue (epilogue.h) on vectors of opmath values: the same formulas as the scalar versions,
// with Sleef's vector exp / erf / tanh / log1p. The activation is a template argument: the
// per-element loops are instantiated once per activation and chosen once per run of elements
// (a run-time switch per vector kept them from inlining and cost as much as a memory pass).

template <Activation A>
using ActivationTag = std::integral_constant<Activation, A>;

// Calls f(ActivationTag<a>{}).
template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::SiLU: return f(ActivationTag<Activation::SiLU>{});
    case Activation::GELU: return f(ActivationTag<Activation::GELU>{});
    case Activation::GELUTanh: return f(ActivationTag<Activation::GELUTanh>{});
    case Activation::ReLU: return f(ActivationTag<Activation::ReLU>{});
    case Activation::LeakyReLU: return f(ActivationTag<Activation::LeakyReLU>{});
    case Activation::Mish: return f(ActivationTag<Activation::Mish>{});
    default: return f(ActivationTag<Activation::None>{});
  }
}

// exp for SiLU's sigmoid: ATen's faster float exp (max error 20 ulp, ~1e-6 relative, as ATen's own
// SiLU kernel uses) where this torch has it, else the 1-ulp Sleef exp. Double keeps the exact one.
template <typename Vec>
auto fast_float_exp(const Vec& v, int) -> decltype(v.exp_u20()) {
  if constexpr (std::is_same_v<typename Vec::value_type, float>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}
template <typename Vec>
Vec fast_float_exp(const Vec& v, long) {
  return v.exp();
}

template <typename Vec>
Vec vec_sigmoid(const Vec& p) {
  return Vec(1) / (Vec(1) + fast_float_exp(p.neg(), 0));
}

// exp(x) for x <= 0, inline: Cephes' expf (x = n ln2 + r with ln2 in two parts, a degree-7
// polynomial in r) scaled by 2^n; 0 where the result would be subnormal, NaN kept. Within 1.01 ulp
// over [-87.3, 0] (Sleef's: 0.98). ATen's float exp and erf call Sleef's out of line, and the call
// clobbers the vector registers: inline, the GELU forward took 19-26% less time (docs/design.md,
// 'CPU kernels'). Other vector types and capabilities: Vec::exp().
template <typename Vec>
Vec exp_nonpositive(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<Vec, at::vec::Vectorized<float>>) {
    const Vec lowest(-87.3365478515625f);  // float(ln FLT_MIN): below, exp rounds to 0 or a subnormal
    const Vec n = at::vec::fmadd(x, Vec(1.44269504088896341f), Vec(0.5f)).floor();
    Vec r = at::vec::fmadd(n, Vec(-0.693359375f), x);  // exact: 0.693359375 has 9 bits
    r = at::vec::fmadd(n, Vec(2.12194440e-4f), r);
    Vec y = at::vec::fmadd(Vec(1.9875691500e-4f), r, Vec(1.3981999507e-3f));
    y = at::vec::fmadd(y, r, Vec(8.3334519073e-3f));
    y = at::vec::fmadd(y, r, Vec(4.1665795894e-2f));
    y = at::vec::fmadd(y, r, Vec(1.6666665459e-1f));
    y = at::vec::fmadd(y, r, Vec(5.0000001201e-1f));
    y = at::vec::fmadd(y, r * r, r) + Vec(1);
#if defined(CPU_CAPABILITY_AVX512)
    const Vec scaled = _mm512_scalef_ps(y, n);
#else
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const Vec scaled = y * Vec(_mm256_castsi256_ps(bits));
#endif
    return Vec::blendv(scaled, Vec(0), x < lowest);
  }
#endif
  return x.exp();
}

// erf(x), and the Gaussian exp(-x^2) it is made from into `gaussian` (GELU's derivative takes it
// again for its density): ATen's float vector erf, Abramowitz and Stegun 7.1.26 (max error
// 1.5e-7), operation for operation but with the exp inline.
template <typename Vec>
Vec erf_and_gaussian(const Vec& x, Vec& gaussian) {
  const Vec t = Vec(1) / at::vec::fmadd(Vec(0.3275911f), x.abs(), Vec(1));
  Vec r = at::vec::fmadd(Vec(1.061405429f), t, Vec(-1.453152027f));
  r = at::vec::fmadd(r, t, Vec(1.421413741f));
  r = at::vec::fmadd(r, t, Vec(-0.284496736f));
  r = at::vec::fmadd(r, t, Vec(0.254829592f));
  gaussian = exp_nonpositive((x * x).neg());
  const Vec magnitude = at::vec::fmadd(gaussian.neg() * t, r, Vec(1));  // 1 - r t exp(-x^2)
  return magnitude ^ (x & Vec(-0.f));  // x's sign
}

template <Activation A, typename Vec>
Vec vec_activation(const Vec& p, typename Vec::value_type slope) {
  if constexpr (A == Activation::SiLU) {
    return p / (Vec(1) + fast_float_exp(p.neg(), 0));
  } else if constexpr (A == Activation::GELU) {
    if constexpr (std::is_same_v<typename Vec::value_type, float>) {
      Vec gaussian;
      return Vec(0.5) * p * (Vec(1) + erf_and_gaussian(p * Vec(0.70710678118654752440), gaussian));
    } else {
      return Vec(0.5) * p * (Vec(1) + (p * Vec(0.70710678118654752440)).erf());
    }
  } else if constexpr (A == Activation::GELUTanh) {
    const Vec inner = Vec(0.79788456080286535588) * (p + Vec(0.044715) * p * p * p);
    return Vec(0.5) * p * (Vec(1) + inner.tanh());
  } else if constexpr (A == Activation::ReLU) {
    return at::vec::clamp_min(p, Vec(0));  // NaN stays NaN
  } else if constexpr (A == Activation::LeakyReLU) {
    return Vec::blendv(p * Vec(slope), p, p > Vec(0));
  } else if constexpr (A == Activation::Mish) {
    return p * p.exp().log1p().tanh();
  } else {
    return p;
  }
}

template <Activation A, typename Vec>
Vec vec_activation_derivative(const Vec& p, typename Vec::value_type slope) {
  if constexpr (A == Activation::SiLU) {
    const Vec s = vec_sigmoid(p);
    return s * (Vec(1) + p * (Vec(1) - s));
  } else if constexpr (A == Activation::GELU) {
    if constexpr (std::is_same_v<typename Vec::value_type, float>) {
      // One exp for both (the density's exp(-p^2 / 2) is erf's exp(-x^2) at x = p / sqrt2).
      Vec gaussian;
      const Vec cdf = Vec(0.5) * (Vec(1) + erf_and_gaussian(p * Vec(0.70710678118654752440), gaussian));
      return cdf + p * (gaussian * Vec(0.39894228040143267794));
    } else {
      const Vec cdf = Vec(0.5) * (Vec(1) + (p * Vec(0.70710678118654752440)).erf());
      const Vec pdf = (Vec(-0.5) * p * p).exp() * Vec(0.39894228040143267794);
      return cdf + p * pdf;
    }
  } else if constexpr (A == Activation::GELUTanh) {
    const Vec beta(0.79788456080286535588), kappa(0.044715);
    const Vec t = (beta * (p + kappa * p * p * p)).tanh();
    const Vec inner_derivative = beta * (Vec(1) + Vec(3) * kappa * p * p);
    return Vec(0.5) * (Vec(1) + t) + Vec(0.5) * p * (Vec(1) - t * t) * inner_derivative;
  } else if constexpr (A == Activation::ReLU) {
    return Vec::blendv(Vec(1), Vec(0), p <= Vec(0));  // 1 at NaN, as eager's threshold_backward
  } else if constexpr (A == Activation::LeakyReLU) {
    return Vec::blendv(Vec(slope), Vec(1), p > Vec(0));
  } else if constexpr (A == Activation::Mish) {
    const Vec tsp = p.exp().log1p().tanh();
    return tsp + p * vec_sigmoid(p) * (Vec(1) - tsp * tsp);
  } else {
    return Vec(1);
  }
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
