// CPU kernels of group_norm_forward / group_norm_backward and their fused variants
// (fused_group_norm_forward / fused_group_norm_backward, the epilogue of epilogue.h). The plain
// ops are the fused ones with an empty epilogue.
//
// Two layouts are handled in place (see Layout in group_norm.h):
//   ChannelsFirst: group (n, g) is one contiguous run of D * S elements, D rows of S.
//   ChannelsLast:  sample n is S rows of C channels; group g is a slice of D channels of each row.
// Statistics take one pass over memory: each block of a group small enough to stay in cache is
// reduced exactly in two passes (mean, then squared deviations from it) in vector lanes of opmath
// (float, or double for double), and the blocks' (count, mean, M2) are merged in double with Chan's
// formula. Neither a large offset nor a huge group loses precision, and there is no
// E[x^2] - E[x]^2. The backward uses centred sums, sum(dy * (x - mean)), for the same reason.
//
// Results do not depend on the number of threads: every partial sum covers a range fixed by the
// shape alone and partials are combined in a fixed order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <vector>

#include "group_norm.h"

namespace fusednorm {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// Elements summed in vector lanes before the running total moves to double.
constexpr int64_t kBlock = 4096;

// On a per-element loop: everything it calls is inlined into it. GCC's inliner otherwise gives up
// on ATen's vector math (exp_u20, erf) once this file's instantiations grow, and a call per vector
// made the GN+SiLU forward 35% slower (CPU fifteenth run).
#if defined(__GNUC__)
#define FUSEDNORM_FLATTEN __attribute__((flatten))
#else
#define FUSEDNORM_FLATTEN
#endif

// A whole float vector's worth of bfloat16 / half values, widened by ATen's vector conversion.
inline void load_widened(const c10::BFloat16* p, at::vec::Vectorized<float>& out) {
  at::vec::load_fp32_from_bf16(p, out);
}
inline void load_widened(const c10::Half* p, at::vec::Vectorized<float>& out) {
  at::vec::load_fp32_from_fp16(p, out);
}
// Two float vectors' worth (one whole reduced-precision vector).
inline void load_widened(const c10::BFloat16* p, at::vec::Vectorized<float>& lo, at::vec::Vectorized<float>& hi) {
  at::vec::load_fp32_from_bf16(p, lo, hi);
}
inline void load_widened(const c10::Half* p, at::vec::Vectorized<float>& lo, at::vec::Vectorized<float>& hi) {
  at::vec::load_fp32_from_fp16(p, lo, hi);
}

// Loads and stores between T and vectors of opmath_type<T>. bfloat16 and half convert a whole
// vector at a time with ATen's conversions (round to nearest even, as c10's scalar conversion);
// converting element by element through a buffer made the bfloat16 channels-last forward 3-4x
// ATen's time. Partial vectors (row tails) keep the element loop.
template <typename T>
struct VecIO {
  using acc_t = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int64_t kSize = Vec::size();

  static Vec load(const T* p, int64_t count = kSize) {
    if constexpr (std::is_same_v<T, acc_t>) {
      return count == kSize ? Vec::loadu(p) : Vec::loadu(p, count);
    } else {
      if (count == kSize) {
        Vec v;
        load_widened(p, v);
        return v;
      }
      acc_t buf[kSize] = {};
      for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<acc_t>(p[i]);
      return Vec::loadu(buf);
    }
  }

  static void store(T* p, const Vec& v, int64_t count = kSize) {
    if constexpr (std::is_same_v<T, acc_t>) {
      v.store(p, count);
    } else if (count == kSize) {
      // Both halves of the reduced vector hold v; its first kSize values are stored.
      at::vec::convert_from_float<T>(v, v).store(p, kSize);
    } else {
      acc_t buf[kSize];
      v.store(buf);
      for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(buf[i]);
    }
  }

  // Calls step(i, count) over a run of len elements: whole vectors (count == kSize, a constant
  // the loads and stores fold), then the tail.
  template <typename Step>
  static void for_each_vector(int64_t len, Step step) {
    int64_t i = 0;
    for (; i + kSize <= len; i += kSize) step(i, kSize);
    if (i < len) step(i, len - i);
  }
};

// v in its first `count` lanes and zeros past them: a row's last, partial vector loads zeros into
// its padding lanes, but values derived from them (x - m) are not zero there and must not be summed.
template <typename Vec>
Vec first_lanes(const Vec& v, int64_t count) {
  return count < Vec::size() ? Vec::set(Vec(0), v, count) : v;
}

// The lanes' sum, by ATen's shuffle tree in opmath. Adding the lanes one by one in double was a
// chain of 16 dependent additions, which dominated groups and rows of a few vectors: (4096, 512)
// with G = 32 forward 6.4 -> 4.4 ms, the (64, 512, 16) backward 1.41 -> 1.05-1.20 ms (CPU fifteenth
// run). The lanes are opmath sums already; the tree adds at most log2(lanes) roundings.
template <typename Vec>
double horizontal_sum(const Vec& v) {
  using acc_t = typename Vec::value_type;
  return static_cast<double>(at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, v));
}

// Independent accumulators per output: one vector add has a latency of several cycles, so a
// single accumulator would leave the loop latency-bound.
constexpr int kUnroll = 4;

// Sums f(x[i], y[i]) over a contiguous row for each of K outputs. `f(acc, xv, yv, count)` adds
// one vector's contribution to the K accumulators; lanes past `count` hold zeros. `y` may be null;
// it is of the input's type or already opmath (a buffer of computed gradients).
template <int K, typename T, typename Y = T, typename F>
std::array<double, K> reduce_row(const T* x, const Y* y, int64_t n, F f) {
  using IO = VecIO<T>;
  using YIO = VecIO<Y>;
  using Vec = typename IO::Vec;
  constexpr int64_t kSize = IO::kSize;
  std::array<double, K> total{};
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    std::array<std::array<Vec, K>, kUnroll> acc;
    for (auto& a : acc) a.fill(Vec(0));
    int64_t i = start;
    for (; i + kUnroll * kSize <= end; i += kUnroll * kSize) {
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + u * kSize;
        f(acc[u], IO::load(x + j), y ? YIO::load(y + j) : Vec(0), kSize);
      }
    }
    for (; i < end; i += kSize) {
      const int64_t count = std::min(kSize, end - i);
      f(acc[0], IO::load(x + i, count), y ? YIO::load(y + i, count) : Vec(0), count);
    }
    for (int k = 0; k < K; ++k) {
      Vec sum = acc[0][k];
      for (int u = 1; u < kUnroll; ++u) sum += acc[u][k];
      total[k] += horizontal_sum(sum);
    }
  }
  return total;
}

// Applies out[i] = f(x[i], y[i], i) over a contiguous row. bfloat16 / half go two float vectors
// at a time, so that each store is one whole reduced-precision vector.
template <typename T, typename Y = T, typename F>
void map_row(const T* x, const Y* y, T* out, int64_t n, F f) {
  using IO = VecIO<T>;
  using YIO = VecIO<Y>;
  using Vec = typename IO::Vec;
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, typename IO::acc_t>) {
    constexpr int64_t kSize = IO::kSize;
    for (; i + 2 * kSize <= n; i += 2 * kSize) {
      Vec x0, x1;
      load_widened(x + i, x0, x1);
      const Vec y0 = y ? YIO::load(y + i) : Vec(0);
      const Vec y1 = y ? YIO::load(y + i + kSize) : Vec(0);
      at::vec::convert_from_float<T>(f(x0, y0, i), f(x1, y1, i + kSize)).store(out + i);
    }
  }
  for (; i + IO::kSize <= n; i += IO::kSize) {
    IO::store(out + i, f(IO::load(x + i), y ? YIO::load(y + i) : Vec(0), i));
  }
  if (i < n) IO::store(out + i, f(IO::load(x + i, n - i), y ? YIO::load(y + i, n - i) : Vec(0), i), n - i);
}

// Weight / bias as opmath values, 1 and 0 where absent.
template <typename acc_t>
std::vector<acc_t> param_or(const OptTensor& p, int64_t C, acc_t fill) {
  std::vector<acc_t> out(C, fill);
  if (p.has_value() && p->defined()) {
    const at::Tensor pc = p->contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, pc.scalar_type(), "param_or", [&] {
      const scalar_t* data = pc.data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) out[c] = static_cast<acc_t>(data[c]);
    });
  }
  return out;
}

// Rows of a channels-last sample processed as one unit of work: fixed by C alone, so that
// partial sums never depend on the thread count. About 64K elements: per-chunk work (merging the
// channels into groups, the per-chunk partials) is paid once per chunk, and four times as many
// rows as with 16K elements took the (8, 320, 32, 32) forward from ~0.35 to ~0.28 ms. At most
// kBlock rows, so that no channel sums more values in opmath lanes than a ChannelsFirst block.
int64_t rows_per_chunk(int64_t C) {
  return std::min<int64_t>(kBlock, std::max<int64_t>(1, 65536 / std::max<int64_t>(C, 1)));
}

// ---------------------------------------------------------------------------------------------
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
// clobbers the vector registers: inline, the GELU forward took 19-26% less time (RESULTS.md, CPU
// twentieth run). Other vector types and capabilities: Vec::exp().
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

// The per-element side of an epilogue: residual and multiplier share x's offsets (make_epilogue
// puts them in x's layout). The per-(n, c) side (scale, shift) is folded into the affine
// coefficients by the callers.
template <typename T>
struct ElementwiseOperands {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;

