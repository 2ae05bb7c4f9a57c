// CUDA kernels of fusednorm::group_norm_forward / group_norm_backward and of their fused variants
// fused_group_norm_forward / fused_group_norm_backward (the epilogue of epilogue.h).
//
// The input is viewed as (N, C, S) with G groups of D = C / G channels (group_norm.h), stored in
// one of two layouts that the kernels read and write in place, as a contiguous matrix:
//   ChannelsFirst: rows (n, c) of S elements;  ChannelsLast: rows (n, s) of C elements.
//
// Forward (2 reads of x, 1 write of y; three launches):
//   1. reduce:   tiles of the tensor write partial moments (count, mean, M2) of x - K, K being the
//                first element of the group (so the mean of a group at 1e4 with std 1 keeps its
//                digits, and a constant group gives exactly M2 = 0). ChannelsFirst: a group is one
//                contiguous run of D*S elements, split into chunks. ChannelsLast: a tile is
//                (sample, chunk of rows, block of channels); each channel column is reduced over
//                the rows, then neighbouring columns of one group are merged into a "piece".
//   2. finalize: one warp or one CTA per (n, g) merges its partials in a fixed order.
//   3. apply:    y = ((x - K) - mean') * (rstd * w[c]) + b[c], coefficients hoisted out of the
//                element loops (per row in ChannelsFirst, per column in ChannelsLast).
// Backward (2 reads of x and dy, 1 write of dx; up to four launches):
//   1. reduce:   per (n, c, chunk) sums of dy and dy * (x - m) (for the weight/bias gradients), and
//                per (n, piece, chunk) the same weighted by w[c] plus sum(x - m) (for dx).
//   2. finalize per (n, g): the dx coefficients. m is the saved mean, rounded to the stats dtype;
//                delta = mean(x - m) recentres the sums on the true mean, as the CPU kernel does.
//   3. finalize per channel: grad_weight, grad_bias.
//   4. apply:    dx = w[c]*rstd*dy + b1 * ((x - m) - delta) + b2.
//
// The fused epilogue (scale/shift per (n, c), residual, activation, multiplier; epilogue.h) rides
// on the same launches, through `EPI` instantiations of the backward reduce kernels and the
// EpiForward / EpiBackward ones of the apply kernels (ApplyMode); the plain ops use the EPI = false
// and Plain instantiations, i.e. exactly the code above.
//   Forward: the statistics are those of x alone; only the apply pass changes. scale and shift
//     fold into its per-(n, c) coefficients, b = rstd * w * (1 + scale), c = bias * (1 + scale)
//     + shift, so that p = b * ((x - K) - mean') + c + residual and y = act(p) * multiplier.
//   Backward: the plain backward runs on dp = dz * multiplier * act'(p) with the per-(n, c) weight
//     w_eff = w * (1 + scale). The reduce pass makes dp on the fly, recomputing
//     p = rstd * w_eff * (x - m) + pc + residual (pc = bias * (1 + scale) + shift) from the saved
//     statistics, and weights the dx sums by w_eff; the finalize passes are unchanged; the apply
//     pass makes dp again and writes dx, grad_residual = dp and grad_multiplier = dz * act(p).
//     The per-(n, c) sums of dp and dp * (x - m) that the reduce pass leaves for the parameter
//     gradients then give grad_weight, grad_bias, grad_scale and grad_shift in pass 3, through its
//     PER_SAMPLE instantiation when scale is present or grad_scale / grad_shift are wanted (they
//     are per (n, c) and weighted per sample).
//   Which operands are present is a uniform run-time choice (null pointers), not a template
//   parameter. The activation is dispatched once per row in the ChannelsFirst apply pass to an
//   element loop compiled for it (with_activation; a run-time switch per element elsewhere).
//
// Groups that fit in shared memory (ChannelsFirst, 16-byte aligned) skip all of the above:
// group_norm_one_pass.cuh reads them once, in one launch per direction (a cluster of CTAs shares a
// large group in the forward), and group_norm_team.cuh spreads larger ones over the shared memory
// of a team of persistent CTAs, in both directions. The passes above are the path for everything
// else (ChannelsLast, unaligned or odd sizes, double).
//
// Every kernel uses 1-D blocks of kThreads threads and a 1-D grid that strides over tiles, so no
// grid dimension limit is reached, and all indexing is 64-bit. Reductions combine partials in an
// order fixed by the shape (no atomics), so results are reproducible run to run. Temporaries come
// from the caching allocator and nothing synchronises with the host, so the ops can be captured
// in CUDA graphs.

#include "clusters.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <type_traits>

namespace fusednorm {
namespace {

using OptTensor = c10::optional<at::Tensor>;

constexpr int kThreads = 256;
constexpr int kLogThreads = 8;
constexpr int kWarp = 32;
constexpr int kLogWarp = 5;
// Packs (16-byte vectors, or single elements on the scalar path) each thread loads before using
// any of them: memory-level parallelism.
constexpr int kUnroll = 4;
// The most partial results one finalize item merges. Bounds how finely the reduce passes split a
// group (and so the finalize's latency); the reduce passes still get enough CTAs for large inputs.
constexpr int64_t kMaxEntries = 4096;
// The same for the per-channel parameter gradients, reduced by few CTAs when C is small.
constexpr int64_t kMaxParamEntries = 512;
constexpr int kBlocksPerSM = 2048 / kThreads;
// Register cap (65536 / (kThreads * kMinBlocks) = 128) for the kernels that hold a pack of
// channels' worth of state per thread: at least 512 threads per SM keep enough loads in flight.
constexpr int kMinBlocks = 2;
// Values per (n, g) record consumed by the apply pass: hi, lo, rstd, b1, b2 (see Coef).
constexpr int kRec = 5;

template <typename scalar_t>
using acc_type = at::opmath_type<scalar_t>;  // float, or double for double

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a / b for a >= 0, b > 0. GPUs have no 64-bit divider (it is a long software sequence); take
// the 32-bit path whenever both operands fit, which is nearly always.
__device__ __forceinline__ int64_t div_nn(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) {
    return static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
  }
  return a / b;
}

// ---------------------------------------------------------------------------------------------
// Parameters and parameter gradients. Their dtype is the input's or float32 (mixed precision),
// chosen at run time so that kernels are not instantiated once per parameter dtype: they are
// read once per row or column, never per element, so the switch costs nothing.

struct ParamRef {
  const void* ptr;  // null: absent
  at::ScalarType dtype;
};

struct GradRef {
  void* ptr;  // null: not requested
  at::ScalarType dtype;
};

template <typename acc_t>
__device__ __forceinline__ acc_t load_param(const ParamRef& p, int64_t c, acc_t absent) {
  if (p.ptr == nullptr) return absent;
  switch (p.dtype) {
    case at::ScalarType::Double:
      return static_cast<acc_t>(static_cast<const double*>(p.ptr)[c]);
    case at::ScalarType::Half:
      return static_cast<acc_t>(static_cast<float>(static_cast<const at::Half*>(p.ptr)[c]));
    case at::ScalarType::BFloat16:
      return static_cast<acc_t>(static_cast<float>(static_cast<const at::BFloat16*>(p.ptr)[c]));
    default:
      return static_cast<acc_t>(static_cast<const float*>(p.ptr)[c]);
  }
}

template <typename acc_t>
__device__ __forceinline__ void store_grad(const GradRef& p, int64_t c, acc_t v) {
  if (p.ptr == nullptr) return;
  switch (p.dtype) {
    case at::ScalarType::Double:
      static_cast<double*>(p.ptr)[c] = static_cast<double>(v);
      break;
    case at::ScalarType::Half:
      static_cast<at::Half*>(p.ptr)[c] = static_cast<at::Half>(static_cast<float>(v));
      break;
    case at::ScalarType::BFloat16:
      static_cast<at::BFloat16*>(p.ptr)[c] = static_cast<at::BFloat16>(static_cast<float>(v));
      break;
    default:
      static_cast<float*>(p.ptr)[c] = static_cast<float>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Vectorised access. A pack is V consecutive elements, 16 bytes on the vector path (V = 1 on the
// scalar path, taken when a pointer is not 16-byte aligned or the row length is not a multiple of
// V: storage offsets and odd sizes).

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// The pack of z[0..V) rounded to scalar_t. 16-bit packs are built as 32-bit words, two
// elements a conversion: built element by element (a c10::Half or BFloat16 each), a half pack
// of the team forward took nine PRMTs to take the converted pairs apart and put them together
// again before its 16-byte store (SASS). Both round to nearest even, as static_cast does.
template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ Pack<scalar_t, V> round_pack(const acc_t (&z)[V]) {
  Pack<scalar_t, V> p;
  constexpr bool kHalf = std::is_same_v<scalar_t, c10::Half>;
  constexpr bool kBFloat16 = std::is_same_v<scalar_t, c10::BFloat16>;
  if constexpr ((kHalf || kBFloat16) && V % 2 == 0 && std::is_same_v<acc_t, float>) {
    uint32_t words[V / 2];
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      if constexpr (kHalf) {
        const __half2 h = __floats2half2_rn(z[2 * j], z[2 * j + 1]);
        memcpy(&words[j], &h, sizeof(uint32_t));
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(z[2 * j], z[2 * j + 1]);
        memcpy(&words[j], &h, sizeof(uint32_t));
      }
    }
    memcpy(&p, words, sizeof(p));
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = static_cast<scalar_t>(z[j]);
  }
  return p;
}

template <typename scalar_t>
constexpr int pack_width() {
  // 2 doubles per pack buy little over scalar 8-byte loads: doubles take the scalar path only,
  // which saves instantiations.
  return sizeof(scalar_t) >= 8 ? 1 : 16 / static_cast<int>(sizeof(scalar_t));
}

// Loads packs first + u * step for u < nvalid into registers, converted to acc_t; the others
// read as zero. All loads are issued before any is used.
template <int U, int V, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_packs(
    const scalar_t* base, int64_t first, int64_t step, int nvalid, acc_t (&out)[U][V]) {
  const Pack<scalar_t, V>* p = reinterpret_cast<const Pack<scalar_t, V>*>(base);
  Pack<scalar_t, V> raw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nvalid) raw[u] = p[first + u * step];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out[u][j] = u < nvalid ? static_cast<acc_t>(raw[u].v[j]) : acc_t(0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The fused epilogue (epilogue.h), as the EPI instantiations take it. Absent operands are null
// pointers, tested per launch (uniform branches), so that presence does not multiply the
// instantiations; the residual is also null where p is not needed.

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
    m.b = b * gain;
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
// bitwise on an H200, RESULTS.md, twenty-fourth run).
__device__ __forceinline__ float exp_neg_ftz(float p) { return exp2_ftz(p * -1.44269504088896341f); }

// Phi(p) = (1 + erf(p / sqrt2)) / 2, GELU's factor, without erff: Phi(-|p|) = erfc(t) / 2 = 2^s(t),
// t = |p| / sqrt2, s a degree-10 polynomial (one MUFU.EX2), and Phi(|p|) = 1 - Phi(-|p|). erff
// evaluates two polynomials and an exponential and selects: GELU added 26 instructions an
// element to the forward (RESULTS.md, twenty-fourth run), this about 18: the VAE fp16 GELU
// forward went from 1.53x to 1.35x the plain one, the backward from 1.60x to 1.38x (twenty-sixth
// run).
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
// folded bias (both per (n, c)) and center the saved mean.
template <int U, int V, int L, typename scalar_t, typename acc_t>
__device__ __forceinline__ void dz_to_dp(const EpiArgs<scalar_t>& e, const scalar_t* residual,
    const scalar_t* multiplier, int64_t first, int64_t step, int nvalid, const acc_t (&x)[U][V],
    const acc_t (&center)[L], const acc_t (&ea)[L], const acc_t (&pc)[L], acc_t (&d)[U][V]) {
  if (multiplier == nullptr && e.act == Activation::None) return;  // dp = dz (scale only)
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
      d[u][j] = epi_dp<kAnyAct>(e.act, e.slope, x[u][j] - center[l], d[u][j], r[u][j], m[u][j], ea[l], pc[l], false, q);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Reduction states. L lanes: L == 1 folds a whole pack into one state (ChannelsFirst rows, where
// a thread's elements all belong to one row), L == V keeps one state per element of the pack
// (ChannelsLast, where element j of a pack is channel c0 + j).

// Moments of x - K: count, mean and sum of squared deviations (M2). All lanes share one count.
template <typename acc_t, int L>
struct Moments {
  acc_t n;
  acc_t mean[L];
  acc_t m2[L];
};

// Backward sums: dy, dy * (x - m), x - m.
template <typename acc_t, int L>
struct Sums {
  acc_t dy[L];
  acc_t dyxc[L];
  acc_t xc[L];
};

template <typename acc_t, int L>
__device__ __forceinline__ void clear(Moments<acc_t, L>& s) {
  s.n = acc_t(0);
#pragma unroll
  for (int l = 0; l < L; ++l) s.mean[l] = s.m2[l] = acc_t(0);
}

template <typename acc_t, int L>
__device__ __forceinline__ void clear(Sums<acc_t, L>& s) {
#pragma unroll
  for (int l = 0; l < L; ++l) s.dy[l] = s.dyxc[l] = s.xc[l] = acc_t(0);
}

// Chan et al.'s parallel update: exact for empty operands (an empty state has mean 0), no
// cancellation (M2 only accumulates non-negative terms).
template <typename acc_t, int L>
__device__ __forceinline__ Moments<acc_t, L> merge(const Moments<acc_t, L>& a, const Moments<acc_t, L>& b) {
  Moments<acc_t, L> r;
  r.n = a.n + b.n;
  const acc_t wb = r.n > acc_t(0) ? b.n / r.n : acc_t(0);
  const acc_t cross = a.n * wb;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const acc_t d = b.mean[l] - a.mean[l];
    r.mean[l] = a.mean[l] + d * wb;
    r.m2[l] = a.m2[l] + b.m2[l] + d * d * cross;
  }
  return r;
}

template <typename acc_t, int L>
__device__ __forceinline__ Sums<acc_t, L> merge(const Sums<acc_t, L>& a, const Sums<acc_t, L>& b) {
  Sums<acc_t, L> r;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.dy[l] = a.dy[l] + b.dy[l];
    r.dyxc[l] = a.dyxc[l] + b.dyxc[l];
    r.xc[l] = a.xc[l] + b.xc[l];
  }
  return r;
}

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

template <typename acc_t, int L>
__device__ __forceinline__ Moments<acc_t, L> shfl_xor(const Moments<acc_t, L>& v, int mask) {
  Moments<acc_t, L> r;
  r.n = shfl_xor(v.n, mask);
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.mean[l] = shfl_xor(v.mean[l], mask);
    r.m2[l] = shfl_xor(v.m2[l], mask);
  }
  return r;
}

template <typename acc_t, int L>
__device__ __forceinline__ Sums<acc_t, L> shfl_xor(const Sums<acc_t, L>& v, int mask) {
  Sums<acc_t, L> r;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    r.dy[l] = shfl_xor(v.dy[l], mask);
    r.dyxc[l] = shfl_xor(v.dyxc[l], mask);
    r.xc[l] = shfl_xor(v.xc[l], mask);
  }
  return r;
}

// Combines `v` over each aligned segment of 2^log_width consecutive threads (log_width <=
// kLogThreads) in a fixed order; the segment's first thread gets the total. Every thread of the
// block must call it (it synchronises when a segment spans several warps). `smem` holds
// kThreads / kWarp states.
template <typename State>
__device__ __forceinline__ State segment_reduce(State v, int log_width, State* smem) {
  const int in_warp = log_width < kLogWarp ? log_width : kLogWarp;
  for (int off = (1 << in_warp) >> 1; off > 0; off >>= 1) v = merge(v, shfl_xor(v, off));
  if (log_width > kLogWarp) {
    const int warp = threadIdx.x >> kLogWarp;
    if ((threadIdx.x & (kWarp - 1)) == 0) smem[warp] = v;
    __syncthreads();
    if ((threadIdx.x & ((1 << log_width) - 1)) == 0) {
      // This thread's warp is the first of its segment.
      for (int w = 1; w < (1 << (log_width - kLogWarp)); ++w) v = merge(v, smem[warp + w]);
    }
    __syncthreads();  // smem is reused by the next call
  }
  return v;
}

template <int L, int V>
__device__ __forceinline__ constexpr int lane_of(int j) {
  return L == 1 ? 0 : j;
}

// Folds a batch (the first `nvalid` of U packs) of x - shift into `st`: the batch's own mean and
// M2 are computed from registers in two passes, then merged with Chan's formula. Few divisions
// per element, no E[x^2] - E[x]^2.
template <int U, int V, int L, typename acc_t>
__device__ __forceinline__ void accumulate(
    Moments<acc_t, L>& st, const acc_t (&x)[U][V], const acc_t (&shift)[L], int nvalid) {
  static_assert(L == 1 || L == V, "lanes");
  if (nvalid <= 0) return;
  Moments<acc_t, L> b;
  clear(b);
  b.n = static_cast<acc_t>(nvalid * (V / L));
  const acc_t inv = acc_t(1) / b.n;
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (u < nvalid) b.mean[lane_of<L, V>(j)] += x[u][j] - shift[lane_of<L, V>(j)];
    }
  }
#pragma unroll
  for (int l = 0; l < L; ++l) b.mean[l] *= inv;
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int l = lane_of<L, V>(j);
      const acc_t d = (x[u][j] - shift[l]) - b.mean[l];
      if (u < nvalid) b.m2[l] += d * d;
    }
  }
  st = merge(st, b);
}

