// Loads, stores and row loops on at::vec vectors of opmath values (float, or double for double):
// the building blocks of the CPU kernels' passes over memory (docs/design.md, 'CPU kernels').
// Compiled once per CPU capability: at::vec's width follows CPU_CAPABILITY.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// Elements summed in vector lanes before the running total moves to double.
constexpr int64_t kBlock = 4096;

// On a per-element loop: everything it calls is inlined into it. GCC's inliner otherwise gives up
// on ATen's vector math (exp_u20, erf) once a translation unit's instantiations grow, and a call
// per vector made the GN+SiLU forward 35% slower (docs/design.md, 'CPU kernels').
#if defined(__GNUC__)
#define FUSEDNORM_FLATTEN __attribute__((flatten))
#else
#define FUSEDNORM_FLATTEN
#endif

// The portable x86 build: ATen's generic vectors (each operation a loop over the lanes) at -O2
// (setup.py, PORTABLE_BESIDE_WIDER_FLAGS). GCC left those loops and the row loops' lambdas out of
// line there, and stored a run-time count of lanes with a memcpy call: its plain backward took
// 2.3x, its fused ReLU forward 3.5x the time they take with the row loops flattened
// (FUSEDNORM_PORTABLE_FLATTEN) and whole vectors stored without a count (docs/design.md, "CPU
// capabilities"). The AVX builds inline all of it at -O3 unasked; their code does not change.
#if defined(CPU_CAPABILITY_DEFAULT) && (defined(__x86_64__) || defined(__i386__))
#define FUSEDNORM_GENERIC_VECTORS 1
#define FUSEDNORM_PORTABLE_FLATTEN FUSEDNORM_FLATTEN
#else
#define FUSEDNORM_GENERIC_VECTORS 0
#define FUSEDNORM_PORTABLE_FLATTEN
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

#if defined(CPU_CAPABILITY_AVX512)
// The first `count` (< 16) values widened to float, zeros past them: a masked load (AVX512BW) and
// ATen's conversion of a whole vector. The element loop through a buffer that the other builds
// take made a 49-element row's tail cost about as much as its three whole vectors: the
// (64,64,7,7) bfloat16 forward took 1.4x eager's time (docs/design.md, "CPU kernels").
inline at::vec::Vectorized<float> load_widened_partial(const c10::BFloat16* p, int64_t count) {
  __m512 out;
  at::vec::cvtbf16_fp32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), p), out);
  return out;
}
inline at::vec::Vectorized<float> load_widened_partial(const c10::Half* p, int64_t count) {
  __m512 out;
  at::vec::cvtfp16_fp32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), p), out);
  return out;
}
#endif

// Loads and stores between T and vectors of opmath_type<T>. bfloat16 and half convert a whole
// vector at a time with ATen's conversions (round to nearest even, as c10's scalar conversion);
// converting element by element through a buffer made the bfloat16 channels-last forward 3-4x
// ATen's time. Partial vectors (row tails) are a masked load or store of a whole vector's
// conversion under AVX512 (load_widened_partial), an element loop elsewhere.
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
#if defined(CPU_CAPABILITY_AVX512)
      return load_widened_partial(p, count);
#else
      acc_t buf[kSize] = {};
      for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<acc_t>(p[i]);
      return Vec::loadu(buf);
#endif
    }
  }

  static void store(T* p, const Vec& v, int64_t count = kSize) {
    if constexpr (std::is_same_v<T, acc_t>) {
      v.store(p, count);
    } else if (count == kSize) {
      // Both halves of the reduced vector hold v; its first kSize values are stored.
      at::vec::convert_from_float<T>(v, v).store(p, kSize);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      // A masked store of the whole vector's conversion (AVX512BW), as load_widened_partial: the
      // same rounding as the element loop's, and a NaN gets the whole vectors' NaN.
      at::vec::convert_from_float<T>(v, v).store(p, count);
#else
      acc_t buf[kSize];
      v.store(buf);
      for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(buf[i]);
#endif
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
// A lane mask (lane index < count) and a bitwise and: ATen's Vectorized::set is a switch over
// count, which GCC left as a call through a jump table; the short-row sums of the (64,64,7,7)
// backward took 1.45x their time with it (docs/design.md, "CPU kernels").
template <typename Vec>
Vec first_lanes(const Vec& v, int64_t count) {
  using V = typename Vec::value_type;
  return count < Vec::size() ? v & (Vec::arange(V(0), V(1)) < Vec(static_cast<V>(count))) : v;
}

// The lanes' sum, by ATen's shuffle tree in opmath. Adding the lanes one by one in double was a
// chain of 16 dependent additions, which dominated groups and rows of a few vectors: (4096, 512)
// with G = 32 forward 6.4 -> 4.4 ms, the (64, 512, 16) backward 1.41 -> 1.05-1.20 ms
// (docs/design.md, 'CPU kernels'). The lanes are opmath sums already; the tree adds at most
// log2(lanes) roundings.
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
FUSEDNORM_PORTABLE_FLATTEN std::array<double, K> reduce_row(const T* x, const Y* y, int64_t n, F f) {
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

// The lanes of an opmath vector as double vectors, in order: one for double, two for float.
// ATen's vectors in torch 2.1 have no float -> double conversion, and going through memory (lanes
// converted and stored one by one, then loaded as a vector) stalls on store forwarding: that
// made the bfloat16 channels-last moments 4-7% slower where float32 gained (docs/design.md,
// "Measured and not kept").
template <typename acc_t>
using DoubleParts = std::array<at::vec::Vectorized<double>,
    at::vec::Vectorized<acc_t>::size() / at::vec::Vectorized<double>::size()>;

template <typename acc_t>
inline DoubleParts<acc_t> widen_to_double(const at::vec::Vectorized<acc_t>& v) {
  using DVec = at::vec::Vectorized<double>;
  if constexpr (std::is_same_v<acc_t, double>) {
    return {v};
  } else {
    static_assert(std::is_same_v<acc_t, float> && at::vec::Vectorized<float>::size() == 2 * DVec::size());
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 f = v;
    return {DVec(_mm512_cvtps_pd(_mm512_castps512_ps256(f))),
            DVec(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))))};
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 f = v;
    return {DVec(_mm256_cvtps_pd(_mm256_castps256_ps128(f))), DVec(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)))};
#else
    float lanes[2 * DVec::size()];
    v.store(lanes);
    double wide[2 * DVec::size()];
    for (int i = 0; i < 2 * DVec::size(); ++i) wide[i] = lanes[i];
    return {DVec::loadu(wide), DVec::loadu(wide + DVec::size())};
#endif
  }
}

// Applies out[i] = f(x[i], y[i], i) over a contiguous row. bfloat16 / half go two float vectors
// at a time, so that each store is one whole reduced-precision vector.
template <typename T, typename Y = T, typename F>
FUSEDNORM_PORTABLE_FLATTEN void map_row(const T* x, const Y* y, T* out, int64_t n, F f) {
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

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