  const T* residual = nullptr;
  const T* multiplier = nullptr;
  Activation activation = Activation::None;
  acc_t slope = 0;
  // Backward outputs (null: not requested).
  T* grad_residual = nullptr;
  T* grad_multiplier = nullptr;

  ElementwiseOperands() = default;
  ElementwiseOperands(const Epilogue& ep, bool need_multiplier_grad = false)
      : residual(ep.residual.defined() ? ep.residual.data_ptr<T>() : nullptr),
        multiplier(ep.multiplier.defined() ? ep.multiplier.data_ptr<T>() : nullptr),
        activation(ep.activation),
        slope(static_cast<acc_t>(ep.negative_slope)),
        needs_p_(ep.activation != Activation::None || need_multiplier_grad) {}

  // Whether dp differs from dz or gradients are written per element. (grad_multiplier without a
  // multiplier is the gradient at multiplier = 1; grad_residual without a residual is dp.)
  bool active() const {
    return residual || multiplier || activation != Activation::None || grad_residual || grad_multiplier;
  }

  // out[i] = act(v[i] + residual[off + i]) * multiplier[off + i] for i < len.
  void forward_run(const acc_t* v, T* out, int64_t off, int64_t len) const {
    forward_each(out, off, len, [v](int64_t i, int64_t count) { return Vec::loadu(v + i, count); });
  }

  // The same with v's vector at i made by source(i, count), in the epilogue's loop: for a source
  // cheap enough to inline into each activation's loop, no buffer in between.
  template <typename Source>
  void forward_each(T* out, int64_t off, int64_t len, Source source) const {
    // As backward_run: the loop reads only forward_loop's locals.
    const T* const r = residual ? residual + off : nullptr;
    const T* const m = multiplier ? multiplier + off : nullptr;
    dispatch_activation(activation, [&](auto tag) {
      forward_loop<decltype(tag)::value>(out, len, source, r, m, m != nullptr && m == r, slope);
    });
  }

  template <Activation A, typename Source>
  FUSEDNORM_FLATTEN static void forward_loop(T* out, int64_t len, Source source, const T* residual,
      const T* multiplier, bool multiplier_is_residual, acc_t slope) {
    const auto step = [&](int64_t i, int64_t count) {
      Vec z = source(i, count);
      Vec r(acc_t(0));
      if (residual) {
        r = IO::load(residual + i, count);
        z = z + r;
      }
      z = vec_activation<A>(z, slope);
      if (multiplier) z = z * (multiplier_is_residual ? r : IO::load(multiplier + i, count));
      IO::store(out + i, z, count);
    };
    IO::for_each_vector(len, step);
  }

  // Sums over runs, in vector lanes: dp, dp * (x - centre) and x - centre (lanes past a run's end
  // add nothing).
  struct RunSums {
    Vec dp = Vec(0), dp_xc = Vec(0), xc = Vec(0);
  };

  // dp[i] for i < len, the gradient at the pre-activation p = (x - centre) * pa + pc + residual of
  // element off + i, from dz; also grad_residual (= dp) and grad_multiplier (= dz * act(p)) there
  // when `write` and requested (their sum into grad_residual when the two are one buffer). dz and
  // x point at element off. The coefficients are one value for the run, or (PerLane) one per
  // element of it. With `sums` (one centre for the run), dp's sums are added there in the same
  // pass, as a loop over x and the stored dp would add them.
  template <bool PerLane, bool WithSums = false>
  void backward_run(const T* dz, const T* x, int64_t off, int64_t len, const acc_t* centre,
      const acc_t* pa, const acc_t* pc, acc_t* dp, bool write, RunSums* sums = nullptr) const {
    static_assert(!(PerLane && WithSums), "the sums take one centre for the run");
    // The loop reads only backward_loop's locals, copied from here: a vector store may alias any
    // memory (ATen's stores go through may_alias types), so members and captured references were
    // reloaded after each one, through pointers, and the tests of the operands stayed in the loop.
    // The fused ReLU backward of (8, 320, 32, 32) float32 took 1.5-1.8x the plain one, 1.1-1.4x
    // since (one thread, CPU fifteenth run).
    RunArgs r;
    r.dz = dz;
    r.x = x;
    r.residual = residual ? residual + off : nullptr;
    r.multiplier = multiplier ? multiplier + off : nullptr;
    r.grad_residual = write && grad_residual ? grad_residual + off : nullptr;
    r.grad_multiplier = write && grad_multiplier ? grad_multiplier + off : nullptr;
    r.grads_in_one = grad_multiplier != nullptr && grad_multiplier == grad_residual;
    r.centre = centre;
    r.pa = pa;
    r.pc = pc;
    r.dp = dp;
    r.slope = slope;
    r.needs_p = needs_p_;
    dispatch_activation(activation, [&](auto tag) {
      constexpr Activation A = decltype(tag)::value;
      const RunSums s = backward_loop<A, PerLane, WithSums>(r, len);
      if constexpr (WithSums) {
        sums->dp += s.dp;
        sums->dp_xc += s.dp_xc;
        sums->xc += s.xc;
      }
    });
  }

 private:
  // backward_run's operands, offset to the run's first element.
  struct RunArgs {
    const T *dz, *x, *residual, *multiplier;
    T *grad_residual, *grad_multiplier;  // null: not written
    bool grads_in_one, needs_p;
    const acc_t *centre, *pa, *pc;
    acc_t* dp;
    acc_t slope;
  };

  // The loop of backward_run; returns the run's sums (zero without WithSums).
  template <Activation A, bool PerLane, bool WithSums>
  FUSEDNORM_FLATTEN static RunSums backward_loop(const RunArgs r, int64_t len) {
    RunSums sums;
    // One coefficient for the run (PerLane: one an element, loaded in the loop).
    const Vec centre1 = PerLane ? Vec(0) : Vec(*r.centre);
    const Vec pa1 = PerLane ? Vec(0) : Vec(*r.pa);
    const Vec pc1 = PerLane ? Vec(0) : Vec(*r.pc);
    const auto step = [&](int64_t i, int64_t count) {
      const Vec dzv = IO::load(r.dz + i, count);
      Vec g = dzv;
      Vec grad_m(acc_t(0));
      const auto coef = [&](const acc_t* c, const Vec& one) { return PerLane ? Vec::loadu(c + i, count) : one; };
      Vec xc(acc_t(0));
      if (r.needs_p || WithSums) xc = IO::load(r.x + i, count) - coef(r.centre, centre1);
      if (r.needs_p) {
        Vec p = at::vec::fmadd(xc, coef(r.pa, pa1), coef(r.pc, pc1));
        if (r.residual) p = p + IO::load(r.residual + i, count);
        if (r.grad_multiplier) {
          grad_m = dzv * vec_activation<A>(p, r.slope);
          if (!r.grads_in_one) IO::store(r.grad_multiplier + i, grad_m, count);
        }
        if constexpr (A != Activation::None) g = g * vec_activation_derivative<A>(p, r.slope);
      }
      if (r.multiplier) g = g * IO::load(r.multiplier + i, count);
      if (r.grad_residual) IO::store(r.grad_residual + i, r.grads_in_one ? g + grad_m : g, count);
      g.store(r.dp + i, count);
      if constexpr (WithSums) {
        // Padding lanes add nothing (dp as stored and reloaded: zero).
        xc = first_lanes(xc, count);
        g = first_lanes(g, count);
        sums.dp += g;
        sums.dp_xc = at::vec::fmadd(g, xc, sums.dp_xc);
        sums.xc += xc;
      }
    };
    IO::for_each_vector(len, step);
    return sums;
  }

  bool needs_p_ = false;
};