template <int U, int V, int L, typename acc_t>
__device__ __forceinline__ void accumulate(
    Sums<acc_t, L>& st, const acc_t (&x)[U][V], const acc_t (&dy)[U][V], const acc_t (&mean)[L],
    int nvalid) {
  static_assert(L == 1 || L == V, "lanes");
  Sums<acc_t, L> b;  // per-batch sums first: shorter addition chains
  clear(b);
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int l = lane_of<L, V>(j);
      if (u < nvalid) {
        const acc_t xc = x[u][j] - mean[l];
        b.dy[l] += dy[u][j];
        b.dyxc[l] += dy[u][j] * xc;
        b.xc[l] += xc;
      }
    }
  }
  st = merge(st, b);
}

// ---------------------------------------------------------------------------------------------
// Pass 1 in ChannelsFirst: rows of `len` contiguous elements, reduced along the row.
//   forward:  rows are groups (n, g), len = D * S; partial (r, k) = Moments of chunk k of row r.
//   backward: rows are (n, c), len = S; partial (r, k) = w[c] * (db, dsc) and dev, and
//             part_c (n, k, c) = (db, dsc).
// A tile is TY = kThreads / TX rows x one chunk of packs; the TX threads of a row stride over
// the chunk, then combine with warp shuffles (and shared memory when TX > 32).
// EPI (backward only): dy is dp, made from dz per element, and w[c] is w_eff[n, c] (a row's
// coefficients are computed once per tile).

template <typename scalar_t>
struct RowsArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  const scalar_t* dy;    // backward
  const acc_t* mean;     // backward: saved mean (N, G)
  ParamRef weight;       // backward
  acc_t* part;           // forward: 3 per (r, k); backward: 3 per (r, k)
  acc_t* part_c;         // backward: 2 per (n, k, c)
  int64_t rows, len;     // len: elements per row, a multiple of V
  int64_t C, D;          // backward: rows are (n, c)
  int64_t split, chunk;  // chunks per row, packs per chunk
  int64_t tiles;
  int log_tx;
};

