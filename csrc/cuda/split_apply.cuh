// The split passes' elementwise pass: y, or dx and the epilogue's operand gradients, in both
// layouts (docs/design.md, "Split passes").
#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/moments.cuh"

#include <cstdint>

namespace fusednorm {
namespace {

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
      const acc_t x = pack_element<acc_t>(xp, j);
      acc_t p = kj.b * ((x - kj.hi) - kj.lo) + kj.c;
      if (has_r) p += pack_element<acc_t>(rp, j);
      acc_t z = device_activation_forward(act, p, e.slope);
      if (has_m) z *= pack_element<acc_t>(mp, j);
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
    const acc_t xc = pack_element<acc_t>(xp, j) - k[l].hi;
    const acc_t dz = pack_element<acc_t>(dp, j);
    const acc_t m = has_m ? pack_element<acc_t>(mp, j) : acc_t(1);
    const acc_t r = has_r ? pack_element<acc_t>(rp, j) : acc_t(0);
    acc_t q = acc_t(0);
    const acc_t g = epi_dp<A>(act, e.slope, xc, dz, r, m, k[l].a, pc[l], want_gm, q);
    o[j] = k[l].a * g + (k[l].b * (xc - k[l].lo) + k[l].c);
    operand_grads_at(sum_grads, g, dz, q, gr[j], gm[j]);
  }
  if (out != nullptr) out[v] = round_pack<scalar_t, V>(o);
  if (grad_residual != nullptr) grad_residual[v] = round_pack<scalar_t, V>(gr);
  if (want_gm && !sum_grads) grad_multiplier[v] = round_pack<scalar_t, V>(gm);
}

// 16-byte packs of x and dz a thread keeps in flight in the backward apply_cols_act_kernel.
constexpr int kActBackwardUnroll = 2;

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

// log2 of apply_rows_kernel's CTA: 128 threads for the plain kernels, kThreads with an epilogue
// (plan.cpp, tile_apply_rows).
constexpr int kLogApplyRowsPlainThreads = 7;
template <ApplyMode M>
constexpr int apply_rows_log_threads() {
  return M == ApplyMode::Plain ? kLogApplyRowsPlainThreads : kLogThreads;
}

// ChannelsFirst with S > 1: a row (n, c) has one coefficient set.
template <typename scalar_t, int V, ApplyMode M>
__global__ void __launch_bounds__(1 << apply_rows_log_threads<M>(), kMinBlocks) apply_rows_kernel(
    const KernelArgs<ApplyArgs<scalar_t>, scalar_t, M != ApplyMode::Plain> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const bool backward = a.dy != nullptr;
  const int log_ty = apply_rows_log_threads<M>() - a.log_tx;
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
            o[j] = apply_one(coef, pack_element<acc_t>(xp[u], j),
                backward ? pack_element<acc_t>(dp[u], j) : acc_t(0));
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
            // Without operands there are no operand gradients either (the launch guarantees it).
            apply_epi_pack<M, A, V, V, OPS>(a.epi, coef, pc, xv[u], dv[u], rv[OPS ? u : 0],
                mv[OPS ? u : 0], outp,
                OPS ? reinterpret_cast<P*>(a.epi.grad_residual) : static_cast<P*>(nullptr),
                OPS ? reinterpret_cast<P*>(a.epi.grad_multiplier) : static_cast<P*>(nullptr),
                r * cvn + cv);
          } else {
            acc_t o[V];
#pragma unroll
            for (int j = 0; j < V; ++j) {
              o[j] = apply_one(coef[j], pack_element<acc_t>(xv[u], j),
                  backward ? pack_element<acc_t>(dv[u], j) : acc_t(0));
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

// The EPI pass without residual or multiplier (GN+SiLU, AdaGN+SiLU, norm+ReLU), one kernel a
// direction M and activation A (None, SiLU, ReLU): no operand streams and no other activation's
// temporaries in its registers, so that it keeps the plain kernel's packs in flight (the
// forward kUnroll, the backward 16-byte packs), where apply_cols_kernel's forward keeps one
// 8-lane pack and its backward 4-lane ones. FUSEDNORM_COLS_ACT_KERNEL=0 turns it off. H200
// profiler, GN+SiLU fp16 channels-last forward: 31.5 -> 25.8 us (8,320,64,64), 17.3 -> 13.6 us
// (8,640,32,32), 8.0 -> 6.9 us (8,1280,16,16) (docs/design.md, "Split passes").
template <typename scalar_t, int V, ApplyMode M, int A>
__global__ void __launch_bounds__(kThreads, kMinBlocks) apply_cols_act_kernel(
    const WithEpi<ApplyArgs<scalar_t>, scalar_t> a) {
  static_assert(M != ApplyMode::Plain, "the plain pass has no activation");
  constexpr int U = M == ApplyMode::EpiForward ? kUnroll : kActBackwardUnroll;
  apply_cols_tiles<M, A, U, V, scalar_t, false>(a);
}

}  // namespace
}  // namespace fusednorm