// Per-(n, c) values of the modulation, 1 + scale and shift (empty when absent).
template <typename acc_t>
std::vector<acc_t> per_sample_channel_or_empty(const at::Tensor& t, acc_t add) {
  std::vector<acc_t> out;
  if (!t.defined()) return out;
  const at::Tensor ta = t.to(c10::CppTypeToScalarType<acc_t>::value);  // (N, C) contiguous
  const acc_t* p = ta.data_ptr<acc_t>();
  out.resize(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = p[i] + add;
  return out;
}

// The modulation of channel c of sample n: v = u * gain + shift.
template <typename acc_t>
struct Modulation {
  std::vector<acc_t> gain, shift;  // (N * C) each, or empty: 1 and 0
  explicit Modulation(const Epilogue& ep)
      : gain(per_sample_channel_or_empty(ep.scale, acc_t(1))),
        shift(per_sample_channel_or_empty(ep.shift, acc_t(0))) {}
  acc_t gain_at(int64_t nc) const { return gain.empty() ? acc_t(1) : gain[nc]; }
  acc_t shift_at(int64_t nc) const { return shift.empty() ? acc_t(0) : shift[nc]; }
};

// ---------------------------------------------------------------------------------------------
// Forward

// Count, mean and sum of squared deviations of a set of values; merge() is Chan's formula.
struct Moments {
  double n = 0, mean = 0, m2 = 0;
  void merge(const Moments& o) {
    if (o.n == 0) return;
    const double total = n + o.n, delta = o.mean - mean;
    mean += delta * (o.n / total);
    m2 += o.m2 + delta * delta * (n * o.n / total);
    n = total;
  }
};

// A mean split into two opmath values, hi + lo. x - hi is exact for x near the mean (Sterbenz),
// so (x - hi) - lo centres x to within one rounding even when |mean| >> std, which a mean rounded
// to float32 alone would not (1e4 + randn loses ~5e-4 that way).
template <typename acc_t>
struct SplitMean {
  acc_t hi, lo;
  explicit SplitMean(double mean = 0)
      : hi(static_cast<acc_t>(mean)), lo(static_cast<acc_t>(mean - static_cast<double>(hi))) {}
};

// Moments of a contiguous run of at most kBlock elements (cache-resident for its second read).
template <typename T>
Moments block_moments(const T* x, int64_t len) {
  using Vec = typename VecIO<T>::Vec;
  using acc_t = at::opmath_type<T>;
  if (len == 0) return {};
  // Summing x - x[0] keeps the float lanes small when |mean| >> std. Padding lanes past `count`
  // load as zeros and are masked out.
  const acc_t first = static_cast<acc_t>(x[0]);
  const double shifted = reduce_row<1>(x, static_cast<const T*>(nullptr), len,
      [first](auto& acc, const Vec& xv, const Vec&, int64_t count) {
        const Vec d = xv - Vec(first);
        acc[0] += first_lanes(d, count);
      })[0];
  const double mean = first + shifted / len;
  const SplitMean<acc_t> m(mean);
  // sum((x - hi) - lo)^2 = sum(x - hi)^2 - len * lo^2, as sum(x - hi) = len * lo.
  const double m2 = reduce_row<1>(x, static_cast<const T*>(nullptr), len,
      [m](auto& acc, const Vec& xv, const Vec&, int64_t count) {
        const Vec d = xv - Vec(m.hi);
        acc[0] += first_lanes(d * d, count);
      })[0];
  return {static_cast<double>(len), mean, std::max(m2 - len * double(m.lo) * m.lo, 0.0)};
}

// The output uses the statistics at opmath precision, not their saved rounding.
double rstd_of(const Moments& m, double eps) {
  const double var = m.n > 0 ? std::max(m.m2 / m.n, 0.0) : 0.0;
  return 1.0 / std::sqrt(var + eps);
}

// out = epilogue(f(x)) over a contiguous run of n elements at element offset `off`: f's affine
// values go through a cache-resident opmath buffer (no rounding to T in between), then the
// epilogue's loop (one per activation) writes out. f(xv, _, i) takes the index within the run.
template <typename T, typename F>
void map_through_buffer(const T* x, T* out, int64_t off, int64_t n, F f, const ElementwiseOperands<T>& ep) {
  using IO = VecIO<T>;
  using acc_t = at::opmath_type<T>;
  acc_t buf[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    for (int64_t i = 0; i < len; i += IO::kSize) {
      const int64_t count = std::min<int64_t>(IO::kSize, len - i);
      f(IO::load(x + start + i, count), typename IO::Vec(0), start + i).store(buf + i, count);
    }
    ep.forward_run(buf, out + start, off + start, len);
  }
}

// per_channel_params: a weight or bias was given (w and b are 1 and 0 otherwise).
template <typename T>
void forward_channels_first(
    const T* x, T* y, const GroupNormShape& sh, const std::vector<at::opmath_type<T>>& w,
    const std::vector<at::opmath_type<T>>& b, bool per_channel_params, double eps,
    const Modulation<at::opmath_type<T>>& mod, const ElementwiseOperands<T>& ep, at::opmath_type<T>* mean_out,
    at::opmath_type<T>* rstd_out) {
  using acc_t = at::opmath_type<T>;
  using Vec = typename VecIO<T>::Vec;
  const int64_t M = sh.D * sh.S;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(M, 1));
  // Small groups go in batches: the batch's statistics first, then its outputs. A small group's
  // moments, square root and division are one long chain of dependent operations, which the core
  // overlaps across the groups of a batch but not across a group's output loop in between. A
  // batch stays within kStatsBatchBytes (in L1 for its second read); a group of that size or
  // more is a batch of one, read a second time from L2 as before.
  constexpr int64_t kStatsBatchBytes = 8192, kMaxStatsBatch = 64;
  const int64_t batch = std::max<int64_t>(1,
      std::min<int64_t>(kMaxStatsBatch, kStatsBatchBytes / std::max<int64_t>(M * int64_t(sizeof(T)), 1)));
  at::parallel_for(0, sh.N * sh.G, grain, [&](int64_t begin, int64_t end) {
    double batch_mean[kMaxStatsBatch], batch_rstd[kMaxStatsBatch];
    for (int64_t b0 = begin; b0 < end; b0 += batch) {
      const int64_t b1 = std::min(end, b0 + batch);
      for (int64_t ng = b0; ng < b1; ++ng) {
        const T* xg = x + ng * M;
        Moments stats;
        for (int64_t start = 0; start < M; start += kBlock) {
          stats.merge(block_moments(xg + start, std::min(kBlock, M - start)));
        }
        const double rstd = rstd_of(stats, eps);
        mean_out[ng] = static_cast<acc_t>(stats.mean);
        rstd_out[ng] = static_cast<acc_t>(rstd);
        batch_mean[ng - b0] = stats.mean;
        batch_rstd[ng - b0] = rstd;
      }
      for (int64_t ng = b0; ng < b1; ++ng) {
        const T* xg = x + ng * M;
        const double rstd = batch_rstd[ng - b0];
        const SplitMean<acc_t> m(batch_mean[ng - b0]);
        const int64_t g = ng % sh.G;
        const int64_t n = ng / sh.G;
        if (sh.S == 1) {
          // One element per channel: the group is one run of D channels, each with its own
          // coefficients (computed as below, in the same order).
          const acc_t* wg = w.data() + g * sh.D;
          const acc_t* bg = b.data() + g * sh.D;
          const acc_t* gain = mod.gain.empty() ? nullptr : mod.gain.data() + n * sh.C + g * sh.D;
          const acc_t* tshift = mod.shift.empty() ? nullptr : mod.shift.data() + n * sh.C + g * sh.D;
          const Vec rs(static_cast<acc_t>(rstd)), hi(m.hi), lo(m.lo);
          if (!per_channel_params && !gain && !tshift) {
            // No coefficient per channel (problem 3's tail): one pair for the row, the values the
            // general loop makes from weight 1 and bias 0, and the epilogue in the same loop.
            const Vec shift = Vec(acc_t(0)) - lo * rs;
            auto affine = [&](const Vec& xv) { return at::vec::fmadd(xv - hi, rs, shift); };
            if (!ep.active()) {
              map_row(xg, static_cast<const T*>(nullptr), y + ng * M, sh.D,
                  [&](const Vec& xv, const Vec&, int64_t) { return affine(xv); });
            } else {
              ep.forward_each(y + ng * M, ng * M, sh.D,
                  [&](int64_t i, int64_t count) { return affine(VecIO<T>::load(xg + i, count)); });
            }
            continue;
          }
          auto affine = [&](const Vec& xv, const Vec&, int64_t i) {
            const int64_t count = std::min<int64_t>(Vec::size(), sh.D - i);
            Vec scale = rs * Vec::loadu(wg + i, count);
            Vec shift = Vec::loadu(bg + i, count);
            if (gain) {
              const Vec gv = Vec::loadu(gain + i, count);
              scale = scale * gv;
              shift = shift * gv;
            }
            if (tshift) shift = shift + Vec::loadu(tshift + i, count);
            return at::vec::fmadd(xv - hi, scale, shift - lo * scale);
          };
          if (!ep.active()) {
            map_row(xg, static_cast<const T*>(nullptr), y + ng * M, sh.D, affine);
          } else {
            map_through_buffer(xg, y + ng * M, ng * M, sh.D, affine, ep);
          }
          continue;
        }
        for (int64_t d = 0; d < sh.D; ++d) {
          const int64_t c = g * sh.D + d;
          const int64_t row = ng * M + d * sh.S;
          const acc_t gain = mod.gain_at(n * sh.C + c);
          const acc_t scale = static_cast<acc_t>(rstd) * w[c] * gain;
          const Vec scale_v(scale), hi(m.hi), shift(b[c] * gain + mod.shift_at(n * sh.C + c) - m.lo * scale);
          auto affine = [&](const Vec& xv, const Vec&, int64_t) { return at::vec::fmadd(xv - hi, scale_v, shift); };
          if (!ep.active()) {
            map_row(xg + d * sh.S, static_cast<const T*>(nullptr), y + row, sh.S, affine);
          } else {
            map_through_buffer(xg + d * sh.S, y + row, row, sh.S, affine, ep);
          }
        }
      }
    }
  });
}

// Channels-last chunks are walked in blocks of kChannelVecs vectors of channels, each block down
// all rows of the chunk with its per-channel state in registers: a running state in memory would
// cost a load and a store per vector, as much as the data.
constexpr int kChannelVecs = 4;

// Calls f(c0, count, u) for the vectors u < kChannelVecs of channels of the block starting at cb
// (count: channels in the vector, the last one may be partial). The loop over u is unrolled, so
// that the callers' per-vector state (arrays indexed by u) stays in registers; full blocks take a
// path with no bounds checks.
template <typename F>
inline void for_block_vectors(int64_t cb, int64_t C, int64_t size, F f) {
  if (cb + kChannelVecs * size <= C) {
#pragma GCC unroll 4
    for (int u = 0; u < kChannelVecs; ++u) f(cb + u * size, size, u);
  } else {
#pragma GCC unroll 4
    for (int u = 0; u < kChannelVecs; ++u) {
      const int64_t c0 = cb + u * size;
      if (c0 < C) f(c0, std::min<int64_t>(size, C - c0), u);
    }
  }
}