template <typename scalar_t, int V, bool GRADS, bool EPI>
__global__ void __launch_bounds__(kThreads) reduce_rows_kernel(
    const KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI> a) {
  using acc_t = acc_type<scalar_t>;
  using State = std::conditional_t<GRADS, Sums<acc_t, 1>, Moments<acc_t, 1>>;
  static_assert(GRADS || !EPI, "the forward statistics are those of x alone");
  __shared__ State smem[kThreads / kWarp];
  const int log_ty = kLogThreads - a.log_tx;
  const int tx = threadIdx.x & ((1 << a.log_tx) - 1);
  const int ty = threadIdx.x >> a.log_tx;
  const int64_t lenv = a.len / V;
  constexpr int U = EPI && V >= 8 ? kEpiUnroll : kUnroll;
  const int64_t step = static_cast<int64_t>(U) << a.log_tx;
  for (int64_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    const int64_t rb = t / a.split;
    const int64_t k = t - rb * a.split;
    const int64_t r = (rb << log_ty) + ty;
    const bool valid = r < a.rows;
    const int64_t row_off = (valid ? r : 0) * a.len;
    const int64_t v_begin = k * a.chunk + tx;
    const int64_t v_end = valid ? imin(lenv, (k + 1) * a.chunk) : 0;
    State st;
    clear(st);
    // Forward: the shift K of group r is its first element. Backward: the saved mean.
    acc_t center[1] = {acc_t(0)};
    // EPI: w_eff of row r = (n, c), and p's coefficients (see dz_to_dp).
    [[maybe_unused]] acc_t w_eff = acc_t(1);
    [[maybe_unused]] acc_t ea[1] = {acc_t(0)}, pc[1] = {acc_t(0)};
    if (valid) {
      if constexpr (GRADS) {
        center[0] = a.mean[div_nn(r, a.D)];  // (n * C + c) / D == n * G + g
        if constexpr (EPI) {
          const int64_t c = r - div_nn(r, a.C) * a.C;
          const Affine<acc_t> m = modulate(a.epi, r, load_param(a.weight, c, acc_t(1)),
              load_param(a.epi.bias, c, acc_t(0)));  // scale and shift are indexed by r = n * C + c
          w_eff = m.w;
          ea[0] = a.epi.rstd[div_nn(r, a.D)] * m.w;
          pc[0] = m.b;
        }
      } else {
        center[0] = static_cast<acc_t>(a.x[row_off]);
      }
    }
    for (int64_t v0 = v_begin; v0 < v_end; v0 += step) {
      const int nvalid = static_cast<int>(imin(U, (v_end - v0 + (1 << a.log_tx) - 1) >> a.log_tx));
      acc_t xs[U][V];
      load_packs<U, V>(a.x + row_off, v0, int64_t(1) << a.log_tx, nvalid, xs);
      if constexpr (GRADS) {
        acc_t ds[U][V];
        load_packs<U, V>(a.dy + row_off, v0, int64_t(1) << a.log_tx, nvalid, ds);
        if constexpr (EPI) {
          dz_to_dp<U, V, 1>(a.epi, offset_or_null(a.epi.residual, row_off),
              offset_or_null(a.epi.multiplier, row_off), v0, int64_t(1) << a.log_tx, nvalid, xs,
              center, ea, pc, ds);
        }
        accumulate<U, V, 1>(st, xs, ds, center, nvalid);
      } else {
        accumulate<U, V, 1>(st, xs, center, nvalid);
      }
    }
    st = segment_reduce(st, a.log_tx, smem);
    if (tx == 0 && valid) {
      acc_t* out = a.part + (r * a.split + k) * 3;
      if constexpr (GRADS) {
        const int64_t n = div_nn(r, a.C);
        const int64_t c = r - n * a.C;
        acc_t w;
        if constexpr (EPI) {
          w = w_eff;
        } else {
          w = load_param(a.weight, c, acc_t(1));
        }
        out[0] = w * st.dy[0];
        out[1] = w * st.dyxc[0];
        out[2] = st.xc[0];
        acc_t* out_c = a.part_c + ((n * a.split + k) * a.C + c) * 2;
        out_c[0] = st.dy[0];
        out_c[1] = st.dyxc[0];
      } else {
        out[0] = st.n;
        out[1] = st.mean[0];
        out[2] = st.m2[0];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 1 in ChannelsLast: per sample n, S rows of C contiguous channels, reduced over the rows.
// A tile is (n, chunk k of rows, block cb of TX packs of channels); TX threads span the channels
// of a row (coalesced), TY = kThreads / TX threads go down the rows. Per-column states are
// combined over the TY threads by a shared-memory tree, then Q = 2^log_q neighbouring channels
// (Q divides D and the block width, so a piece never straddles a group or a block) are merged
// into one piece:
//   forward:  part (n, piece, k) = Moments;
//   backward: part (n, piece, k) = (sum w*dy, sum w*dy*(x - m), sum (x - m)), and
//             part_c (n, k, c) = (db, dsc) per channel.
// EPI (backward only): dy is dp and w is w_eff[n, c]; a tile lies within one sample n, so each
// lane's (n, c) coefficients are computed once per tile.

template <typename scalar_t>
struct ColsArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  const scalar_t* dy;  // backward
  const acc_t* mean;   // backward
  ParamRef weight;     // backward
  acc_t* part;         // 3 per (n, piece, k)
  acc_t* part_c;       // backward: 2 per (n, k, c)
  int64_t S, C, G, D;
  int64_t split, chunk, ncb;  // chunks of rows, rows per chunk, blocks of channels
  int64_t tiles;
  int log_tx, log_q;
};

template <typename scalar_t, int V, bool GRADS, bool EPI>
__global__ void __launch_bounds__(kThreads, kMinBlocks) reduce_cols_kernel(
    const KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI> a) {
  using acc_t = acc_type<scalar_t>;
  static_assert(GRADS || !EPI, "the forward statistics are those of x alone");
  using State = std::conditional_t<GRADS, Sums<acc_t, V>, Moments<acc_t, V>>;
  using Piece = std::conditional_t<GRADS, Sums<acc_t, 1>, Moments<acc_t, 1>>;
  __shared__ State tree[kThreads / 2];
  __shared__ Piece smem[kThreads / kWarp];
  constexpr int kLogV = V == 1 ? 0 : V == 2 ? 1 : V == 4 ? 2 : 3;
  static_assert((1 << kLogV) == V, "V must be 1, 2, 4 or 8");
  const int log_ty = kLogThreads - a.log_tx;
  const int tx = threadIdx.x & ((1 << a.log_tx) - 1);
  const int ty = threadIdx.x >> a.log_tx;
  const int64_t cvn = a.C / V;  // packs per row
  const int Q = 1 << a.log_q;
  const int64_t pieces = a.C >> a.log_q;  // per sample
  // Per-lane states of 8-wide packs take many registers: fewer packs in flight then.
  constexpr int U = EPI ? epi_unroll_lanes<V>() : V >= 8 ? 2 : kUnroll;
  for (int64_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    const int64_t t2 = t / a.ncb;
    const int64_t cb = t - t2 * a.ncb;
    const int64_t n = t2 / a.split;
    const int64_t k = t2 - n * a.split;
    const int64_t cv = (cb << a.log_tx) + tx;
    const bool valid = cv < cvn;
    const int64_t c0 = (valid ? cv : 0) * V;
    const int64_t s_begin = k * a.chunk + ty;
    const int64_t s_end = valid ? imin(a.S, (k + 1) * a.chunk) : 0;
    const int64_t sample = n * a.S * a.C;  // element offset of sample n

    // Per-lane group constants: the shift K (forward) or the saved mean (backward), and w[c]
    // (EPI: w_eff[n, c], and p's coefficients, see dz_to_dp).
    acc_t center[V];
    acc_t w[V];
    [[maybe_unused]] acc_t ea[EPI ? V : 1], pc[EPI ? V : 1];
    {
      int64_t g = div_nn(c0, a.D);
      int64_t rem = c0 - g * a.D;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        center[j] = acc_t(0);
        w[j] = acc_t(1);
        if constexpr (EPI) ea[j] = pc[j] = acc_t(0);
        if (valid) {
          if constexpr (GRADS) {
            center[j] = a.mean[n * a.G + g];
            w[j] = load_param(a.weight, c0 + j, acc_t(1));
            if constexpr (EPI) {
              const Affine<acc_t> m =
                  modulate(a.epi, n * a.C + c0 + j, w[j], load_param(a.epi.bias, c0 + j, acc_t(0)));
              w[j] = m.w;
              ea[j] = a.epi.rstd[n * a.G + g] * m.w;
              pc[j] = m.b;
            }
          } else {
            center[j] = static_cast<acc_t>(a.x[sample + g * a.D]);
          }
        }
        if (++rem == a.D) {
          rem = 0;
          ++g;
        }
      }
    }

    State st;
    clear(st);
    const int64_t step = static_cast<int64_t>(U) << log_ty;
    for (int64_t s0 = s_begin; s0 < s_end; s0 += step) {
      const int nvalid = static_cast<int>(imin(U, (s_end - s0 + (1 << log_ty) - 1) >> log_ty));
      const int64_t first = (n * a.S + s0) * cvn + cv;
      const int64_t stride = cvn << log_ty;
      acc_t xs[U][V];
      load_packs<U, V>(a.x, first, stride, nvalid, xs);
      if constexpr (GRADS) {
        acc_t ds[U][V];
        load_packs<U, V>(a.dy, first, stride, nvalid, ds);
        if constexpr (EPI) {
          dz_to_dp<U, V, V>(a.epi, a.epi.residual, a.epi.multiplier, first, stride, nvalid, xs, center,
              ea, pc, ds);
        }
        accumulate<U, V, V>(st, xs, ds, center, nvalid);
      } else {
        accumulate<U, V, V>(st, xs, center, nvalid);
      }
    }

    // Combine the TY threads of each column: a fixed tree over shared memory.
    for (int off = (1 << log_ty) >> 1; off > 0; off >>= 1) {
      if (ty >= off && ty < 2 * off) tree[((ty - off) << a.log_tx) + tx] = st;
      __syncthreads();
      if (ty < off) st = merge(st, tree[(ty << a.log_tx) + tx]);
      __syncthreads();
    }
    // Row ty == 0 now holds the column totals of the tile.

    if constexpr (GRADS) {
      if (ty == 0 && valid) {
        acc_t* out_c = a.part_c + ((n * a.split + k) * a.C + c0) * 2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          out_c[2 * j] = st.dy[j];
          out_c[2 * j + 1] = st.dyxc[j];
        }
      }
    }

    auto lane = [&](int j) {
      Piece p;
      if constexpr (GRADS) {
        p.dy[0] = w[j] * st.dy[j];
        p.dyxc[0] = w[j] * st.dyxc[j];
        p.xc[0] = st.xc[j];
      } else {
        p.n = st.n;
        p.mean[0] = st.mean[j];
        p.m2[0] = st.m2[j];
      }
      return p;
    };
    auto write_piece = [&](const Piece& p, int64_t piece) {
      acc_t* out = a.part + ((n * pieces + piece) * a.split + k) * 3;
      if constexpr (GRADS) {
        out[0] = p.dy[0];
        out[1] = p.dyxc[0];
        out[2] = p.xc[0];
      } else {
        out[0] = p.n;
        out[1] = p.mean[0];
        out[2] = p.m2[0];
      }
    };
    if (Q <= V) {
      // Each pack holds V / Q whole pieces.
      if (ty == 0 && valid) {
        Piece p = lane(0);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (j > 0) p = (j & (Q - 1)) == 0 ? lane(j) : merge(p, lane(j));
          if ((j & (Q - 1)) == Q - 1) write_piece(p, (c0 + j) >> a.log_q);
        }
      }
    } else {
      // A piece spans Q / V neighbouring threads of row ty == 0.
      Piece p = lane(0);
#pragma unroll
      for (int j = 1; j < V; ++j) p = merge(p, lane(j));
      p = segment_reduce(p, a.log_q - kLogV, smem);
      if (ty == 0 && valid && (tx & ((Q >> kLogV) - 1)) == 0) write_piece(p, c0 >> a.log_q);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 2, forward: per (n, g), merge the partial moments [item * entries, (item + 1) * entries)
// (contiguous in both layouts), with 2^log_iw threads per item.

template <typename scalar_t>
struct MomentsFinalizeArgs {
  using acc_t = acc_type<scalar_t>;
  const acc_t* part;
  const scalar_t* x;        // to read the shift K, the first element of each group
  int64_t items, entries;   // items = N * G
  int64_t G, sample_stride, group_stride;  // element offset of group (n, g)'s first element
  acc_t eps;
  acc_t* mean;              // (N, G) outputs
  acc_t* rstd;
  acc_t* rec;               // kRec per (n, g) for the apply pass
  int log_iw;
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) finalize_moments_kernel(const MomentsFinalizeArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  __shared__ Moments<acc_t, 1> smem[kThreads / kWarp];
  const int lane = threadIdx.x & ((1 << a.log_iw) - 1);
  const int per_block = kThreads >> a.log_iw;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < a.items;
       base += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t item = base + (threadIdx.x >> a.log_iw);
    Moments<acc_t, 1> st;
    clear(st);
    if (item < a.items) {
      const acc_t* p = a.part + item * a.entries * 3;
      for (int64_t e = lane; e < a.entries; e += (1 << a.log_iw)) {
        Moments<acc_t, 1> b;
        b.n = p[e * 3];
        b.mean[0] = p[e * 3 + 1];
        b.m2[0] = p[e * 3 + 2];
        st = merge(st, b);
      }
    }
    st = segment_reduce(st, a.log_iw, smem);
    if (lane == 0 && item < a.items) {
      const int64_t n = div_nn(item, a.G);
      const int64_t g = item - n * a.G;
      const acc_t K = static_cast<acc_t>(a.x[n * a.sample_stride + g * a.group_stride]);
      const acc_t var = st.n > acc_t(0) && st.m2[0] > acc_t(0) ? st.m2[0] / st.n : acc_t(0);
      const acc_t rs = acc_t(1) / sqrt(var + a.eps);
      a.mean[item] = K + st.mean[0];
      a.rstd[item] = rs;
      acc_t* rec = a.rec + item * kRec;
      rec[0] = K;
      rec[1] = st.mean[0];
      rec[2] = rs;
      rec[3] = acc_t(0);
      rec[4] = acc_t(0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 2, backward: per (n, g), the dx coefficients. With w = weight (or 1), M = D * S, m the
// saved mean, delta = mean(x - m), A = sum w*dy, B = sum w*dy*(x - m - delta):
//   dx = w*rstd*dy - rstd/M * A - rstd^3/M * B * ((x - m) - delta).

template <typename acc_t>
struct GradCoefArgs {
  const acc_t* part;   // 3 per (n, piece, k): sum w*dy, sum w*dy*(x - m), sum (x - m)
  const acc_t* mean;
  const acc_t* rstd;
  acc_t* rec;          // kRec per (n, g)
  int64_t items, entries;
  acc_t M;             // elements per group
  int log_iw;
};

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) finalize_grad_coefs_kernel(const GradCoefArgs<acc_t> a) {
  __shared__ Sums<acc_t, 1> smem[kThreads / kWarp];
  const int lane = threadIdx.x & ((1 << a.log_iw) - 1);
  const int per_block = kThreads >> a.log_iw;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < a.items;
       base += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t item = base + (threadIdx.x >> a.log_iw);
    Sums<acc_t, 1> s;
    clear(s);
    if (item < a.items) {
      const acc_t* p = a.part + item * a.entries * 3;
      for (int64_t e = lane; e < a.entries; e += (1 << a.log_iw)) {
        s.dy[0] += p[e * 3];
        s.dyxc[0] += p[e * 3 + 1];
        s.xc[0] += p[e * 3 + 2];
      }
    }
    s = segment_reduce(s, a.log_iw, smem);
    if (lane == 0 && item < a.items) {
      const acc_t r = a.rstd[item];
      const acc_t delta = s.xc[0] / a.M;
      const acc_t A = s.dy[0];
      const acc_t B = s.dyxc[0] - delta * A;
      acc_t* rec = a.rec + item * kRec;
      rec[0] = a.mean[item];
      rec[1] = delta;
      rec[2] = r;
      rec[3] = -r * r * r * B / a.M;
      rec[4] = -r * A / a.M;
    }
  }
}

// Pass 3, backward: grad_weight[c] = sum_n rstd * (dsc - delta * db), grad_bias[c] = sum_n db,
// from the per-(n, k, c) partials. A channel block of 32 channels (lanes, coalesced) spreads its
// (n, k) entries over the 32 warps of each of `parts` CTAs, a cluster: warp w of rank r takes
// entries r * 32 + w, r * 32 + w + 32 * parts, ... Each CTA adds its warps' sums in warp order,
// then rank 0 adds the CTAs' sums in rank order from their shared memory: a fixed order for a given
// `parts`, so deterministic. The ChannelsLast reduce leaves up to kMaxParamEntries entries per
// channel and there are only C / 32 channel blocks, so the loads in flight, not bandwidth, bound
// this pass: one CTA a block (sm < 90, or few entries) took 5-8 us of the UNet and ResNet
// channels_last backward rows with 1024 threads (10-20 us with 256).
// PER_SAMPLE (a scale, or grad_scale / grad_shift wanted): the gradients are per (n, c) first,
//   db = sum_k part_c[n, k, c, 0],  xs = rstd * (sum_k part_c[n, k, c, 1] - delta * db)
// (xs = sum_s dp * xhat), giving grad_shift[n, c] = db, grad_scale[n, c] = w[c] * xs + b[c] * db,
// and grad_weight / grad_bias sum (1 + scale[n, c]) * xs / db over n: the warps then take whole
// samples (their chunks in order) rather than entries. One launch instead of a chain of small
// host-side ops, whose launch overhead dominated the fused backward of small inputs.

template <typename acc_t>
struct ParamGradArgs {
  const acc_t* part_c;  // 2 per (n, k, c)
  const acc_t* rec;     // kRec per (n, g): delta at 1, rstd at 2
  GradRef dweight, dbias;
  int64_t C, G, D, split, entries;  // entries = N * split
  int parts;                        // CTAs (a cluster) per channel block
};

// The PER_SAMPLE kernel's arguments (the plain kernel keeps exactly its own struct).
template <typename acc_t>
struct SampleParamGradArgs : ParamGradArgs<acc_t> {
  ParamRef scale;          // (N, C) contiguous; null: gain 1
  ParamRef weight, bias;   // for grad_scale
  GradRef dscale, dshift;  // (N, C) contiguous; null: not requested
  int64_t N;
};

constexpr int kParamGradThreads = 1024;
// Most CTAs a channel block's finalize spreads over: the portable cluster size.
constexpr int kMaxParamGradParts = 8;

template <typename acc_t, bool PER_SAMPLE>
__global__ void __launch_bounds__(kParamGradThreads) finalize_param_grads_kernel(
    const std::conditional_t<PER_SAMPLE, SampleParamGradArgs<acc_t>, ParamGradArgs<acc_t>> a) {
  constexpr int kWarps = kParamGradThreads / kWarp;
  __shared__ acc_t sw[kParamGradThreads];
  __shared__ acc_t sb[kParamGradThreads];
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x >> kLogWarp;
  const int64_t block = blockIdx.x / a.parts;  // the cluster
  const int64_t blocks = gridDim.x / a.parts;
#if FUSEDNORM_CLUSTERS
  const int parts = a.parts;
  const int rank = static_cast<int>(blockIdx.x - block * a.parts);
#else
  // No clusters in this architecture's code: each CTA of a would-be cluster takes every entry
  // and stores the same sums.
  constexpr int parts = 1;
  constexpr int rank = 0;
#endif
  const int64_t first = static_cast<int64_t>(rank) * kWarps + warp;  // this warp's first entry
  const int64_t stride = static_cast<int64_t>(parts) * kWarps;
  for (int64_t c_base = block * kWarp; c_base < a.C; c_base += blocks * kWarp) {
    const int64_t c = c_base + lane;
    acc_t dw = acc_t(0), db = acc_t(0);
    if (c < a.C) {
      const int64_t g = div_nn(c, a.D);
      if constexpr (PER_SAMPLE) {
        const acc_t w = load_param(a.weight, c, acc_t(1));
        const acc_t b = load_param(a.bias, c, acc_t(0));
        for (int64_t n = first; n < a.N; n += stride) {
          const acc_t* p = a.part_c + (n * a.split * a.C + c) * 2;  // entry (n, 0)
          acc_t db_n = acc_t(0), dsc_n = acc_t(0);
#pragma unroll 4
          for (int64_t k = 0; k < a.split; ++k) {
            db_n += p[k * a.C * 2];
            dsc_n += p[k * a.C * 2 + 1];
          }
          const acc_t* rec = a.rec + (n * a.G + g) * kRec;
          const acc_t xs = rec[2] * (dsc_n - rec[1] * db_n);
          const int64_t nc = n * a.C + c;
          const acc_t gain = acc_t(1) + load_param(a.scale, nc, acc_t(0));
          dw += gain * xs;
          db += gain * db_n;
          store_grad(a.dshift, nc, db_n);
          if (a.dscale.ptr != nullptr) {
            // w is 1 without a weight (w * xs == xs exactly); without a bias there is no db term.
            store_grad(a.dscale, nc, a.bias.ptr != nullptr ? w * xs + b * db_n : w * xs);
          }
        }
      } else {
#pragma unroll 4
        for (int64_t e = first; e < a.entries; e += stride) {
          const int64_t n = div_nn(e, a.split);
          const acc_t* p = a.part_c + (e * a.C + c) * 2;  // e = n * split + k
          const acc_t* rec = a.rec + (n * a.G + g) * kRec;
          db += p[0];
          dw += rec[2] * (p[1] - rec[1] * p[0]);
        }
      }
    }
    sw[threadIdx.x] = dw;
    sb[threadIdx.x] = db;
    __syncthreads();
    if (warp == 0) {
      for (int w = 1; w < kWarps; ++w) {
        dw += sw[w * kWarp + lane];
        db += sb[w * kWarp + lane];
      }
    }
#if FUSEDNORM_CLUSTERS
    if (parts > 1) {
      // Warp 0 of every rank publishes its CTA's sums in its own slots (lane < kWarp); the
      // other warps' slots are no longer read.
      cg::cluster_group cluster = cg::this_cluster();
      if (warp == 0) {
        sw[lane] = dw;
        sb[lane] = db;
      }
      cluster.sync();
      if (rank == 0 && warp == 0) {
        dw = acc_t(0);
        db = acc_t(0);
        for (int r = 0; r < parts; ++r) {
          dw += cluster.map_shared_rank(sw, r)[lane];
          db += cluster.map_shared_rank(sb, r)[lane];
        }
      }
      // No CTA may overwrite or leave its slots while rank 0 can still read them.
      cluster.sync();
    }
#endif
    if (rank == 0 && warp == 0 && c < a.C) {
      store_grad(a.dweight, c, dw);
      store_grad(a.dbias, c, db);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Apply pass (forward y and backward dx): out = a*dy + b*((x - hi) - lo) + c per element, with
//   forward:  hi = K, lo = mean - K, a = 0, b = rstd * w[c], c = bias[c];
//   backward: hi = m, lo = delta,    a = rstd * w[c], b = b1, c = b2.
// Centring on hi then lo keeps (x - mean) accurate when |mean| >> std.
// EPI: w and bias are w_eff[n, c] and b_eff[n, c] (modulate), and the epilogue works per element
// (apply_epi_pack); in the backward `out` (dx) may then be null, when only grad_residual or
// grad_multiplier are wanted.

// Which pass an instantiation of the apply kernels makes. Plain: the plain ops' forward or
// backward (by whether dy is null), exactly their code: the EPI branches compile away. The fused
// ops take EpiForward / EpiBackward, a compile-time direction, so that the forward neither
// carries the backward's registers nor pays for them in occupancy.
enum class ApplyMode { Plain, EpiForward, EpiBackward };

template <typename acc_t>
struct Coef {
  acc_t a, b, hi, lo, c;
};

template <typename scalar_t>
struct ApplyArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  const scalar_t* dy;  // null in the forward
  scalar_t* out;
  const acc_t* rec;    // kRec per (n, g)
  ParamRef weight, bias;
  int64_t rows, len;   // by rows: (n, c) rows of S; by columns: (n, s) rows of C
  int64_t C, S, G, D;
  int64_t split, chunk;  // by rows: chunks per row, packs per chunk; by columns: ncb, rows per tile
  int64_t tiles;
  int log_tx;
};

template <typename acc_t>
__device__ __forceinline__ Coef<acc_t> make_coef(const acc_t* rec, bool backward, acc_t w, acc_t bias) {
  Coef<acc_t> k;
  k.hi = rec[0];
  k.lo = rec[1];
  if (backward) {
    k.a = rec[2] * w;
    k.b = rec[3];
    k.c = rec[4];
  } else {
    k.a = acc_t(0);
    k.b = rec[2] * w;
    k.c = bias;
  }
  return k;
}

// One element of the apply pass, before its rounding to scalar_t (round_pack, a pack at a time).
template <typename acc_t>
__device__ __forceinline__ acc_t apply_one(const Coef<acc_t>& k, acc_t x, acc_t dy) {
  return k.a * dy + (k.b * ((x - k.hi) - k.lo) + k.c);
}

// One pack of the EPI apply pass, written at pack index v of out, grad_residual, grad_multiplier
// (those that are not null). Lane j uses k[j] and pc[j] (L == V) or k[0] and pc[0] (L == 1); pc is
// the folded bias b_eff, which the backward needs for p. rp / mp are read only where the
// residual / multiplier pointer of `e` is not null; dp only in the backward. A: see kAnyAct.
//   forward:  p = b * ((x - hi) - lo) + c + residual, out = act(p) * multiplier;
//   backward: dp = dz * multiplier * act'(p) with p = a * (x - m) + pc + residual (as in dz_to_dp),
//             dx = a * dp + b1 * ((x - m) - delta) + b2 (apply_one's arithmetic on dp),
//             grad_residual = dp, grad_multiplier = dz * act(p); their sum into grad_residual
//             when the two are one buffer (sum_residual_multiplier_grads).
template <ApplyMode M, int A, int V, int L, bool OPS = true, typename scalar_t, typename acc_t>
__device__ __forceinline__ void apply_epi_pack(const EpiArgs<scalar_t>& e,
    const Coef<acc_t> (&k)[L], const acc_t (&pc)[L], const Pack<scalar_t, V>& xp,
    const Pack<scalar_t, V>& dp, const Pack<scalar_t, V>& rp, const Pack<scalar_t, V>& mp,
    Pack<scalar_t, V>* out, Pack<scalar_t, V>* grad_residual, Pack<scalar_t, V>* grad_multiplier,
    int64_t v) {
  static_assert(M != ApplyMode::Plain, "the plain kernels compute in apply_one");
  const Activation act = act_of<A>(e.act);
  // OPS false: the launch guarantees no residual and no multiplier (their code compiles away).
  const bool has_r = OPS && e.residual != nullptr;
  const bool has_m = OPS && e.multiplier != nullptr;
  acc_t o[V], gr[V], gm[V];
  if constexpr (M == ApplyMode::EpiForward) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const Coef<acc_t>& kj = k[L == 1 ? 0 : j];
      const acc_t x = static_cast<acc_t>(xp.v[j]);
      acc_t p = kj.b * ((x - kj.hi) - kj.lo) + kj.c;
      if (has_r) p += static_cast<acc_t>(rp.v[j]);
      acc_t z = device_activation_forward(act, p, e.slope);
      if (has_m) z *= static_cast<acc_t>(mp.v[j]);
      o[j] = z;
    }
    out[v] = round_pack<scalar_t, V>(o);
    return;
  }
  const bool want_gm = grad_multiplier != nullptr;
  const bool sum_grads = want_gm && grad_multiplier == grad_residual;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int l = L == 1 ? 0 : j;
    const acc_t xc = static_cast<acc_t>(xp.v[j]) - k[l].hi;
    const acc_t dz = static_cast<acc_t>(dp.v[j]);
    const acc_t m = has_m ? static_cast<acc_t>(mp.v[j]) : acc_t(1);
    const acc_t r = has_r ? static_cast<acc_t>(rp.v[j]) : acc_t(0);
    acc_t q = acc_t(0);
    const acc_t g = epi_dp<A>(act, e.slope, xc, dz, r, m, k[l].a, pc[l], want_gm, q);
    o[j] = k[l].a * g + (k[l].b * (xc - k[l].lo) + k[l].c);
    operand_grads_at(sum_grads, g, dz, q, gr[j], gm[j]);
  }
  if (out != nullptr) out[v] = round_pack<scalar_t, V>(o);
  if (grad_residual != nullptr) grad_residual[v] = round_pack<scalar_t, V>(gr);
  if (want_gm && !sum_grads) grad_multiplier[v] = round_pack<scalar_t, V>(gm);
}

// Packs per operand stream in flight per thread in the EPI apply kernels (LANES: the ChannelsLast
// kernel, which keeps per-lane coefficients). The forward carries at most three input streams (x,
// residual, multiplier), no dz, and with a compile-time activation A few temporaries: it takes
// kUnroll where ptxas shows that it fits the register cap without spills, i.e. for packs of fewer
// than 8 lanes (by rows) or single elements (by columns). With 8 lanes of half / bf16 it reaches
// the cap alone and spills beside the other activations' copies; there, in the kAnyAct loop (the
// union of the activations' temporaries) and in the backward (four input streams, three outputs),
// the unroll stays kEpiUnroll / epi_unroll_lanes.
template <ApplyMode M, int A, int V, bool LANES>
constexpr int epi_apply_unroll() {
  if (M == ApplyMode::EpiForward && A != kAnyAct && (LANES ? V == 1 : V < 8)) return kUnroll;
  return LANES ? epi_unroll_lanes<V>() : kEpiUnroll;
}

// The EPI part of apply_rows_kernel: packs [v_begin, v_end) by tx_count of row r = (n, c).
template <ApplyMode M, int V, typename scalar_t>
__device__ __forceinline__ void apply_row_epi(const WithEpi<ApplyArgs<scalar_t>, scalar_t>& a,
    int64_t r, int64_t c, int64_t v_begin, int64_t v_end, int64_t tx_count) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  constexpr bool kBackward = M == ApplyMode::EpiBackward;
  // scale and shift are indexed by r = n * C + c.
  const Affine<acc_t> m =
      modulate(a.epi, r, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
  const Coef<acc_t> coef[1] = {make_coef(a.rec + div_nn(r, a.D) * kRec, kBackward, m.w, m.b)};
  const acc_t pc[1] = {m.b};
  const int64_t off = r * a.len;
  const P* xr = reinterpret_cast<const P*>(a.x + off);
  const P* dyr = reinterpret_cast<const P*>(kBackward ? a.dy + off : a.x + off);
  const P* rr = reinterpret_cast<const P*>(offset_or_null(a.epi.residual, off));
  const P* mr = reinterpret_cast<const P*>(offset_or_null(a.epi.multiplier, off));
  P* outr = reinterpret_cast<P*>(offset_or_null(a.out, off));
  P* grr = reinterpret_cast<P*>(offset_or_null(a.epi.grad_residual, off));
  P* gmr = reinterpret_cast<P*>(offset_or_null(a.epi.grad_multiplier, off));
  with_activation(a.epi.act, [&](auto act) {
    constexpr int kA = decltype(act)::value;
    constexpr int U = epi_apply_unroll<M, kA, V, false>();
    for (int64_t v0 = v_begin; v0 < v_end; v0 += U * tx_count) {
      P xp[U], dp[U], rp[U], mp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + u * tx_count;
        if (v < v_end) {
          xp[u] = xr[v];
          if (kBackward) dp[u] = dyr[v];
          if (rr != nullptr) rp[u] = rr[v];
          if (mr != nullptr) mp[u] = mr[v];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + u * tx_count;
        if (v < v_end) {
          apply_epi_pack<M, kA, V, 1>(a.epi, coef, pc, xp[u], dp[u], rp[u], mp[u], outr, grr, gmr, v);
        }
      }
    }
  });
}

// ChannelsFirst with S > 1: a row (n, c) has one coefficient set.
template <typename scalar_t, int V, ApplyMode M>
__global__ void __launch_bounds__(kThreads, kMinBlocks) apply_rows_kernel(
    const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const bool backward = a.dy != nullptr;
  const int log_ty = kLogThreads - a.log_tx;
  const int tx = threadIdx.x & ((1 << a.log_tx) - 1);
  const int ty = threadIdx.x >> a.log_tx;
  const int64_t lenv = a.len / V;
  const int64_t tx_count = int64_t(1) << a.log_tx;
  for (int64_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    const int64_t rb = t / a.split;
    const int64_t k = t - rb * a.split;
    const int64_t r = (rb << log_ty) + ty;
    if (r >= a.rows) continue;
    const int64_t c = r - div_nn(r, a.C) * a.C;
    if constexpr (M != ApplyMode::Plain) {
      apply_row_epi<M, V>(a, r, c, k * a.chunk + tx, imin(lenv, (k + 1) * a.chunk), tx_count);
      continue;
    }
    const Coef<acc_t> coef = make_coef(a.rec + div_nn(r, a.D) * kRec, backward,
        load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
    const P* xr = reinterpret_cast<const P*>(a.x + r * a.len);
    const P* dyr = reinterpret_cast<const P*>(backward ? a.dy + r * a.len : a.x);
    P* outr = reinterpret_cast<P*>(a.out + r * a.len);
    const int64_t v_end = imin(lenv, (k + 1) * a.chunk);
    for (int64_t v0 = k * a.chunk + tx; v0 < v_end; v0 += kUnroll * tx_count) {
      P xp[kUnroll], dp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * tx_count;
        if (v < v_end) {
          xp[u] = xr[v];
          if (backward) dp[u] = dyr[v];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * tx_count;
        if (v < v_end) {
          acc_t o[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            o[j] = apply_one(coef, static_cast<acc_t>(xp[u].v[j]),
                backward ? static_cast<acc_t>(dp[u].v[j]) : acc_t(0));
          }
          outr[v] = round_pack<scalar_t, V>(o);
        }
      }
    }
  }
}

// The tiles of apply_cols_kernel, with the activation A (EPI) and U packs per thread in flight as
// template arguments.
// OPS false: no residual / multiplier streams (apply_cols_act_kernel).
template <ApplyMode M, int A, int U, int V, typename scalar_t, bool OPS = true>
__device__ __forceinline__ void apply_cols_tiles(
    const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  constexpr bool EPI = M != ApplyMode::Plain;
  const bool backward = EPI ? M == ApplyMode::EpiBackward : a.dy != nullptr;
  const int log_ty = kLogThreads - a.log_tx;
  const int tx = threadIdx.x & ((1 << a.log_tx) - 1);
  const int ty = threadIdx.x >> a.log_tx;
  const int64_t cvn = a.C / V;
  const int64_t ncb = a.split;
  const P* xp = reinterpret_cast<const P*>(a.x);
  const P* dyp = reinterpret_cast<const P*>(backward ? a.dy : a.x);
  P* outp = reinterpret_cast<P*>(a.out);
  for (int64_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    const int64_t rt = t / ncb;
    const int64_t cb = t - rt * ncb;
    const int64_t cv = (cb << a.log_tx) + tx;
    if (cv >= cvn) continue;
    const int64_t c0 = cv * V;
    const int64_t g0 = div_nn(c0, a.D);
    // Coefficients of the sample being written. Reloading w[c] and b[c] with them (rather than
    // keeping them in registers for the whole tile) keeps the register count, and so the
    // occupancy, reasonable; the reload happens once per sample and tile.
    Coef<acc_t> coef[V];
    [[maybe_unused]] acc_t pc[EPI ? V : 1];  // EPI: b_eff, for p in the backward
    int64_t sample_end = 0;  // rows [.., sample_end) use the cached coefficients
    const int64_t r_end = imin(a.rows, (rt + 1) * a.chunk);
    const int64_t step = static_cast<int64_t>(U) << log_ty;
    for (int64_t r0 = rt * a.chunk + ty; r0 < r_end; r0 += step) {
      P xv[U], dv[U];
      [[maybe_unused]] P rv[EPI && OPS ? U : 1], mv[EPI && OPS ? U : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t r = r0 + (static_cast<int64_t>(u) << log_ty);
        if (r < r_end) {
          xv[u] = xp[r * cvn + cv];
          if (backward) dv[u] = dyp[r * cvn + cv];
          if constexpr (EPI && OPS) {
            const P* rp = reinterpret_cast<const P*>(a.epi.residual);
            const P* mp = reinterpret_cast<const P*>(a.epi.multiplier);
            if (rp != nullptr) rv[u] = rp[r * cvn + cv];
            if (mp != nullptr) mv[u] = mp[r * cvn + cv];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t r = r0 + (static_cast<int64_t>(u) << log_ty);
        if (r < r_end) {
          if (r >= sample_end) {  // rows only increase: a new sample
            const int64_t n = div_nn(r, a.S);
            sample_end = (n + 1) * a.S;
            int64_t g = g0;
            int64_t rem = c0 - g0 * a.D;
#pragma unroll
            for (int j = 0; j < V; ++j) {
              if constexpr (EPI) {
                const Affine<acc_t> m = modulate(a.epi, n * a.C + c0 + j,
                    load_param(a.weight, c0 + j, acc_t(1)), load_param(a.bias, c0 + j, acc_t(0)));
                coef[j] = make_coef(a.rec + (n * a.G + g) * kRec, backward, m.w, m.b);
                pc[j] = m.b;
              } else {
                coef[j] = make_coef(a.rec + (n * a.G + g) * kRec, backward,
                    load_param(a.weight, c0 + j, acc_t(1)), load_param(a.bias, c0 + j, acc_t(0)));
              }
              if (++rem == a.D) {
                rem = 0;
                ++g;
              }
            }
          }
          if constexpr (EPI) {
            apply_epi_pack<M, A, V, V, OPS>(a.epi, coef, pc, xv[u], dv[u], rv[OPS ? u : 0],
                mv[OPS ? u : 0], outp,
                reinterpret_cast<P*>(a.epi.grad_residual), reinterpret_cast<P*>(a.epi.grad_multiplier),
                r * cvn + cv);
          } else {
            acc_t o[V];
#pragma unroll
            for (int j = 0; j < V; ++j) {
              o[j] = apply_one(coef[j], static_cast<acc_t>(xv[u].v[j]),
                  backward ? static_cast<acc_t>(dv[u].v[j]) : acc_t(0));
            }
            outp[r * cvn + cv] = round_pack<scalar_t, V>(o);
          }
        }
      }
    }
  }
}

// ChannelsLast (and ChannelsFirst with S == 1, the same memory): a thread keeps one pack of
// channels for a whole tile of rows, so w[c], b[c] and the group of each lane are loaded once per
// tile; the per-(n, g) coefficients are reloaded only when the row enters another sample (with
// EPI they are per (n, c), which the same reload covers). EPI: the activation is chosen once per
// launch (with_activation), so that the element loop has no switch for the common ones.
template <typename scalar_t, int V, ApplyMode M>
__global__ void __launch_bounds__(kThreads, kMinBlocks) apply_cols_kernel(
    const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain> a) {
  if constexpr (M == ApplyMode::Plain) {
    apply_cols_tiles<M, kAnyAct, kUnroll, V, scalar_t>(a);
  } else {
    with_activation(a.epi.act, [&](auto act) {
      constexpr int kA = decltype(act)::value;
      apply_cols_tiles<M, kA, epi_apply_unroll<M, kA, V, true>(), V, scalar_t>(a);
    });
  }
}

// The EPI forward without residual or multiplier (GN+SiLU, AdaGN+SiLU, norm+ReLU), one kernel an
// activation A (None, SiLU, ReLU): no operand streams and no other activation's temporaries in
// its registers, so that it keeps kUnroll packs in flight like the plain kernel, where
// apply_cols_kernel's forward keeps one 8-lane pack. FUSEDNORM_COLS_ACT_KERNEL=0 turns it off.
// H200 profiler, GN+SiLU fp16 channels-last: 31.5 -> 25.8 us (8,320,64,64), 17.3 -> 13.6 us
// (8,640,32,32), 8.0 -> 6.9 us (8,1280,16,16) (RESULTS.md, sixteenth run).
template <typename scalar_t, int V, int A>
__global__ void __launch_bounds__(kThreads, kMinBlocks) apply_cols_act_kernel(
    const WithEpi<ApplyArgs<scalar_t>, scalar_t> a) {
  apply_cols_tiles<ApplyMode::EpiForward, A, kUnroll, V, scalar_t, false>(a);
}

// ---------------------------------------------------------------------------------------------
// Host side: tiling plans and launches.

int num_sms() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// The split passes' tiling is the planner's (plan.cpp; docs/design.md, "Split passes"), on this
// device.
static_assert(kThreads == plan::kSplitThreads && kUnroll == plan::kSplitUnroll && kMaxEntries == plan::kMaxEntries &&
                  kMaxParamEntries == plan::kMaxParamEntries && kBlocksPerSM == plan::kSplitBlocksPerSM,
    "the planner's split-pass constants are the kernels'");
using plan::ceil_log2;
using plan::log_piece;
using plan::Tiling;

int grid_for(int64_t tiles) { return plan::grid_for(tiles, num_sms()); }

Tiling tile_rows(int64_t rows, int64_t lenv, int64_t max_split) {
  return plan::tile_rows(rows, lenv, max_split, num_sms());
}

Tiling tile_cols(int64_t N, int64_t S, int64_t cvn, int64_t max_split) {
  return plan::tile_cols(N, S, cvn, max_split, num_sms());
}

Tiling tile_apply_cols(int64_t rows, int64_t cvn) { return plan::tile_apply_cols(rows, cvn, num_sms()); }

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

template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_rows(const KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  reduce_rows_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, bool GRADS, bool EPI>
void launch_reduce_cols(const KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  reduce_cols_kernel<scalar_t, V, GRADS, EPI><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// As dispatch_activation, for the kernels instantiated for the common activations only (none,
// SiLU, ReLU: the register, channels-last one-pass and channels-last activation kernels, where
// each activation is one more copy of an unrolled element loop). Returns false, calling nothing,
// for the others: the caller takes a more general kernel.
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

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_rows(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  apply_rows_kernel<scalar_t, V, M><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V, ApplyMode M>
void launch_apply_cols(const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain>& a, bool act_kernel) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (M == ApplyMode::EpiForward) {
    // The plan's cols_act_kernel: no residual, no multiplier, a common activation.
    if (act_kernel) {
      const auto launch = [&](auto kernel) {
        kernel<<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
        launch(apply_cols_act_kernel<scalar_t, V, static_cast<int>(decltype(act)::value)>);
      });
      if (launched) return;  // the other activations: the shared kernel
    }
  }
  apply_cols_kernel<scalar_t, V, M><<<grid_for(a.tiles), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(std::integral_constant<ApplyMode, M>{}) with the EPI apply mode of the direction.
template <typename F>
void with_epi_mode(bool backward, const F& f) {
  if (backward) {
    f(std::integral_constant<ApplyMode, ApplyMode::EpiBackward>{});
  } else {
    f(std::integral_constant<ApplyMode, ApplyMode::EpiForward>{});
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
  return e;
}

// Whether every elementwise pointer of `e` allows packs of `bytes` bytes (null ones do).
template <typename scalar_t>
bool epi_aligned(const EpiArgs<scalar_t>& e, size_t bytes = 16) {
  return aligned_to(e.residual, bytes) && aligned_to(e.multiplier, bytes) &&
         aligned_to(e.grad_residual, bytes) && aligned_to(e.grad_multiplier, bytes);
}

// Pass 1 of either direction. Fills `part` (3 values per (n, piece, k), pieces of 2^log_q
// channels) and, for GRADS, `part_c` (2 values per (n, k, c)); returns the number of partials
// per group and the number of chunks.
struct Partials {
  at::Tensor part, part_c;
  int64_t entries = 0;  // partials per (n, g) in `part`
  int64_t split = 1;    // chunks of the reduced extent
};

// EPI (backward only): dy is dz, made into dp with the epilogue `ep`, whose p needs the saved
// rstd and the bias; the weight sums use w_eff.
template <typename scalar_t, bool GRADS, bool EPI>
Partials reduce_pass(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean,
    const at::Tensor& weight, const GroupNormShape& sh, Layout layout, const at::Tensor& rstd,
    const at::Tensor& bias, const Epilogue* ep) {
  static_assert(GRADS || !EPI, "the forward statistics are those of x alone");
  using acc_t = acc_type<scalar_t>;
  constexpr int VW = pack_width<scalar_t>();
  const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* dyp = GRADS ? dy.data_ptr<scalar_t>() : nullptr;
  // p, and so the residual, is needed here only for act'(p).
  EpiArgs<scalar_t> epi{};
  if (EPI) {
    epi = epi_args<scalar_t>(*ep, ep->activation != Activation::None);
    epi.rstd = rstd.data_ptr<acc_t>();
    epi.bias = param_ref<scalar_t>(bias);
  }
  const bool ptrs_aligned = aligned16(xp) && (!GRADS || aligned16(dyp)) && epi_aligned(epi);
  Partials out;
  if (layout == Layout::ChannelsFirst) {
    KernelArgs<RowsArgs<scalar_t>, scalar_t, EPI> a{};
    a.x = xp;
    a.dy = dyp;
    a.C = sh.C;
    a.D = sh.D;
    // Forward: one row per group, the pieces are whole groups. Backward: one row per (n, c),
    // pieces are channels.
    a.rows = GRADS ? sh.N * sh.C : sh.N * sh.G;
    a.len = GRADS ? sh.S : sh.D * sh.S;
    const bool vec = VW > 1 && ptrs_aligned && a.len % VW == 0;
    const int V = vec ? VW : 1;
    // Backward: a group merges D * split partials, a channel's gradients N * split.
    const int64_t max_split =
        GRADS ? imax(1, imin(kMaxEntries / sh.D, kMaxParamEntries / sh.N)) : kMaxEntries;
    const Tiling t = tile_rows(a.rows, a.len / V, max_split);
    a.split = t.split;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    out.part = at::empty({a.rows * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::empty({sh.N * t.split * sh.C * 2}, acc_opts);
      a.part_c = out.part_c.data_ptr<acc_t>();
      a.mean = mean.data_ptr<acc_t>();
      a.weight = param_ref<scalar_t>(weight);
    }
    if constexpr (EPI) a.epi = epi;
    out.entries = GRADS ? sh.D * t.split : t.split;
    out.split = t.split;
    if (vec) {
      launch_reduce_rows<scalar_t, VW, GRADS, EPI>(a);
    } else {
      launch_reduce_rows<scalar_t, 1, GRADS, EPI>(a);
    }
  } else {
    KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI> a{};
    a.x = xp;
    a.dy = dyp;
    a.S = sh.S;
    a.C = sh.C;
    a.G = sh.G;
    a.D = sh.D;
    const bool vec = VW > 1 && ptrs_aligned && sh.C % VW == 0;
    const int V = vec ? VW : 1;
    const int64_t cvn = sh.C / V;
    a.log_tx = ceil_log2(imin(cvn, kThreads));
    a.log_q = log_piece(sh.D, a.log_tx, V);
    const int64_t pieces_per_group = sh.D >> a.log_q;
    const int64_t max_split =
        GRADS ? imax(1, imin(kMaxEntries / pieces_per_group, kMaxParamEntries / sh.N))
              : imax(1, kMaxEntries / pieces_per_group);
    const Tiling t = tile_cols(sh.N, sh.S, cvn, max_split);
    TORCH_INTERNAL_ASSERT(t.log_tx == a.log_tx);
    a.split = t.split;
    a.chunk = t.chunk;
    a.ncb = t.ncb;
    a.tiles = t.tiles;
    out.part = at::empty({sh.N * (sh.C >> a.log_q) * t.split * 3}, acc_opts);
    a.part = out.part.data_ptr<acc_t>();
    if (GRADS) {
      out.part_c = at::empty({sh.N * t.split * sh.C * 2}, acc_opts);
      a.part_c = out.part_c.data_ptr<acc_t>();
      a.mean = mean.data_ptr<acc_t>();
      a.weight = param_ref<scalar_t>(weight);
    }
    if constexpr (EPI) a.epi = epi;
    out.entries = pieces_per_group * t.split;
    out.split = t.split;
    if (vec) {
      launch_reduce_cols<scalar_t, VW, GRADS, EPI>(a);
    } else {
      launch_reduce_cols<scalar_t, 1, GRADS, EPI>(a);
    }
  }
  return out;
}

// The elementwise pass: y (dy undefined) or dx. With `epi` (the EPI kernels): the forward's z,
// or the backward's dx (`out`, may then be null), grad_residual and grad_multiplier; `bias` is
// then needed in the backward too (for p).
template <typename scalar_t>
void apply_pass(const at::Tensor& x, const at::Tensor& dy, scalar_t* out, const at::Tensor& rec,
    const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh, Layout layout,
    const EpiArgs<scalar_t>* epi = nullptr, bool cols_act_kernel = false) {
  using acc_t = acc_type<scalar_t>;
  constexpr int VW = pack_width<scalar_t>();
  ApplyArgs<scalar_t> a{};
  a.x = x.data_ptr<scalar_t>();
  a.dy = dy.defined() ? dy.data_ptr<scalar_t>() : nullptr;
  a.out = out;
  a.rec = rec.data_ptr<acc_t>();
  a.weight = param_ref<scalar_t>(weight);
  a.bias = param_ref<scalar_t>(bias);
  a.C = sh.C;
  a.S = sh.S;
  a.G = sh.G;
  a.D = sh.D;
  const bool ptrs_aligned = aligned16(a.x) && aligned16(a.out) && (a.dy == nullptr || aligned16(a.dy)) &&
                            (epi == nullptr || epi_aligned(*epi));
  // The EPI kernels' arguments, used only with `epi`.
  auto with_epi = [&] { return WithEpi<ApplyArgs<scalar_t>, scalar_t>{a, *epi}; };
  // With S == 1 both layouts are (N, C) rows; the column kernel then keeps whole rows busy.
  if (layout == Layout::ChannelsFirst && sh.S != 1) {
    a.rows = sh.N * sh.C;
    a.len = sh.S;
    const bool vec = VW > 1 && ptrs_aligned && sh.S % VW == 0;
    const Tiling t = tile_rows(a.rows, vec ? sh.S / VW : sh.S, std::numeric_limits<int64_t>::max());
    a.split = t.split;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    if (epi != nullptr) {
      with_epi_mode(a.dy != nullptr, [&](auto mode) {
        if (vec) {
          launch_apply_rows<scalar_t, VW, decltype(mode)::value>(with_epi());
        } else {
          launch_apply_rows<scalar_t, 1, decltype(mode)::value>(with_epi());
        }
      });
    } else if (vec) {
      launch_apply_rows<scalar_t, VW, ApplyMode::Plain>(a);
    } else {
      launch_apply_rows<scalar_t, 1, ApplyMode::Plain>(a);
    }
  } else {
    a.rows = sh.N * sh.S;
    a.len = sh.C;
    // The EPI backward column kernel keeps six coefficients per lane (a, b, hi, lo, c and the
    // folded bias): with 8 lanes they do not fit its register cap, so 2-byte types take 4-wide
    // (8-byte) packs there. The forward, with a compile-time activation, fits 16-byte packs.
    constexpr int VE = VW > 4 ? 4 : VW;
    const int width = epi != nullptr && a.dy != nullptr ? VE : VW;
    const size_t bytes = static_cast<size_t>(width) * sizeof(scalar_t);
    const bool vec = width > 1 && sh.C % width == 0 &&
                     (epi == nullptr ? ptrs_aligned
                                     : aligned_to(a.x, bytes) && aligned_to(a.out, bytes) &&
                                           aligned_to(a.dy, bytes) && epi_aligned(*epi, bytes));
    const Tiling t = tile_apply_cols(a.rows, vec ? sh.C / width : sh.C);
    a.split = t.ncb;
    a.chunk = t.chunk;
    a.tiles = t.tiles;
    a.log_tx = t.log_tx;
    if (epi != nullptr) {
      with_epi_mode(a.dy != nullptr, [&](auto mode) {
        constexpr ApplyMode kMode = decltype(mode)::value;
        if (vec) {
          launch_apply_cols<scalar_t, kMode == ApplyMode::EpiForward ? VW : VE, kMode>(with_epi(), cols_act_kernel);
        } else {
          launch_apply_cols<scalar_t, 1, decltype(mode)::value>(with_epi(), cols_act_kernel);
        }
      });
    } else if (vec) {
      launch_apply_cols<scalar_t, VW, ApplyMode::Plain>(a, false);
    } else {
      launch_apply_cols<scalar_t, 1, ApplyMode::Plain>(a, false);
    }
  }
}

}  // namespace
}  // namespace fusednorm

#include "group_norm_one_pass.cuh"
#include "group_norm_team.cuh"

namespace fusednorm {
namespace {

int finalize_grid(int64_t items, int log_iw) {
  return grid_for(ceil_div(items, kThreads >> log_iw));
}

// ---------------------------------------------------------------------------------------------
// Planning a call (plan.h): the call's problem, this device, and the residency answers the
// planner asks of the kernels it may launch.

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

plan::DeviceInfo device_info() {
  const cudaDeviceProp& prop = *at::cuda::getCurrentDeviceProperties();
  plan::DeviceInfo d;
  d.sms = prop.multiProcessorCount;
  d.major = prop.major;
  d.minor = prop.minor;
  d.smem_optin = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  d.smem_per_sm = static_cast<int64_t>(prop.sharedMemPerMultiprocessor);
  d.l2_bytes = prop.l2CacheSize;
  d.cooperative_launch = prop.cooperativeLaunch != 0;
  d.clusters_of_16 = prop.major >= 9 && clusters_of_16(prop);
  return d;
}

template <typename scalar_t>
plan::Problem problem_of(const GroupNormShape& sh, Layout layout, const Epilogue& ep, const at::Tensor& weight,
    const at::Tensor& bias) {
  plan::Problem p;
  p.N = sh.N;
  p.C = sh.C;
  p.S = sh.S;
  p.G = sh.G;
  p.elem_bytes = static_cast<int>(sizeof(scalar_t));
  p.bfloat16 = std::is_same_v<scalar_t, at::BFloat16>;
  p.channels_last = layout == Layout::ChannelsLast;
  p.act = static_cast<plan::Act>(static_cast<int>(ep.activation));
  p.weight = weight.defined();
  p.bias = bias.defined();
  p.scale = ep.scale.defined();
  p.shift = ep.shift.defined();
  p.residual = ep.residual.defined();
  p.multiplier = ep.multiplier.defined();
  p.multiplier_is_residual = p.residual && p.multiplier && ep.residual.data_ptr() == ep.multiplier.data_ptr();
  return p;
}

// The CUDA answers to the planner's residency questions about this call's kernels (scalar_t, the
// epilogue's activation, in the backward what its sums keep, in the forward the streams).
template <typename scalar_t>
plan::Residency residency_of(Activation act, bool backward, Keep keep, int forward_streams) {
  using acc_t = acc_type<scalar_t>;
  plan::Residency r;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V > 1) {
    r.team_ctas_per_sm = [act, backward, keep](int64_t smem) {
      int per_sm = 0;
      dispatch_activation(act, [&](auto a) {
        constexpr Activation kA = decltype(a)::value;
        if (!backward) {
          per_sm = team_ctas_per_sm(group_norm_team_kernel<scalar_t, V, kA>, smem);
        } else {
          dispatch_keep<kA>(keep, [&](auto k) {
            per_sm = team_ctas_per_sm(group_norm_team_backward_kernel<scalar_t, V, kA, decltype(k)::value>, smem);
          });
        }
      });
      return per_sm;
    };
    r.cols_ctas_per_sm = [act, forward_streams](int pack_bytes, int64_t smem) {
      return cols_one_pass_ctas_per_sm<scalar_t>(act, forward_streams, pack_bytes, smem);
    };
  }
  r.param_grad_clusters = [](bool per_sample, int parts) {
    return per_sample ? resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, true>, parts)
                      : resident_param_grad_clusters(finalize_param_grads_kernel<acc_t, false>, parts);
  };
  return r;
}

template <typename scalar_t>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  plan::Problem prob = problem_of<scalar_t>(sh, layout, ep, weight, bias);
  const void* residual = ep.residual.defined() ? ep.residual.data_ptr() : nullptr;
  const void* multiplier = ep.multiplier.defined() ? ep.multiplier.data_ptr() : nullptr;
  prob.aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(residual) && aligned16(multiplier);
  const plan::DeviceInfo dev = device_info();
  const int streams = 1 + (residual != nullptr) + (multiplier != nullptr && multiplier != residual);
  const plan::Residency res = residency_of<scalar_t>(ep.activation, /*backward=*/false, Keep::None, streams);
  plan::Plan pl = plan::plan_forward(prob, dev, res, plan::overrides());
  if (pl.path == plan::Path::Team) {
    if (forward_team<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd)) return;
    prob.team_refused = true;  // another context holds part of the device
    pl = plan::plan_forward(prob, dev, res, plan::overrides());
  }
  if (pl.path != plan::Path::Split) {
    forward_one_pass<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
    return;
  }
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const Partials p = reduce_pass<scalar_t, false, false>(x, at::Tensor(), at::Tensor(), at::Tensor(),
      sh, layout, at::Tensor(), at::Tensor(), nullptr);

  at::Tensor rec = at::empty({sh.N * sh.G * kRec}, p.part.options());
  MomentsFinalizeArgs<scalar_t> f{};
  f.part = p.part.data_ptr<acc_t>();
  f.x = x.data_ptr<scalar_t>();
  f.items = sh.N * sh.G;
  f.entries = p.entries;
  f.G = sh.G;
  f.sample_stride = sh.C * sh.S;
  f.group_stride = layout == Layout::ChannelsFirst ? sh.D * sh.S : sh.D;
  f.eps = static_cast<acc_t>(eps);
  f.mean = mean.data_ptr<acc_t>();
  f.rstd = rstd.data_ptr<acc_t>();
  f.rec = rec.data_ptr<acc_t>();
  f.log_iw = log_item_width(p.entries);
  finalize_moments_kernel<scalar_t><<<finalize_grid(f.items, f.log_iw), kThreads, 0, stream>>>(f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (ep.empty()) {
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout);
  } else {
    const EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, /*with_residual=*/true);
    apply_pass<scalar_t>(x, at::Tensor(), y.data_ptr<scalar_t>(), rec, weight, bias, sh, layout, &e, pl.cols_act_kernel);
  }
}

// grad_weight, grad_bias, grad_scale, grad_shift (those `mask` asks for) from the per-(n, k, c)
// partials and the (n, g) records of either backward path.
template <typename scalar_t>
void param_grads_pass(const Partials& p, const at::Tensor& rec, const at::Tensor& weight,
    const at::Tensor& bias, const Epilogue& ep, const GroupNormShape& sh, const FusedGradMask& mask,
    FusedGrads& g, int parts) {
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  ParamGradArgs<acc_t> pg{};
  pg.part_c = p.part_c.data_ptr<acc_t>();
  pg.rec = rec.data_ptr<acc_t>();
  pg.dweight = GradRef{mask[1] ? g.weight.data_ptr() : nullptr, g.weight.scalar_type()};
  pg.dbias = GradRef{mask[2] ? g.bias.data_ptr() : nullptr, g.bias.scalar_type()};
  pg.C = sh.C;
  pg.G = sh.G;
  pg.D = sh.D;
  pg.split = p.split;
  pg.entries = sh.N * p.split;
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

// Fills the requested entries of `g` (mask in schema order: input, weight, bias, scale, shift,
// residual, multiplier). The plain op comes here with an empty epilogue and mask[3..6] false, and
// then runs exactly the EPI = false kernels it always ran.
template <typename scalar_t>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g) {
  using acc_t = acc_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  // dp differs from dz, or w_eff from w: the reduce pass needs the epilogue. (A shift or a
  // residual alone changes neither: the plain kernels then give dx and the sums.)
  const bool epi_sums =
      ep.scale.defined() || ep.multiplier.defined() || ep.activation != Activation::None;
  const bool want_params = mask[1] || mask[2] || mask[3] || mask[4];
  plan::Problem prob = problem_of<scalar_t>(sh, layout, ep, weight, bias);
  prob.backward = true;
  prob.mask = mask;
  {
    // The one-CTA and team backwards' pointers (make_one_pass_backward_args): the residual only
    // where p is needed.
    EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, ep.activation != Activation::None || mask[6]);
    e.grad_residual = mask[5] ? g.residual.data_ptr<scalar_t>() : nullptr;
    e.grad_multiplier = mask[6] ? g.multiplier.data_ptr<scalar_t>() : nullptr;
    prob.aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) &&
        aligned_to(mask[0] ? g.input.data_ptr() : nullptr, 16) && epi_aligned(e);
    // The split reduce pass's (reduce_pass): the epilogue's only with epi_sums.
    const EpiArgs<scalar_t> r =
        epi_sums ? epi_args<scalar_t>(ep, ep.activation != Activation::None) : EpiArgs<scalar_t>{};
    prob.split_aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) && epi_aligned(r);
  }
  const Keep keep = keep_for(ep.activation, ep.multiplier.defined(), mask[5] || mask[6]);
  const plan::DeviceInfo dev = device_info();
  const plan::Residency res = residency_of<scalar_t>(ep.activation, /*backward=*/true, keep, 0);
  plan::Plan pl = plan::plan_backward(prob, dev, res, plan::overrides());
  at::Tensor rec;
  {
    // Groups in one CTA's shared memory, or spread over a team's.
    Partials one;
    bool done = false;
    if (pl.path == plan::Path::Team) {
      done = backward_team<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          one.part_c, rec);
      if (!done) {
        prob.team_refused = true;  // another context holds part of the device
        pl = plan::plan_backward(prob, dev, res, plan::overrides());
      }
    }
    if (pl.path == plan::Path::OneCta) {
      backward_one_pass<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params,
          one.part_c, rec);
      done = true;
    }
    if (done) {
      if (want_params) param_grads_pass<scalar_t>(one, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
      return;
    }
  }
  if (mask[0] || want_params) {
    const Partials p = epi_sums
        ? reduce_pass<scalar_t, true, true>(x, dy, mean, weight, sh, layout, rstd, bias, &ep)
        : reduce_pass<scalar_t, true, false>(x, dy, mean, weight, sh, layout, rstd, bias, nullptr);
    TORCH_INTERNAL_ASSERT(p.split == pl.reduce.split, "the split reduce pass left the planned tiling");

    // The (n, g) records are needed by dx and by grad_weight (for delta).
    rec = at::empty({sh.N * sh.G * kRec}, p.part.options());
    GradCoefArgs<acc_t> f{};
    f.part = p.part.data_ptr<acc_t>();
    f.mean = mean.data_ptr<acc_t>();
    f.rstd = rstd.data_ptr<acc_t>();
    f.rec = rec.data_ptr<acc_t>();
    f.items = sh.N * sh.G;
    f.entries = p.entries;
    f.M = static_cast<acc_t>(sh.D) * static_cast<acc_t>(sh.S);
    f.log_iw = log_item_width(p.entries);
    finalize_grad_coefs_kernel<acc_t><<<finalize_grid(f.items, f.log_iw), kThreads, 0, stream>>>(f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    if (want_params) param_grads_pass<scalar_t>(p, rec, weight, bias, ep, sh, mask, g, pl.param_grad_parts);
  } else {
    // Only grad_residual / grad_multiplier: they need p (hi = m, a = rstd * w_eff), not the dx
    // coefficients, so no reduction at all.
    const at::Tensor zero = at::zeros_like(mean);
    rec = at::stack({mean, zero, rstd, zero, zero}, 2).view({-1});
  }

  if (mask[0] || mask[5] || mask[6]) {
    scalar_t* dx = mask[0] ? g.input.data_ptr<scalar_t>() : nullptr;
    if (!epi_sums && !mask[5] && !mask[6]) {
      apply_pass<scalar_t>(x, dy, dx, rec, weight, at::Tensor(), sh, layout);
    } else {
      // p is needed for act'(p) and for grad_multiplier = dz * act(p); only then the residual.
      EpiArgs<scalar_t> e = epi_args<scalar_t>(ep, ep.activation != Activation::None || mask[6]);
      e.grad_residual = mask[5] ? g.residual.data_ptr<scalar_t>() : nullptr;
      e.grad_multiplier = mask[6] ? g.multiplier.data_ptr<scalar_t>() : nullptr;
      apply_pass<scalar_t>(x, dy, dx, rec, weight, bias, sh, layout, &e);
    }
  }
}

// The plain ops' epilogue.
Epilogue no_epilogue(const at::Tensor&, const GroupNormShape&, Layout) {
  return Epilogue();
}

// Both forward ops. make_ep(x, shape, layout) validates and returns the epilogue once x is in its
// kernel layout.
template <typename MakeEpilogue>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(const at::Tensor& input, int64_t num_groups,
    const OptTensor& weight, const OptTensor& bias, double eps, const MakeEpilogue& make_ep) {
  const GroupNormShape sh = check_group_norm_args(input, num_groups, weight, bias);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(input));
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep = make_ep(x, sh, layout);
  at::Tensor y = empty_in_layout(x, layout, x.scalar_type());
  const auto stat_opts = x.options().dtype(stats_dtype(x.scalar_type()));
  at::Tensor mean = at::empty({sh.N, sh.G}, stat_opts);
  at::Tensor rstd = at::empty({sh.N, sh.G}, stat_opts);
  if (sh.N == 0) return {y, mean, rstd};
  if (x.numel() == 0) {
    // Empty groups (S == 0 or C == 0): mean 0 and variance 0.
    mean.zero_();
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, mean, rstd};
  }
  const at::Tensor w = defined(weight) ? weight->contiguous() : at::Tensor();
  const at::Tensor b = defined(bias) ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fusednorm_group_norm_forward_cuda", [&] {
    forward_impl<scalar_t>(x, w, b, eps, sh, layout, ep, y, mean, rstd);
  });
  return {y, mean, rstd};
}

