// The elementwise epilogue fused after a normalization, shared by the CPU and CUDA kernels.
//
// With u = normalize(x) * weight + bias (the plain group norm), the fused ops compute
//   v = u * (1 + scale[n, c]) + shift[n, c]      per-(sample, channel) modulation (AdaGN)
//   p = v + residual                             elementwise
//   q = act(p)
//   z = q * multiplier                           elementwise
// Any operand may be absent (scale 0, shift 0, residual 0, act = identity, multiplier 1).
//
// scale and shift fold into the per-(n, c) affine coefficients of the normalization, so the
// kernels see them only there. Backward, with dz given:
//   dp = dz * multiplier * act'(p)    (p recomputed from x and the saved statistics)
//   grad_residual = dp,  grad_multiplier = dz * q,
//   grad_shift[n, c] = sum_s dp,  grad_scale[n, c] = sum_s dp * u,
// and dp * (1 + scale) is the gradient at u: the plain group-norm backward runs on dp with the
// per-(n, c) weight w * (1 + scale).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDNORM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDNORM_HOST_DEVICE inline
#endif

namespace fusednorm {

// The activation names the ops accept are those of activation_name(); "none" is the identity.
enum class Activation : int64_t {
  None = 0,
  SiLU,
  GELU,       // exact, erf based (F.gelu)
  GELUTanh,   // F.gelu(approximate="tanh")
  ReLU,
  LeakyReLU,  // uses negative_slope
  Mish,
};

constexpr int kNumActivations = 7;

constexpr const char* activation_name(Activation a) {
  return a == Activation::None        ? "none"
         : a == Activation::SiLU      ? "silu"
         : a == Activation::GELU      ? "gelu"
         : a == Activation::GELUTanh  ? "gelu_tanh"
         : a == Activation::ReLU      ? "relu"
         : a == Activation::LeakyReLU ? "leaky_relu"
                                      : "mish";
}

// act(p), in the precision T the kernels compute in (float, or double for double inputs).
// Written as PyTorch writes each activation, so that results agree to rounding.
template <typename T>
FUSEDNORM_HOST_DEVICE T activation_forward(Activation a, T p, T negative_slope) {
  using std::erf;
  using std::exp;
  using std::log1p;
  using std::tanh;
  switch (a) {
    case Activation::SiLU:
      return p / (T(1) + exp(-p));
    case Activation::GELU:
      return T(0.5) * p * (T(1) + erf(p * T(0.70710678118654752440)));
    case Activation::GELUTanh: {
      const T inner = T(0.79788456080286535588) * (p + T(0.044715) * p * p * p);
      return T(0.5) * p * (T(1) + tanh(inner));
    }
    case Activation::ReLU:
      return p < T(0) ? T(0) : p;  // NaN stays NaN, as torch.relu
    case Activation::LeakyReLU:
      return p > T(0) ? p : p * negative_slope;
    case Activation::Mish:
      // softplus(p) = log1p(exp(p)); for large p exp overflows to inf and tanh(inf) = 1.
      return p * tanh(log1p(exp(p)));
    default:
      return p;
  }
}

// d act / dp at p, as PyTorch's backward formulas (relu' = 0 and leaky_relu' = slope at p = 0).
template <typename T>
FUSEDNORM_HOST_DEVICE T activation_derivative(Activation a, T p, T negative_slope) {
  using std::erf;
  using std::exp;
  using std::log1p;
  using std::tanh;
  switch (a) {
    case Activation::SiLU: {
      const T s = T(1) / (T(1) + exp(-p));
      return s * (T(1) + p * (T(1) - s));
    }
    case Activation::GELU: {
      const T cdf = T(0.5) * (T(1) + erf(p * T(0.70710678118654752440)));
      const T pdf = exp(T(-0.5) * p * p) * T(0.39894228040143267794);
      return cdf + p * pdf;
    }
    case Activation::GELUTanh: {
      const T beta = T(0.79788456080286535588), kappa = T(0.044715);
      const T t = tanh(beta * (p + kappa * p * p * p));
      const T inner_derivative = beta * (T(1) + T(3) * kappa * p * p);
      return T(0.5) * (T(1) + t) + T(0.5) * p * (T(1) - t * t) * inner_derivative;
    }
    case Activation::ReLU:
      return p <= T(0) ? T(0) : T(1);  // 1 at NaN, as eager's threshold_backward
    case Activation::LeakyReLU:
      return p > T(0) ? T(1) : negative_slope;
    case Activation::Mish: {
      const T tsp = tanh(log1p(exp(p)));
      const T sig = T(1) / (T(1) + exp(-p));
      return tsp + p * sig * (T(1) - tsp * tsp);
    }
    default:
      return T(1);
  }
}

}  // namespace fusednorm