// Per-channel sums over rows [r0, r1) of a channels-last sample: out[k * C + c] for K
// accumulators. `f(acc, xv, yv, c0, count)` updates the accumulators of channels
// [c0, c0 + count); lanes past `count` load as zeros and are never stored. Each channel's rows are
// added in row order.
template <int K, typename T, typename Y = T, typename F>
void reduce_channels(const T* x, const Y* y, int64_t r0, int64_t r1, int64_t C, double* out, F f) {
  using IO = VecIO<T>;
  using YIO = VecIO<Y>;
  using Vec = typename IO::Vec;
  using acc_t = typename IO::acc_t;
  constexpr int64_t kSize = IO::kSize;
  for (int64_t cb = 0; cb < C; cb += kChannelVecs * kSize) {
    std::array<std::array<Vec, K>, kChannelVecs> acc;
    for (auto& a : acc) a.fill(Vec(0));
    for (int64_t r = r0; r < r1; ++r) {
      for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
        const int64_t off = r * C + c0;
        f(acc[u], IO::load(x + off, count), y ? YIO::load(y + off, count) : Vec(0), c0, count);
      });
    }
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      for (int k = 0; k < K; ++k) {
        acc_t buf[kSize];
        acc[u][k].store(buf);
        for (int64_t i = 0; i < count; ++i) out[k * C + c0 + i] = buf[i];
      }
    });
  }
}

int64_t num_chunks(const GroupNormShape& sh) {
  const int64_t rows = rows_per_chunk(sh.C);
  return (sh.S + rows - 1) / rows;
}

// Calls body(k, r0, r1) for chunk k = rows [r0, r1) of a sample.
template <typename F>
void with_chunk_rows(const GroupNormShape& sh, int64_t k, F body) {
  const int64_t rows = rows_per_chunk(sh.C);
  body(k, k * rows, std::min(sh.S, (k + 1) * rows));
}

// Runs body(chunk, r0, r1) over the chunks of rows of one sample, in order.
template <typename F>
void for_sample_chunks(const GroupNormShape& sh, F body) {
  for (int64_t k = 0, chunks = num_chunks(sh); k < chunks; ++k) with_chunk_rows(sh, k, body);
}

// Runs body(n, chunk, r0, r1) over every chunk of rows of every sample, in parallel.
template <typename F>
void for_each_chunk(const GroupNormShape& sh, F body) {
  const int64_t chunks = num_chunks(sh);
  at::parallel_for(0, sh.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / chunks;
      with_chunk_rows(sh, i % chunks, [&](int64_t k, int64_t r0, int64_t r1) { body(n, k, r0, r1); });
    }
  });
}

// Moments of every group over one chunk of rows of a channels-last sample. Per block of channels
// (a few KB: the second read comes from L1), each channel's moments are taken exactly in two
// passes, the sum of x - x[r0] and then the sums of d and d^2 for d = x - m' (m' the channel mean
// rounded to opmath, corrected by sum d); the channels are then merged into their groups with
// Chan's formula in double.
template <typename T>
void chunk_moments(const T* xn, int64_t r0, int64_t r1, const GroupNormShape& sh, Moments* out) {
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  using acc_t = typename IO::acc_t;
  constexpr int64_t kSize = IO::kSize;
  const int64_t C = sh.C, rows = r1 - r0;
  std::vector<Moments> channel(C);
  for (int64_t cb = 0; cb < C; cb += kChannelVecs * kSize) {
    std::array<Vec, kChannelVecs> first, sum, dsum, d2sum;
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      first[u] = IO::load(xn + r0 * C + c0, count);
      sum[u] = Vec(0);
    });
    for (int64_t r = r0; r < r1; ++r) {
      for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
        sum[u] += IO::load(xn + r * C + c0, count) - first[u];
      });
    }
    std::array<Vec, kChannelVecs> mean;
    const Vec inv(acc_t(1) / static_cast<acc_t>(rows));
    for_block_vectors(cb, C, kSize, [&](int64_t, int64_t, int u) {
      mean[u] = first[u] + sum[u] * inv;
      dsum[u] = d2sum[u] = Vec(0);
    });
    for (int64_t r = r0; r < r1; ++r) {
      for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
        const Vec d = IO::load(xn + r * C + c0, count) - mean[u];
        dsum[u] += d;
        d2sum[u] = at::vec::fmadd(d, d, d2sum[u]);
      });
    }
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      acc_t m[kSize], ds[kSize], d2[kSize];
      mean[u].store(m);
      dsum[u].store(ds);
      d2sum[u].store(d2);
      for (int64_t i = 0; i < count; ++i) {
        const double shift = double(ds[i]) / rows;
        channel[c0 + i] = Moments{static_cast<double>(rows), double(m[i]) + shift,
                                  std::max(double(d2[i]) - double(ds[i]) * shift, 0.0)};
      }
    });
  }
  // Every channel counts `rows` values: the group's mean is the channels' mean, and its M2 their
  // M2s plus rows times the squared deviations of their means (Chan's formula for equal counts,
  // without its per-merge divisions, which cost as much as the data at a few rows a chunk).
  for (int64_t g = 0; g < sh.G; ++g) {
    double mean = 0;
    for (int64_t c = g * sh.D; c < (g + 1) * sh.D; ++c) mean += channel[c].mean;
    mean /= sh.D;
    double m2 = 0, spread = 0;
    for (int64_t c = g * sh.D; c < (g + 1) * sh.D; ++c) {
      const double d = channel[c].mean - mean;
      m2 += channel[c].m2;
      spread += d * d;
    }
    out[g] = Moments{static_cast<double>(rows * sh.D), mean, m2 + rows * spread};
  }
}