// Both backward ops; see backward_impl.
template <typename MakeEpilogue>
FusedGrads backward_cuda(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const MakeEpilogue& make_ep, const FusedGradMask& mask, bool sum_residual_multiplier_grads = false) {
  const GroupNormShape sh =
      check_group_norm_backward_args(grad_out, input, mean, rstd, weight, num_groups);
  if (defined(bias)) check_input_and_params(input, c10::nullopt, bias);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(input));
  const Layout layout = layout_for(input);
  const at::Tensor x = to_layout(input, layout);
  const Epilogue ep = make_ep(x, sh, layout);
  FusedGrads g = empty_fused_grads(x, sh, layout, mask, weight, bias, ep, sum_residual_multiplier_grads);
  if (std::none_of(mask.begin(), mask.end(), [](bool wanted) { return wanted; })) return g;
  if (x.numel() == 0) {
    // The elementwise gradients are empty too; the others are sums over nothing.
    g.weight.zero_();
    g.bias.zero_();
    g.scale.zero_();
    g.shift.zero_();
    return g;
  }
  const at::Tensor dy = to_layout(grad_out, layout);
  const at::Tensor m = mean.contiguous();
  const at::Tensor r = rstd.contiguous();
  const at::Tensor w = defined(weight) ? weight->contiguous() : at::Tensor();
  const at::Tensor b = defined(bias) ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fusednorm_group_norm_backward_cuda", [&] {
    backward_impl<scalar_t>(dy, x, m, r, w, b, sh, layout, ep, mask, g);
  });
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cuda(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps) {
  return forward_cuda(input, num_groups, weight, bias, eps, no_epilogue);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, int64_t num_groups,
    std::array<bool, 3> output_mask) {
  const FusedGradMask mask{output_mask[0], output_mask[1], output_mask[2], false, false, false, false};
  const FusedGrads g =
      backward_cuda(grad_out, input, mean, rstd, weight, c10::nullopt, num_groups, no_epilogue, mask);
  return {g.input, g.weight, g.bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_cuda(
    const at::Tensor& input, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
    double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier) {
  return forward_cuda(input, num_groups, weight, bias, eps,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        return make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_group_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier,
    std::array<bool, 7> output_mask, bool sum_residual_multiplier_grads) {
  const FusedGrads g = backward_cuda(grad_out, input, mean, rstd, weight, bias, num_groups,
      [&](const at::Tensor& x, const GroupNormShape& sh, Layout layout) {
        return make_epilogue(x, sh, layout, scale, shift, residual, activation, negative_slope, multiplier);
      },
      kernel_grad_mask(output_mask, sum_residual_multiplier_grads), sum_residual_multiplier_grads);
  return fused_grads_outputs(g, sum_residual_multiplier_grads);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("group_norm_forward", &group_norm_forward_cuda);
  m.impl("group_norm_backward", &group_norm_backward_cuda);
  m.impl("fused_group_norm_forward", &fused_group_norm_forward_cuda);
  m.impl("fused_group_norm_backward", &fused_group_norm_backward_cuda);
}

}  // namespace fusednorm
