// What the forwards that write y from a group's statistics share (the one-pass kernels, the team
// forward, the sweep and the channels-last sweep): their arguments (OnePassArgs, made by
// make_forward_args and make_one_pass_args), a channel's coefficients (the affine parameters with
// the per-(n, c) modulation folded in, times rstd), one element of y (output_element), and
// OnePassOutput, which writes y a pack at a time with a channel's coefficients cached;
// dispatch_bool compiles an output loop with and without the residual and multiplier. Apart from
// the one-pass kernels, so that the other forwards include it without them.

#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "group_norm.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

template <typename scalar_t>
struct OnePassArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  scalar_t* y;
  ParamRef weight, bias;
  acc_t* mean;  // (N, G)
  acc_t* rstd;
  int64_t C, S, G, D, len;  // len = D * S, the elements of a group
  int64_t chunk;            // packs per CTA: a cluster of `cluster` CTAs takes a group
  int cluster;
  bool cols;  // ChannelsLast: a group is S rows of D channels, C elements apart (ColsPlace)
  acc_t eps;
  EpiArgs<scalar_t> epi;

  // x and its distinct tensor-sized operands (the residual and the multiplier may be one tensor).
  int streams() const {
    return 1 + (epi.residual != nullptr) + (epi.multiplier != nullptr && epi.multiplier != epi.residual);
  }

  // ChannelsLast: the first element of group (n, g); its element (s, d) lies s * C + d further.
  __host__ __device__ int64_t cols_group_base(int64_t n, int64_t g) const { return n * S * C + g * D; }

  // Whether the elements of each V-element pack share their coefficients (OnePassOutput's
  // uniform_pack): S a multiple of V (a pack lies in one channel) or no per-channel parameter.
  template <int V>
  __host__ __device__ bool uniform_packs() const {
    return S % V == 0 || uniform_channels();
  }

  // Whether every channel of a group has the same coefficients: no per-channel parameter.
  __host__ __device__ bool uniform_channels() const {
    return weight.ptr == nullptr && bias.ptr == nullptr && epi.scale.ptr == nullptr && epi.shift.ptr == nullptr;
  }
};

// The arguments of a forward over 16-byte packs, but for chunk and cluster; false where a
// tensor-sized operand is not 16-byte aligned. The channels-last sweep takes them so (its rows are
// whole packs, C a multiple of V: the planner's condition).
template <typename scalar_t>
bool make_forward_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd, OnePassArgs<scalar_t>& a) {
  using acc_t = acc_type<scalar_t>;
  a.cols = layout == Layout::ChannelsLast;
  a.epi = epi_args<scalar_t>(ep, /*with_residual=*/true);
  a.x = x.data_ptr<scalar_t>();
  a.y = y.data_ptr<scalar_t>();
  if (!aligned16(a.x) || !aligned16(a.y) || (a.epi.residual != nullptr && !aligned16(a.epi.residual)) ||
      (a.epi.multiplier != nullptr && !aligned16(a.epi.multiplier))) {
    return false;
  }
  a.weight = param_ref<scalar_t>(weight);
  a.bias = param_ref<scalar_t>(bias);
  a.mean = mean.data_ptr<acc_t>();
  a.rstd = rstd.data_ptr<acc_t>();
  a.C = sh.C;
  a.S = sh.S;
  a.G = sh.G;
  a.D = sh.D;
  a.len = sh.D * sh.S;
  a.eps = static_cast<acc_t>(eps);
  return true;
}

// The arguments of the one-pass and team forwards, but for chunk and cluster; false where the
// group's length (ChannelsFirst) or a tensor-sized operand's alignment rules out 16-byte packs,
// or (ChannelsLast) a group's channels are not a whole number of 4-byte packs (the narrowest copy
// of the channels-last shared-memory kernel; the register kernel needs 16-byte ones).
template <typename scalar_t, int V>
bool make_one_pass_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd, OnePassArgs<scalar_t>& a) {
  const bool cols = layout == Layout::ChannelsLast;
  if (cols ? (sh.D * static_cast<int64_t>(sizeof(scalar_t))) % 4 != 0 : (sh.D * sh.S) % V != 0) return false;
  return make_forward_args<scalar_t>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, a);
}