template <typename T>
void forward_channels_last(
    const T* x, T* y, const GroupNormShape& sh, const std::vector<at::opmath_type<T>>& w,
    const std::vector<at::opmath_type<T>>& b, double eps, const Modulation<at::opmath_type<T>>& mod,
    const ElementwiseOperands<T>& ep, at::opmath_type<T>* mean_out, at::opmath_type<T>* rstd_out) {
  using acc_t = at::opmath_type<T>;
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C, chunks = num_chunks(sh);

  std::vector<Moments> partial(sh.N * chunks * sh.G);
  std::vector<acc_t> mean_hi(sh.N * C), scale(sh.N * C), shift(sh.N * C);

  // Sample n's statistics, merged in chunk order, then each group's copied per channel so that
  // the output pass is a vector loop over channels.
  auto sample_coefficients = [&](int64_t n) {
    for (int64_t g = 0; g < sh.G; ++g) {
      Moments stats;
      for (int64_t k = 0; k < chunks; ++k) stats.merge(partial[(n * chunks + k) * sh.G + g]);
      const int64_t ng = n * sh.G + g;
      const double rstd = rstd_of(stats, eps);
      mean_out[ng] = static_cast<acc_t>(stats.mean);
      rstd_out[ng] = static_cast<acc_t>(rstd);
      const SplitMean<acc_t> m(stats.mean);
      for (int64_t c = g * sh.D; c < (g + 1) * sh.D; ++c) {
        const int64_t nc = n * C + c;
        const acc_t gain = mod.gain_at(nc);
        mean_hi[nc] = m.hi;
        scale[nc] = static_cast<acc_t>(rstd) * w[c] * gain;
        shift[nc] = b[c] * gain + mod.shift_at(nc) - m.lo * scale[nc];
      }
    }
  };

  // y = (x - hi) * scale + (bias - lo * scale) over rows [r0, r1) of sample n, see SplitMean,
  // row by row: the loads and stores run along memory, the coefficients (12 bytes a channel) come
  // from L1. (Blocks of channels down the rows with the coefficients in registers, as the moments
  // take them, made strided loads and stores: 1.5x ATen's time on (8, 320, 32, 32).)
  auto output_chunk = [&](int64_t n, int64_t r0, int64_t r1) {
    const acc_t* hi = mean_hi.data() + n * C;
    const acc_t* sc = scale.data() + n * C;
    const acc_t* sf = shift.data() + n * C;
    auto affine = [&](const Vec& xv, const Vec&, int64_t c0) {
      const int64_t count = std::min<int64_t>(Vec::size(), C - c0);
      return at::vec::fmadd(xv - Vec::loadu(hi + c0, count), Vec::loadu(sc + c0, count), Vec::loadu(sf + c0, count));
    };
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t off = (n * sh.S + r) * C;
      if (!ep.active()) {
        map_row(x + off, static_cast<const T*>(nullptr), y + off, C, affine);
      } else {
        map_through_buffer(x + off, y + off, off, C, affine, ep);
      }
    }
  };

  if (sh.N >= at::get_num_threads()) {
    // A sample for every thread: each thread takes whole samples, statistics then output, so that
    // the output pass rereads x from cache. The same chunks and merge order as below: same bits.
    at::parallel_for(0, sh.N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for_sample_chunks(sh, [&](int64_t k, int64_t r0, int64_t r1) {
          chunk_moments(x + n * sh.S * C, r0, r1, sh, &partial[(n * chunks + k) * sh.G]);
        });
        sample_coefficients(n);
        for_sample_chunks(sh, [&](int64_t, int64_t r0, int64_t r1) { output_chunk(n, r0, r1); });
      }
    });
    return;
  }
  for_each_chunk(sh, [&](int64_t n, int64_t k, int64_t r0, int64_t r1) {
    chunk_moments(x + n * sh.S * C, r0, r1, sh, &partial[(n * chunks + k) * sh.G]);
  });
  for (int64_t n = 0; n < sh.N; ++n) sample_coefficients(n);
  for_each_chunk(sh, [&](int64_t n, int64_t, int64_t r0, int64_t r1) { output_chunk(n, r0, r1); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_forward_cpu(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const GroupNormShape& sh, const Layout layout, const at::Tensor& x,
    const Epilogue& epilogue) {
  at::Tensor y = empty_in_layout(x, layout, x.scalar_type());
  at::Tensor mean = at::empty({sh.N, sh.G}, x.options().dtype(stats_dtype(x.scalar_type())));
  at::Tensor rstd = at::empty({sh.N, sh.G}, x.options().dtype(stats_dtype(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "group_norm_forward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = param_or<acc_t>(weight, sh.C, acc_t(1));
    const auto b = param_or<acc_t>(bias, sh.C, acc_t(0));
    const Modulation<acc_t> mod(epilogue);
    const ElementwiseOperands<scalar_t> ep(epilogue);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    acc_t* mp = mean.data_ptr<acc_t>();
    acc_t* rp = rstd.data_ptr<acc_t>();
    if (layout == Layout::ChannelsFirst) {
      const bool per_channel_params = (weight.has_value() && weight->defined()) || (bias.has_value() && bias->defined());
      forward_channels_first(xp, yp, sh, w, b, per_channel_params, eps, mod, ep, mp, rp);
    } else {
      forward_channels_last(xp, yp, sh, w, b, eps, mod, ep, mp, rp);
    }
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cpu(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  return fused_forward_cpu(input, num_groups, weight, bias, eps, sh, layout, to_layout(input, layout), Epilogue{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_cpu(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep =
      make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
  return fused_forward_cpu(input, num_groups, weight, bias, eps, sh, layout, x, ep);
}


// ---------------------------------------------------------------------------------------------
// Backward
//
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
double recentre_group(const GroupNormShape& sh, int64_t ng, GradSums& sums) {
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
std::vector<double> recentre(const GroupNormShape& sh, GradSums& sums) {
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

// Calls body(dp, x_run, len) over a contiguous run of `len` elements starting at element `off`
// of a ChannelsFirst row (n, c): dp is dy itself, or the epilogue's gradient computed block by
// block (blocks aligned as reduce_row's, so sums do not depend on the path) into a stack buffer,
// or, with `cache`, into cache + (off - cache_origin): there the first pass (`write`) computes it
// and the second reads it back.
template <typename T, typename Body>
void for_each_dp_run(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t off,
    int64_t len, at::opmath_type<T> centre, at::opmath_type<T> pa, at::opmath_type<T> pc,
    bool write, Body body, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  if (!ep.active()) {
    body(dy + off, x + off, len);
    return;
  }
  acc_t buf[kBlock];
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t block = std::min(kBlock, len - start);
    const int64_t o = off + start;
    acc_t* dp = cache != nullptr ? cache + (o - cache_origin) : buf;
    if (write || cache == nullptr) ep.template backward_run<false>(dy + o, x + o, o, block, &centre, &pa, &pc, dp, write);
    body(static_cast<const acc_t*>(dp), x + o, block);
  }
}

// The same for rows [r0, r1) of a ChannelsLast sample starting at element `base`: body(dp, x,
// rows) with dp and x pointing at row r0 (rows of C elements); dp in `buf`, or in
// cache + (element - cache_origin) as for_each_dp_run.
template <typename T, typename Body>
void for_each_dp_chunk(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t base,
    int64_t r0, int64_t r1, int64_t C, const GradInputCoeffs<at::opmath_type<T>>& k, int64_t n,
    bool write, std::vector<at::opmath_type<T>>& buf, Body body, at::opmath_type<T>* cache = nullptr,
    int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  const int64_t first = base + r0 * C;
  if (!ep.active()) {
    body(dy + first, x + first, r1 - r0);
    return;
  }
  acc_t* dp = cache;
  if (cache != nullptr) {
    dp += first - cache_origin;
  } else {
    buf.resize((r1 - r0) * C);
    dp = buf.data();
  }
  if (write || cache == nullptr) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = base + r * C;
      ep.template backward_run<true>(dy + o, x + o, o, C, &k.mean[n * C], &k.a[n * C], &k.pc[n * C],
          dp + (r - r0) * C, write);
    }
  }
  body(static_cast<const acc_t*>(dp), x + first, r1 - r0);
}

// The per-channel sums of chunk [r0, r1) of ChannelsLast sample n, into `partial` (3 x C).
template <typename T>
void chunk_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t n,
    int64_t r0, int64_t r1, double* partial, std::vector<at::opmath_type<T>>& buf,
    at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C;
  const at::opmath_type<T>* mc = &k.mean[n * C];
  for_each_dp_chunk(ep, dy, x, n * sh.S * C, r0, r1, C, k, n, /*write=*/true, buf,
      [&](const auto* dp, const T* xr, int64_t rows) {
        reduce_channels<3>(xr, dp, 0, rows, C, partial,
            [mc](auto& acc, const Vec& xv, const Vec& dpv, int64_t c0, int64_t count) {
              accumulate_grad_sums(acc, dpv, xv - Vec::loadu(mc + c0, count));
            });
      },
      cache, cache_origin);
}

// dx of chunk [r0, r1) of ChannelsLast sample n.
template <typename T>
void chunk_grad_input(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t n,
    int64_t r0, int64_t r1, std::vector<at::opmath_type<T>>& buf, at::opmath_type<T>* cache = nullptr,
    int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C, first = (n * sh.S + r0) * C;
  for_each_dp_chunk(ep, dy, x, n * sh.S * C, r0, r1, C, k, n, /*write=*/false, buf,
      [&](const auto* dp, const T* xr, int64_t rows) {
        for (int64_t r = 0; r < rows; ++r) {
          map_row(xr + r * C, dp + r * C, dx + first + r * C, C,
              [&](const Vec& xv, const Vec& dpv, int64_t c0) {
                const int64_t count = std::min<int64_t>(Vec::size(), C - c0);
                const int64_t nc = n * C + c0;
                return at::vec::fmadd(Vec::loadu(&k.a[nc], count), dpv,
                    at::vec::fmadd(Vec::loadu(&k.b[nc], count), xv - Vec::loadu(&k.mean[nc], count),
                        Vec::loadu(&k.e[nc], count)));
              });
        }
      },
      cache, cache_origin);
}

// The sums of row (n, c) = nc of a ChannelsFirst input (dp through `cache` as for_each_dp_run).
template <typename T>
void channel_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t nc,
    GradSums& out, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const Vec m(k.mean[nc]);
  std::array<double, 3> sums{};
  for_each_dp_run(ep, dy, x, nc * sh.S, sh.S, k.mean[nc], k.a[nc], k.pc[nc], /*write=*/true,
      [&](const auto* dp, const T* xr, int64_t len) {
        const auto part = reduce_row<3>(xr, dp, len,
            [&m](auto& acc, const Vec& xv, const Vec& dpv, int64_t count) {
              // Padding lanes hold dp = x = 0: only x - m needs masking.
              accumulate_grad_sums(acc, dpv, first_lanes(xv - m, count));
            });
        for (int i = 0; i < 3; ++i) sums[i] += part[i];
      },
      cache, cache_origin);
  out.db[nc] = sums[0];
  out.dsc[nc] = sums[1];
  out.dev[nc] = sums[2];
}

// dx of row nc of a ChannelsFirst input.
template <typename T>
void channel_grad_input(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t nc,
    at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const Vec a(k.a[nc]), b(k.b[nc]), e(k.e[nc]), m(k.mean[nc]);
  for_each_dp_run(ep, dy, x, nc * sh.S, sh.S, k.mean[nc], k.a[nc], k.pc[nc], /*write=*/false,
      [&](const auto* dp, const T* xr, int64_t len) {
        map_row(xr, dp, dx + (xr - x), len, [&](const Vec& xv, const Vec& dpv, int64_t) {
          return at::vec::fmadd(a, dpv, at::vec::fmadd(b, xv - m, e));
        });
      },
      cache, cache_origin);
}

// The lanes' sums of Vec::size() vectors at once: lane j of the result sums the lanes of
// v[bit_reverse(j)]. Each step interleaves pairs of vectors lane by lane (at::vec::interleave2)
// and adds the two halves, halving the vectors and doubling the period of their rows' pattern.
template <typename Vec>
Vec transpose_sum(std::array<Vec, Vec::size()> v) {
  for (int n = Vec::size(); n > 1; n /= 2) {
    for (int i = 0; i < n / 2; ++i) {
      const auto halves = at::vec::interleave2(v[2 * i], v[2 * i + 1]);
      v[i] = halves.first + halves.second;
    }
  }
  return v[0];
}

// j with its log2(n) low bits in reverse order.
constexpr int bit_reverse(int j, int n) {
  int r = 0;
  for (int bit = 1; bit < n; bit <<= 1) r = (r << 1) | ((j & bit) ? 1 : 0);
  return r;
}

// The row whose sums transpose_sum leaves in each lane.
template <int L>
constexpr std::array<int, L> transpose_sum_rows() {
  std::array<int, L> rows{};
  for (int j = 0; j < L; ++j) rows[j] = bit_reverse(j, L);
  return rows;
}

// Rows of at most this many vectors take the backward's sums a block of rows at a time.
constexpr int64_t kShortRowVectors = 4;

template <typename T>
bool short_rows(const GroupNormShape& sh) {
  return sh.S <= kShortRowVectors * VecIO<T>::kSize;
}

// The ChannelsFirst sums of rows [first, first + Vec::size()) that lie below `rows`, rows of at
// most kShortRowVectors vectors: each row's three sums in one vector each, then the lanes of the
// block's rows summed together (transpose_sum), in place of three horizontal sums a row. Those,
// with reduce_row's set-up, were a fixed ~90 cycles a row: (8, 1280, 16) took 4x ATen's time,
// (2, 1280, 8, 8) 2.2x (one thread, CPU sixteenth run). Every lane of transpose_sum adds its
// row's lanes in the same tree, so a row's sums depend neither on its place in the block nor on
// the block's other rows (absent ones are zeros): any split over threads, and blocks aligned to
// groups or not, give the same bits. With an epilogue, the block's dp is made first (into
// `cache` as for_each_dp_run), in one backward_run with each row's coefficients spread over its
// elements: the same values as channel_grad_sums makes row by row, without a call a row.
template <typename T>
void short_rows_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t first, int64_t rows,
    GradSums& out, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  constexpr int L = Vec::size();
  std::array<Vec, L> db, dsc, dev;
  const int64_t present = std::min<int64_t>(L, rows - first), len = present * sh.S, o_first = first * sh.S;
  acc_t block_dp[kShortRowVectors * L * L];
  acc_t* const dp_first = cache != nullptr ? cache + (o_first - cache_origin) : block_dp;
  if (ep.active()) {
    acc_t centre[kShortRowVectors * L * L], pa[kShortRowVectors * L * L], pc[kShortRowVectors * L * L];
    for (int64_t r = 0; r < present; ++r) {
      const int64_t nc = first + r;
      std::fill_n(centre + r * sh.S, sh.S, k.mean[nc]);
      std::fill_n(pa + r * sh.S, sh.S, k.a[nc]);
      std::fill_n(pc + r * sh.S, sh.S, k.pc[nc]);
    }
    ep.template backward_run<true>(dy + o_first, x + o_first, o_first, len, centre, pa, pc, dp_first, /*write=*/true);
  }
  for (int r = 0; r < L; ++r) {
    std::array<Vec, 3> acc{Vec(0), Vec(0), Vec(0)};
    if (r < present) {
      const int64_t nc = first + r, o = nc * sh.S;
      const Vec m(k.mean[nc]);
      const acc_t* dp = dp_first + r * sh.S;
      IO::for_each_vector(sh.S, [&](int64_t i, int64_t count) {
        // Padding lanes hold dp = x = 0: only x - m needs masking.
        const Vec dpv = ep.active() ? Vec::loadu(dp + i, count) : IO::load(dy + o + i, count);
        accumulate_grad_sums(acc, dpv, first_lanes(IO::load(x + o + i, count) - m, count));
      });
    }
    db[r] = acc[0];
    dsc[r] = acc[1];
    dev[r] = acc[2];
  }
  acc_t lanes[3][L];
  transpose_sum(db).store(lanes[0]);
  transpose_sum(dsc).store(lanes[1]);
  transpose_sum(dev).store(lanes[2]);
  static constexpr std::array<int, L> kRows = transpose_sum_rows<L>();
  for (int j = 0; j < L; ++j) {
    if (kRows[j] < present) {
      const int64_t nc = first + kRows[j];
      out.db[nc] = lanes[0][j];
      out.dsc[nc] = lanes[1][j];
      out.dev[nc] = lanes[2][j];
    }
  }
}

template <typename T>
void grad_sums_channels_first(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& out) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sh.S, 1));
  constexpr int64_t L = VecIO<T>::kSize;
  if (short_rows<T>(sh)) {
    const int64_t rows = sh.N * sh.C;
    at::parallel_for(0, (rows + L - 1) / L, std::max<int64_t>(1, grain / L), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) short_rows_grad_sums(dy, x, sh, k, ep, b * L, rows, out);
    });
    return;
  }
  at::parallel_for(0, sh.N * sh.C, grain, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) channel_grad_sums(dy, x, sh, k, ep, nc, out);
  });
}

// The ChannelsFirst sums and dx group by group, for an epilogue whose dp is worth computing once:
// a group's dp (D * S values, at most kMaxGroupDpBytes) goes into a per-thread buffer in the sums'
// pass and is read back by the dx pass, the group's coefficients computed in between (with the
// same arithmetic as the two-pass path, so the results are the same bits).
constexpr int64_t kMaxGroupDpBytes = 512 * 1024;

template <typename T>
void backward_groups_channels_first(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w_eff, const at::opmath_type<T>* rstd,
    GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& sums) {
  using acc_t = at::opmath_type<T>;
  const int64_t M = sh.D * sh.S;
  at::parallel_for(0, sh.N * sh.G, std::max<int64_t>(1, 32768 / std::max<int64_t>(M, 1)), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> group_dp(M);
    for (int64_t ng = begin; ng < end; ++ng) {
      const int64_t rows_end = (ng + 1) * sh.D;
      if (short_rows<T>(sh)) {
        for (int64_t nc = ng * sh.D; nc < rows_end; nc += VecIO<T>::kSize) {
          short_rows_grad_sums(dy, x, sh, k, ep, nc, rows_end, sums, group_dp.data(), ng * M);
        }
      } else {
        for (int64_t nc = ng * sh.D; nc < rows_end; ++nc) {
          channel_grad_sums(dy, x, sh, k, ep, nc, sums, group_dp.data(), ng * M);
        }
      }
      const double delta = recentre_group(sh, ng, sums);
      grad_input_coeffs_group(sh, ng, w_eff, rstd, sums, delta, k);
      for (int64_t nc = ng * sh.D; nc < (ng + 1) * sh.D; ++nc) {
        channel_grad_input(dy, x, dx, sh, k, ep, nc, group_dp.data(), ng * M);
      }
    }
  });
}

// The backward sums of sample n from its per-chunk partials [chunks][3][C], added in chunk order.
void sample_grad_totals(const double* partial, const GroupNormShape& sh, int64_t n, GradSums& out) {
  const int64_t C = sh.C, chunks = num_chunks(sh);
  for (int64_t c = 0; c < C; ++c) {
    double t[3] = {0, 0, 0};
    for (int64_t k = 0; k < chunks; ++k)
      for (int j = 0; j < 3; ++j) t[j] += partial[(k * 3 + j) * C + c];
    out.db[n * C + c] = t[0];
    out.dsc[n * C + c] = t[1];
    out.dev[n * C + c] = t[2];
  }
}

template <typename T>
void grad_sums_channels_last(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& out) {
  const int64_t C = sh.C, chunks = num_chunks(sh);
  std::vector<double> partial(sh.N * chunks * 3 * C);
  for_each_chunk(sh, [&](int64_t n, int64_t kk, int64_t r0, int64_t r1) {
    std::vector<at::opmath_type<T>> buf;
    chunk_grad_sums(dy, x, sh, k, ep, n, r0, r1, &partial[(n * chunks + kk) * 3 * C], buf);
  });
  for (int64_t n = 0; n < sh.N; ++n) sample_grad_totals(&partial[n * chunks * 3 * C], sh, n, out);
}

// The ChannelsLast counterpart of backward_groups_channels_first, sample by sample (a group
// spans its sample's rows): a sample's dp (S * C values, at most kMaxSampleDpBytes) is kept
// between the sums and dx. Same chunks and summation order as the two-pass path.
constexpr int64_t kMaxSampleDpBytes = 4 << 20;

template <typename T>
void backward_samples_channels_last(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w_eff, const at::opmath_type<T>* rstd,
    GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& sums) {
  using acc_t = at::opmath_type<T>;
  const int64_t C = sh.C;
  at::parallel_for(0, sh.N, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> sample_dp(sh.S * C), buf;
    std::vector<double> partial(num_chunks(sh) * 3 * C);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t origin = n * sh.S * C;
      for_sample_chunks(sh, [&](int64_t kk, int64_t r0, int64_t r1) {
        chunk_grad_sums(dy, x, sh, k, ep, n, r0, r1, &partial[kk * 3 * C], buf, sample_dp.data(), origin);
      });
      sample_grad_totals(partial.data(), sh, n, sums);
      for (int64_t ng = n * sh.G; ng < (n + 1) * sh.G; ++ng) {
        grad_input_coeffs_group(sh, ng, w_eff, rstd, sums, recentre_group(sh, ng, sums), k);
      }
      for_sample_chunks(sh, [&](int64_t, int64_t r0, int64_t r1) {
        chunk_grad_input(dy, x, dx, sh, k, ep, n, r0, r1, buf, sample_dp.data(), origin);
      });
    }
  });
}

template <typename T>
void grad_input_channels_first(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sh.S, 1));
  at::parallel_for(0, sh.N * sh.C, grain, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) channel_grad_input(dy, x, dx, sh, k, ep, nc);
  });
}