// Calls f(std::true_type()) or f(std::false_type()) as `b`: a loop compiled twice, once without
// what it needs only where b holds. The forward output loops take it for the residual and
// multiplier: predicated off, their handling still took about 60 of the 244 instructions a pack
// of the bfloat16 team forward with SiLU issued, in a loop the SMs spent half their time issuing
// (ncu, VAE row). Device code only: called from host code it compiles without a diagnostic into
// exit(1) (docs/design.md, "Build").
template <typename F>
__device__ __forceinline__ void dispatch_bool(bool b, const F& f) {
  if (b) {
    f(std::true_type());
  } else {
    f(std::false_type());
  }
}

// (w_eff, b_eff) of channel c of sample n: the affine parameters with the per-(n, c) modulation
// folded in (modulate, epilogue.h). No statistics: the channels-last sweep's output kernel loads
// them before it waits for its records.
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ Affine<acc_t> channel_affine(const OnePassArgs<scalar_t>& a, int64_t n, int64_t c) {
  return modulate(a.epi, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
}
// The coefficients of channel c of sample n in y = (x - mean) * a_c + b_c: a_c = rstd * w_eff,
// b_c = b_eff.
template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> output_coefficients(const Affine<acc_t>& m, acc_t rstd) {
  return {rstd * m.w, m.b};
}
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ Affine<acc_t> output_coefficients(const OnePassArgs<scalar_t>& a, int64_t n, int64_t c, acc_t rstd) {
  return output_coefficients(channel_affine<acc_t>(a, n, c), rstd);
}

// Element j of a pack of y, before its rounding to scalar_t, of a group shifted by K whose mean is
// K + shifted_mean (centred on K, then on shifted_mean: (x - mean) keeps its digits where
// |mean| >> std), with channel coefficients (a_c, b_c): the residual added, the activation, the
// multiplier.
template <Activation A, typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ acc_t output_element(const EpiArgs<scalar_t>& e, acc_t K, acc_t shifted_mean, acc_t a_c,
    acc_t b_c, const Pack<scalar_t, V>& xp, const Pack<scalar_t, V>& rp, bool has_r, const Pack<scalar_t, V>& mp,
    bool has_m, int j) {
  acc_t p = ((pack_element<acc_t>(xp, j) - K) - shifted_mean) * a_c + b_c;
  if (has_r) p += pack_element<acc_t>(rp, j);
  acc_t z = device_activation_forward(A, p, e.slope);
  if (has_m) z *= pack_element<acc_t>(mp, j);
  return z;
}

// y = act(((x - K) - shifted_mean) * rstd * w_eff + b_eff + residual) * multiplier for the packs
// of group (n, g), with the per-(n, c) modulation folded into w_eff and b_eff (epilogue.h); a
// channel's coefficients are cached, as with S >= V a pack lies in one channel. A: the activation,
// fixed at compile time. kBias (the team forward's, uniform packs): y of x + input_bias, K the
// group's shift in x + input_bias; channel c's elements are shifted by K - p_c instead
// (docs/design.md, "Input bias").
template <typename scalar_t, int V, Activation A, bool kBias = false>
struct OnePassOutput {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const OnePassArgs<scalar_t>& a;
  int64_t n, c_first;
  acc_t K, shifted_mean, rstd;
  acc_t K_group;  // kBias: the group's shift, K that of the cached channel
  bool uniform;  // every pack's elements share their coefficients (OnePassArgs::uniform_packs)
  int64_t cached_c = -1;
  acc_t ca = acc_t(0), cb = acc_t(0);
  // The elements [lo, hi) of the group share the cached coefficients (uniform packs): a thread's
  // next pack mostly lies in the same channel, and testing the range replaces a division a pack.
  int64_t lo = 0, hi = 0;

  __device__ __forceinline__ OnePassOutput(
      const OnePassArgs<scalar_t>& args, int64_t n_, int64_t g, acc_t K_, acc_t shifted_mean_, acc_t rstd_)
      : a(args), n(n_), c_first(g * args.D), K(K_), shifted_mean(shifted_mean_), rstd(rstd_), K_group(K_),
        uniform(args.template uniform_packs<V>()) {}

  // Pack v (counted from the group's start) of y from x's, with the residual's and multiplier's
  // packs where they are present.
  __device__ __forceinline__ P operator()(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    return uniform ? uniform_pack(v, xp, rp, has_r, mp, has_m) : straddling_pack(v, xp, rp, has_r, mp, has_m);
  }

  // A pack that may straddle channels: the channel of its first element, then counted forward
  // element by element.
  __device__ __forceinline__ P straddling_pack(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    int64_t c = div_nn(v * V, a.S);
    int64_t rem = v * V - c * a.S;
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j > 0 && ++rem == a.S) {
        rem = 0;
        ++c;
      }
      coefficients(c_first + c);
      z[j] = element(xp, rp, has_r, mp, has_m, j);
    }
    return round_pack<scalar_t, V>(z);
  }

  // A pack with the cached coefficients (every channel's, where OnePassArgs::uniform_channels).
  __device__ __forceinline__ P constant_pack(const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) const {
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) z[j] = element(xp, rp, has_r, mp, has_m, j);
    return round_pack<scalar_t, V>(z);
  }

  // A pack whose elements share their coefficients: S a multiple of V (a pack lies in one channel)
  // or no per-channel parameter at all. The element loop then holds no channel logic, which
  // matters where it is unrolled over a thread's R packs (the register kernel).
  __device__ __forceinline__ P uniform_pack(int64_t v, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m) {
    const int64_t first = v * V;
    if (first < lo || first >= hi) {
      const int64_t c = div_nn(first, a.S);
      lo = c * a.S;
      hi = lo + a.S;
      coefficients(c_first + c);
    }
    return constant_pack(xp, rp, has_r, mp, has_m);
  }

  // Element j of a pack of y, before its rounding to scalar_t (round_pack).
  __device__ __forceinline__ acc_t element(const P& xp, const P& rp, bool has_r, const P& mp, bool has_m, int j) const {
    return element_with(ca, cb, xp, rp, has_r, mp, has_m, j);
  }

  __device__ __forceinline__ acc_t element_with(
      acc_t a_c, acc_t b_c, const P& xp, const P& rp, bool has_r, const P& mp, bool has_m, int j) const {
    return output_element<A>(a.epi, K, shifted_mean, a_c, b_c, xp, rp, has_r, mp, has_m, j);
  }

  __device__ __forceinline__ Affine<acc_t> channel(int64_t c) const { return output_coefficients(a, n, c, rstd); }

  __device__ __forceinline__ void coefficients(int64_t c) {
    if (c != cached_c) {
      const Affine<acc_t> m = channel(c);
      ca = m.w;
      cb = m.b;
      if constexpr (kBias) K = K_group - a.epi.input_bias.template at<acc_t>(n, c);
      cached_c = c;
    }
  }

  // ChannelsLast: a pack holds V channels, first_lane the group's channel of its element 0 (the
  // same for every pack of a thread: its coefficients are loaded once, into lane_a / lane_b).
  __device__ __forceinline__ void lane_coefficients(int first_lane, acc_t (&lane_a)[V], acc_t (&lane_b)[V]) const {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const Affine<acc_t> m = channel(c_first + first_lane + j);
      lane_a[j] = m.w;
      lane_b[j] = m.b;
    }
  }

  __device__ __forceinline__ P lane_pack(const acc_t (&lane_a)[V], const acc_t (&lane_b)[V], const P& xp,
      const P& rp, bool has_r, const P& mp, bool has_m) const {
    acc_t z[V];
#pragma unroll
    for (int j = 0; j < V; ++j) z[j] = element_with(lane_a[j], lane_b[j], xp, rp, has_r, mp, has_m, j);
    return round_pack<scalar_t, V>(z);
  }
};

}  // namespace
}  // namespace fusednorm