template <typename T>
void grad_input_channels_last(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep) {
  for_each_chunk(sh, [&](int64_t n, int64_t, int64_t r0, int64_t r1) {
    std::vector<at::opmath_type<T>> buf;
    chunk_grad_input(dy, x, dx, sh, k, ep, n, r0, r1, buf);
  });
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

// S == 1: each group (n, g) is one contiguous run of D channels of one element each (both layouts
// are the same memory). The per-(n, c) sums of the general path would be the elements themselves,
// materialised three times over in double (slow: page faults on hundreds of MB for a (1024, 8192)
// input), so this path keeps per-group sums only (phase 1, parallel over groups) and sums the
// parameter gradients per channel over the batch (phase 2, parallel over blocks of channels, the
// batch in order: deterministic). Both phases work in vectors of opmath values: phase 1 sums runs of
// at most kBlock elements in vector lanes before moving to double (as reduce_row), phase 2 sums the
// parameter gradients of kSampleBlock samples per channel in opmath before adding them to double
// totals. The batch goes through both phases a block of samples at a time (a multiple of
// kSampleBlock, ~kDpBlockElements elements; at most the input's size). With an elementwise
// epilogue phase 1 keeps the block's dp for phase 2 instead of making it again (the residual's
// and multiplier's loads, the activation); without one dp is dy, read in place by both phases.
// The results are bit for bit those of making dp twice; problem 3's tail backward (256, 8192)
// took 4-15% less time on the 2-core development machine, in interleaved runs. Where nothing is
// summed over the batch (no grad_weight or grad_bias: problem 3's tail), each group's phase 2
// follows its phase 1 at once instead, while the group's x and dp are in cache: the same
// arithmetic (the same bits), one pass over memory instead of two (the tail's fused backward
// 1.7-1.9 -> 1.3-1.5 ms, the plain one 0.9-1.0 -> 0.7-0.8 on that machine).
constexpr int64_t kSampleBlock = 64;
constexpr int64_t kDpBlockElements = 1 << 20;

template <typename T>
void backward_one_element_per_channel(const T* dy, const T* x, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w, const std::vector<at::opmath_type<T>>& b,
    const Modulation<at::opmath_type<T>>& mod, bool uniform, const at::opmath_type<T>* mean,
    const at::opmath_type<T>* rstd, const ElementwiseOperands<T>& ep, T* dx, FusedGrads& grads) {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  const int64_t C = sh.C, D = sh.D, G = sh.G;
  const double M = static_cast<double>(D);

  // Phase 1's per-element coefficients of elements [c0, c0 + len) of sample n (len <= kBlock) and,
  // with an elementwise epilogue, dp into dp_out (len values). Without one dp is dy, read in place
  // by both phases (a copy of it cost a write and a read of the input's size).
  struct Run {
    std::vector<acc_t> centre, pa, pc, w_eff, r;
    Run() {
      for (auto* v : {&centre, &pa, &pc, &w_eff, &r}) v->resize(kBlock);
    }
    void fill(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t n, int64_t c0,
        int64_t len, const GroupNormShape& sh, const std::vector<acc_t>& w,
        const std::vector<acc_t>& b, const Modulation<acc_t>& mod, const acc_t* mean,
        const acc_t* rstd, acc_t* dp_out) {
      // The group's statistics: phase 1 walks group by group, so the block lies in one group.
      // rstd only for p's coefficients.
      const int64_t ng = n * sh.G + c0 / sh.D;
      std::fill(centre.begin(), centre.begin() + len, mean[ng]);
      if (ep.active()) std::fill(r.begin(), r.begin() + len, rstd[ng]);
      const int64_t nc0 = n * sh.C + c0;
      for (int64_t i = 0; i < len; i += IO::kSize) {
        const int64_t count = std::min<int64_t>(IO::kSize, len - i);
        const Vec gv = mod.gain.empty() ? Vec(1) : Vec::loadu(&mod.gain[nc0 + i], count);
        const Vec we = Vec::loadu(&w[c0 + i], count) * gv;
        we.store(&w_eff[i], count);
        if (ep.active()) {  // p's coefficients, for dp
          (we * Vec::loadu(&r[i], count)).store(&pa[i], count);
          const Vec sv = mod.shift.empty() ? Vec(0) : Vec::loadu(&mod.shift[nc0 + i], count);
          at::vec::fmadd(Vec::loadu(&b[c0 + i], count), gv, sv).store(&pc[i], count);
        }
      }
      if (ep.active()) {
        const int64_t o = n * sh.C + c0;
        ep.template backward_run<true>(dy + o, x + o, o, len, centre.data(), pa.data(), pc.data(), dp_out, /*write=*/true);
      }
    }
  };
  // Lanes past `count` load as zeros (coefficients and dp), so they add nothing below.
  auto lanes = [](const std::vector<acc_t>& v, int64_t i, int64_t count) { return Vec::loadu(v.data() + i, count); };

  std::vector<double> A(sh.N * G), B(sh.N * G), delta(sh.N * G);
  std::vector<acc_t> K1(sh.N * G), K2(sh.N * G);
  std::vector<double> dw(C, 0.0), dbias(C, 0.0);
  // Phase 2's per-channel sums only where grad_weight or grad_bias is wanted (not in problem 3's
  // tail, which has neither parameter).
  const bool want_params = grads.weight.numel() > 0 || grads.bias.numel() > 0;
  // grad_scale / grad_shift are written in acc_t, then converted to their dtypes (the scale's and
  // shift's) where those differ.
  const auto acc_opts = grads.scale.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  auto acc_buffer = [&](const at::Tensor& out) {
    return out.numel() == 0 || out.scalar_type() == acc_opts.dtype() ? out : at::empty(out.sizes(), acc_opts);
  };
  at::Tensor dscale_acc = acc_buffer(grads.scale), dshift_acc = acc_buffer(grads.shift);
  acc_t* dscale = grads.scale.numel() > 0 ? dscale_acc.data_ptr<acc_t>() : nullptr;
  acc_t* dshift = grads.shift.numel() > 0 ? dshift_acc.data_ptr<acc_t>() : nullptr;

  // `count` values of dp at element o: entry i of dp_group (the group's dp, with an epilogue), or
  // dy's without one (dp_group unused).
  auto dp_lanes = [&](const acc_t* dp_group, int64_t i, int64_t o, int64_t count) {
    return ep.active() ? Vec::loadu(dp_group + i, count) : IO::load(dy + o, count);
  };

  // Phase 1 of group ng: A = sum w_eff * dp, B = sum w_eff * dp * (x - m), delta = mean(x - m),
  // and K1, K2 (dx = w_eff * rstd * dp + K1 * (x - m) + K2); with an epilogue, the group's D
  // values of dp into dp_group.
  auto group_sums = [&](int64_t ng, Run& run, acc_t* dp_group) {
    const int64_t n = ng / G, g = ng % G;
    double a = 0, bsum = 0, dev = 0;
    for (int64_t start = 0; start < D; start += kBlock) {
      const int64_t len = std::min(kBlock, D - start), c0 = g * D + start;
      const int64_t o = n * C + c0;
      const acc_t centre = mean[ng];  // the block lies in one group
      acc_t* dp_out = ep.active() ? dp_group + start : nullptr;
      Vec va(0), vb(0), vdev(0);
      if (uniform && ep.active()) {
        // w_eff = 1, pa = rstd, pc = 0 for every channel: dp from the group's values as
        // broadcasts, with no per-element arrays (the arrays' values exactly: the same bits), and
        // its sums in the same pass.
        const acc_t pa = rstd[ng], pc = 0;
        typename ElementwiseOperands<T>::RunSums rs;
        ep.template backward_run<false, true>(dy + o, x + o, o, len, &centre, &pa, &pc, dp_out, true, &rs);
        va = rs.dp;
        vb = rs.dp_xc;
        vdev = rs.xc;
      } else {
        if (!uniform) run.fill(ep, dy, x, n, c0, len, sh, w, b, mod, mean, rstd, dp_out);
        const Vec cv(centre);
        for (int64_t i = 0; i < len; i += IO::kSize) {
          const int64_t count = std::min<int64_t>(IO::kSize, len - i);
          const Vec xc = first_lanes(IO::load(x + o + i, count) - cv, count);  // padding lanes add nothing
          const Vec dp = dp_lanes(dp_group, start + i, o + i, count);
          const Vec wdp = uniform ? dp : lanes(run.w_eff, i, count) * dp;
          va += wdp;
          vb = at::vec::fmadd(wdp, xc, vb);
          vdev += xc;
        }
      }
      a += horizontal_sum(va);
      bsum += horizontal_sum(vb);
      dev += horizontal_sum(vdev);
    }
    delta[ng] = M > 0 ? dev / M : 0.0;
    A[ng] = a;
    B[ng] = bsum - delta[ng] * a;
    const double r = rstd[ng];
    const double b1 = -r * r * r / M * B[ng];
    K1[ng] = static_cast<acc_t>(b1);
    K2[ng] = static_cast<acc_t>(-r / M * A[ng] - b1 * delta[ng]);
  };

  // Phase 2 for channels [c0, c1) of group g of sample n: dx, grad_scale, grad_shift, and with
  // pw / pb (indexed from c0) the parameter gradients' sums. The group's statistics and K1, K2,
  // delta are vectors of one value: made element by element into arrays (with the per-channel
  // coefficients, as phase 1 makes them), they took most of this phase.
  auto channel_outputs = [&](int64_t n, int64_t g, int64_t c0, int64_t c1, const acc_t* dp_group, acc_t* pw,
                             acc_t* pb) {
    const int64_t ng = n * G + g;
    const Vec centre(mean[ng]), r(rstd[ng]), k1(K1[ng]), k2(K2[ng]), delta_g(static_cast<acc_t>(delta[ng]));
    for (int64_t c = c0; c < c1; c += IO::kSize) {
      const int64_t count = std::min<int64_t>(IO::kSize, c1 - c), o = n * C + c;
      // Lanes past `count` hold garbage from the broadcasts but are never stored, and dp loads as
      // zero there.
      const Vec gain = mod.gain.empty() ? Vec(1) : Vec::loadu(&mod.gain[o], count);
      const Vec xc = IO::load(x + o, count) - centre;
      const Vec dp = dp_lanes(dp_group, c - g * D, o, count);
      // sum_s dp * xhat for this (n, c): dp * ((x - m) - delta) * rstd.
      const Vec xhat_sum = dp * (xc - delta_g) * r;
      if (want_params) {
        const int64_t p = c - c0;
        at::vec::fmadd(gain, xhat_sum, Vec::loadu(pw + p, count)).store(pw + p, count);
        at::vec::fmadd(gain, dp, Vec::loadu(pb + p, count)).store(pb + p, count);
      }
      if (dscale) {
        const Vec ws = at::vec::fmadd(Vec::loadu(w.data() + c, count), xhat_sum,
            Vec::loadu(b.data() + c, count) * dp);
        ws.store(dscale + o, count);
      }
      if (dshift) dp.store(dshift + o, count);
      if (dx != nullptr) {
        const Vec pa = Vec::loadu(w.data() + c, count) * gain * r;  // w_eff * rstd
        IO::store(dx + o, at::vec::fmadd(pa, dp, at::vec::fmadd(k1, xc, k2)), count);
      }
    }
  };

  const int64_t group_grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1));
  if (!want_params && D <= kDpBlockElements && sh.N * G >= at::get_num_threads()) {
    // No sums over the batch: each group's phase 2 follows its phase 1 at once, while its x and dp
    // are in cache, so that x, dy and the operands cross memory once (problem 3's tail).
    at::parallel_for(0, sh.N * G, group_grain, [&](int64_t begin, int64_t end) {
      Run run;
      std::vector<acc_t> dp_group(ep.active() ? D : 0);
      for (int64_t ng = begin; ng < end; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        group_sums(ng, run, dp_group.data());
        channel_outputs(n, g, g * D, (g + 1) * D, dp_group.data(), nullptr, nullptr);
      }
    });
  } else {
    // Samples per block, a multiple of kSampleBlock (phase 2 adds its opmath sums to the double
    // totals every kSampleBlock samples, in order), and the block's dp (with an epilogue).
    const int64_t block = kSampleBlock * std::max<int64_t>(1, kDpBlockElements / (kSampleBlock * std::max<int64_t>(C, 1)));
    std::vector<acc_t> dp_block(ep.active() ? std::min(block, sh.N) * C : 0);
    for (int64_t n0 = 0; n0 < sh.N; n0 += block) {
      const int64_t n1 = std::min(sh.N, n0 + block);
      // The dp of group g of sample n, within the block (with an epilogue).
      auto dp_of = [&](int64_t n, int64_t g) { return ep.active() ? dp_block.data() + (n - n0) * C + g * D : nullptr; };
      at::parallel_for(n0 * G, n1 * G, group_grain, [&](int64_t begin, int64_t end) {
        Run run;
        for (int64_t ng = begin; ng < end; ++ng) group_sums(ng, run, dp_of(ng / G, ng % G));
      });
      // Phase 2, parallel over channels, the block's samples in order: the parameter gradients
      // summed over the batch per channel, deterministically.
      at::parallel_for(0, C, 512, [&](int64_t cbegin, int64_t cend) {
        // This thread's channels' parameter-gradient sums over the current block of samples.
        std::vector<acc_t> pw(want_params ? cend - cbegin : 0, acc_t(0)), pb(want_params ? cend - cbegin : 0, acc_t(0));
        for (int64_t n = n0; n < n1; ++n) {
          // Runs of channels of one group.
          for (int64_t c0 = cbegin, g = cbegin / D; c0 < cend; c0 = std::min(cend, (++g) * D)) {
            const int64_t c1 = std::min(cend, (g + 1) * D);
            acc_t* pw_c0 = want_params ? pw.data() + (c0 - cbegin) : nullptr;
            acc_t* pb_c0 = want_params ? pb.data() + (c0 - cbegin) : nullptr;
            channel_outputs(n, g, c0, c1, dp_of(n, g), pw_c0, pb_c0);
          }
          if (want_params && ((n + 1) % kSampleBlock == 0 || n + 1 == sh.N)) {
            for (int64_t c = cbegin; c < cend; ++c) {
              dw[c] += pw[c - cbegin];
              dbias[c] += pb[c - cbegin];
            }
            std::fill(pw.begin(), pw.end(), acc_t(0));
            std::fill(pb.begin(), pb.end(), acc_t(0));
          }
        }
      });
    }
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  if (grads.weight.numel() > 0) grads.weight.copy_(at::from_blob(dw.data(), {C}, f64));
  if (grads.bias.numel() > 0) grads.bias.copy_(at::from_blob(dbias.data(), {C}, f64));
  if (!dscale_acc.is_same(grads.scale)) grads.scale.copy_(dscale_acc);
  if (!dshift_acc.is_same(grads.shift)) grads.shift.copy_(dshift_acc);
}

FusedGrads fused_backward_cpu(const at::Tensor& grad_out, const at::Tensor& input,
    const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
    const GroupNormShape& sh, Layout layout, const at::Tensor& x, const Epilogue& epilogue,
    const FusedGradMask& mask, bool sum_residual_multiplier_grads = false) {
  const at::Tensor dy = to_layout(grad_out, layout);
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  FusedGrads grads = empty_fused_grads(x, sh, layout, mask, weight, bias, epilogue, sum_residual_multiplier_grads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "group_norm_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* mp = mean_c.data_ptr<acc_t>();
    const acc_t* rp = rstd_c.data_ptr<acc_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const auto w = param_or<acc_t>(weight, sh.C, acc_t(1));
    const auto b = param_or<acc_t>(bias, sh.C, acc_t(0));
    const Modulation<acc_t> mod(epilogue);
    ElementwiseOperands<scalar_t> ep(epilogue, mask[6]);
    if (mask[5]) ep.grad_residual = grads.residual.data_ptr<scalar_t>();
    if (mask[6]) ep.grad_multiplier = grads.multiplier.data_ptr<scalar_t>();
    if (sh.S == 1) {
      // No per-channel coefficient: no weight, bias, scale or shift.
      const bool uniform = !(weight && weight->defined()) && !(bias && bias->defined()) && mod.gain.empty() &&
          mod.shift.empty();
      backward_one_element_per_channel(dyp, xp, sh, w, b, mod, uniform, mp, rp, ep,
          mask[0] ? grads.input.data_ptr<scalar_t>() : nullptr, grads);
      return;
    }

    GradSums sums(sh.N * sh.C);
    std::vector<acc_t> w_eff(sh.N * sh.C);
    for (int64_t n = 0; n < sh.N; ++n)
      for (int64_t c = 0; c < sh.C; ++c) w_eff[n * sh.C + c] = w[c] * mod.gain_at(n * sh.C + c);

    GradInputCoeffs<acc_t> k = pre_activation_coeffs<acc_t>(sh, w_eff, b, mod, mp, rp);
    if (layout == Layout::ChannelsFirst && ep.active() && mask[0] &&
        sh.D * sh.S * static_cast<int64_t>(sizeof(acc_t)) <= kMaxGroupDpBytes) {
      backward_groups_channels_first(dyp, xp, grads.input.data_ptr<scalar_t>(), sh, w_eff, rp, k, ep, sums);
      param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
      return;
    }
    // (Parallel over samples: only with a sample for every thread. Either path gives the same bits.)
    if (layout == Layout::ChannelsLast && ep.active() && mask[0] && sh.N >= at::get_num_threads() &&
        sh.S * sh.C * static_cast<int64_t>(sizeof(acc_t)) <= kMaxSampleDpBytes) {
      backward_samples_channels_last(dyp, xp, grads.input.data_ptr<scalar_t>(), sh, w_eff, rp, k, ep, sums);
      param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
      return;
    }
    if (layout == Layout::ChannelsFirst) {
      grad_sums_channels_first(dyp, xp, sh, k, ep, sums);
    } else {
      grad_sums_channels_last(dyp, xp, sh, k, ep, sums);
    }
    const std::vector<double> delta = recentre(sh, sums);
    if (mask[0]) {
      grad_input_coeffs<acc_t>(sh, w_eff, rp, sums, delta, k);
      scalar_t* dxp = grads.input.data_ptr<scalar_t>();
      if (layout == Layout::ChannelsFirst) {
        grad_input_channels_first(dyp, xp, dxp, sh, k, ep);
      } else {
        grad_input_channels_last(dyp, xp, dxp, sh, k, ep);
      }
    }
    param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
  });
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, int64_t num_groups,
    std::array<bool, 3> output_mask) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  const Layout layout = layout_for(input);
  const FusedGradMask mask{output_mask[0], output_mask[1], output_mask[2], false, false, false, false};
  FusedGrads g = fused_backward_cpu(grad_out, input, mean, rstd, weight, c10::nullopt, sh, layout,
      to_layout(input, layout), Epilogue{}, mask);
  return {g.input, g.weight, g.bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_group_norm_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    std::array<bool, 7> output_mask, bool sum_residual_multiplier_grads) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  check_group_norm_args(input, num_groups, weight, bias);
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep =
      make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
  const FusedGrads g = fused_backward_cpu(grad_out, input, mean, rstd, weight, bias, sh, layout, x, ep,
      kernel_grad_mask(output_mask, sum_residual_multiplier_grads), sum_residual_multiplier_grads);
  return fused_grads_outputs(g, sum_residual_multiplier_grads);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("group_norm_forward", &group_norm_forward_cpu);
  m.impl("group_norm_backward", &group_norm_backward_cpu);
  m.impl("fused_group_norm_forward", &fused_group_norm_forward_cpu);
  m.impl("fused_group_norm_backward", &fused_group_norm_backward_cpu);
}

}  // namespace fusednorm
