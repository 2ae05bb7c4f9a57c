// The one-CTA backward: a group (n, g) in one CTA's shared memory, dx and the sums behind the
// parameter gradients in one launch (docs/design.md, "One-CTA backward"); its per-group pieces
// are shared with the team backward.
#pragma once

#include <cuda_pipeline.h>
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/keep.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/common/shared_memory.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/paths.h"
#include "group_norm.h"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <limits>

namespace fusednorm {
namespace {

// ---------------------------------------------------------------------------------------------
// The one-pass backward: one CTA per group (n, g) with x, dz and the operands p needs in shared
// memory. It makes dp = dz * multiplier * act'(p) (epilogue.h), the per-(n, c) sums of dp and
// dp * (x - m) (left in part_c for the parameter gradients, as the split reduce pass leaves them
// with one chunk), the group's dx coefficients (rec, as finalize_grad_coefs_kernel writes them),
// and then dx, grad_residual and grad_multiplier: one launch instead of three. The per-channel
// sums need a channel's elements together: with S > 1 (S a multiple of the pack width) a segment
// of 2^log_seg threads takes a channel, with S == 1 a thread takes a pack of V channels.

template <typename scalar_t>
struct OnePassBackwardArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  const scalar_t* dz;
  const acc_t* mean;  // saved statistics (N, G)
  const acc_t* rstd;
  ParamRef weight, bias;
  scalar_t* dx;   // null: not wanted
  acc_t* part_c;  // 2 per (n, c); null: no parameter gradient wanted
  acc_t* rec;     // kRec per (n, g), for the parameter gradients; null likewise
  int64_t C, S, G, D, len;
  int log_seg;
  EpiArgs<scalar_t> epi;  // residual only where p is needed; grad_residual / grad_multiplier outputs

  // x, dz and the distinct tensor-sized operands read (the residual only where p is needed).
  int streams() const {
    return 2 + (epi.residual != nullptr) + (epi.multiplier != nullptr && epi.multiplier != epi.residual);
  }
};

// A channel's backward coefficients: w_eff and the folded bias pc (the affine and the epilogue's
// scale / shift at (n, c)), and ea = rstd * w_eff, dp's factor in dx.
template <typename acc_t>
struct ChannelCoefs {
  acc_t w_eff, pc, ea;
};

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ ChannelCoefs<acc_t> channel_coefs(const OnePassBackwardArgs<scalar_t>& a, int64_t n,
    int64_t c, acc_t rstd) {
  const Affine<acc_t> m = modulate(a.epi, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
  return {m.w, m.b, rstd * m.w};
}

// A group's packs of x, dz and the operands p needs, in shared memory (the one-CTA and team
// backwards): each stream `stride` packs after the one before, the multiplier sharing the
// residual's when they are one tensor. Called as element(v, j, xc, dz, r, m), it reads element j
// of pack v: x - mean, dz, the residual (0 without) and the multiplier (1 without).
template <typename scalar_t, int V, bool kOperands = true>
struct BackwardOperands {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  P* x;
  P* dz;
  P* r;  // null: p needs no residual
  P* m;  // null: no multiplier
  acc_t mean;

  __device__ BackwardOperands(P* base, int64_t stride, const EpiArgs<scalar_t>& e, acc_t group_mean)
      : x(base), dz(base + stride), r(e.residual != nullptr ? dz + stride : nullptr),
        m(e.multiplier == nullptr ? nullptr
            : e.multiplier == e.residual ? r
                                         : dz + stride * (e.residual != nullptr ? 2 : 1)),
        mean(group_mean) {}
  __device__ BackwardOperands(P* x_, P* dz_, acc_t group_mean) : x(x_), dz(dz_), r(nullptr), m(nullptr), mean(group_mean) {}

  // The same streams, for loops compiled without the residual's and multiplier's reads (see
  // dispatch_bool): only where neither is present.
  __device__ __forceinline__ BackwardOperands<scalar_t, V, false> without_operands() const { return {x, dz, mean}; }

  // f(held, tensor) for every stream held: its shared-memory array and its tensor's packs (a
  // multiplier that is the residual once).
  template <typename F>
  __device__ __forceinline__ void for_each_stream(const OnePassBackwardArgs<scalar_t>& a, const F& f) const {
    f(x, reinterpret_cast<const P*>(a.x));
    f(dz, reinterpret_cast<const P*>(a.dz));
    if (r != nullptr) f(r, reinterpret_cast<const P*>(a.epi.residual));
    if (m != nullptr && m != r) f(m, reinterpret_cast<const P*>(a.epi.multiplier));
  }

  // Issues the copies of pack v of every stream from pack `src` of the tensors.
  template <typename I>
  __device__ __forceinline__ void copy_in(I v, int64_t src, const OnePassBackwardArgs<scalar_t>& a) const {
    for_each_stream(a, [&](P* held, const P* tensor) { __pipeline_memcpy_async(&held[v], tensor + src, sizeof(P)); });
  }

  // Each stream's pack is read whole (read_pack), once for the V calls of its elements: read as
  // x[v].v[j], a 16-bit pack took eight 2-byte shared-memory loads a stream (SASS: LDS.U16).
  // 16-bit residual and multiplier packs are read unconditionally, from x where the operand is
  // absent, and their value chosen after: a read predicated on the operand's presence narrowed to
  // those 2-byte loads again. Float packs keep the predicated read, which loads whole already;
  // read unconditionally, the float team backwards spilled (SASS).
  template <typename I>
  __device__ __forceinline__ void operator()(I v, int j, acc_t& xc, acc_t& dzj, acc_t& rj, acc_t& mj) const {
    xc = pack_element<acc_t>(read_pack(x[v]), j) - mean;
    dzj = pack_element<acc_t>(read_pack(dz[v]), j);
    if constexpr (!kOperands) {
      rj = acc_t(0);
      mj = acc_t(1);
    } else if constexpr (sizeof(scalar_t) == 2) {
      const acc_t held_r = pack_element<acc_t>(read_pack((r != nullptr ? r : x)[v]), j);
      const acc_t held_m = pack_element<acc_t>(read_pack((m != nullptr ? m : x)[v]), j);
      rj = r != nullptr ? held_r : acc_t(0);
      mj = m != nullptr ? held_m : acc_t(1);
    } else {
      rj = r != nullptr ? pack_element<acc_t>(r[v], j) : acc_t(0);
      mj = m != nullptr ? pack_element<acc_t>(m[v], j) : acc_t(1);
    }
  }
};

// A group's dx coefficients from its sums over its M elements, sum w_eff * dp, sum w_eff * dp *
// (x - m) and sum (x - m), m the saved mean (the arithmetic of finalize_grad_coefs_kernel), and
// their (n, g) record for the parameter gradients.
template <typename acc_t>
struct GroupGradCoefs {
  acc_t delta, b1, b2;

  __device__ GroupGradCoefs(acc_t sum_wdp, acc_t sum_wdpxc, acc_t sum_xc, acc_t rstd, acc_t M) {
    delta = sum_xc / M;
    const acc_t B = sum_wdpxc - delta * sum_wdp;
    b1 = -rstd * rstd * rstd * B / M;
    b2 = -rstd * sum_wdp / M;
  }

  __device__ void store(acc_t* rec, acc_t mean, acc_t rstd) const {
    rec[0] = mean;
    rec[1] = delta;
    rec[2] = rstd;
    rec[3] = b1;
    rec[4] = b2;
  }
};

// The residual's and multiplier's gradients of a group's packs (or a team chunk's), indexed as
// the packs held in shared memory: null where not wanted; `sum`: the two outputs are one buffer
// (one tensor was both operands), which takes their sum.
template <typename scalar_t, int V>
struct OperandGrads {
  using P = Pack<scalar_t, V>;
  P* residual = nullptr;
  P* multiplier = nullptr;
  bool sum = false;

  OperandGrads() = default;
  // `first`: the pack of the tensors that held pack 0 is.
  __device__ OperandGrads(const EpiArgs<scalar_t>& e, int64_t first)
      : residual(e.grad_residual != nullptr ? reinterpret_cast<P*>(e.grad_residual) + first : nullptr),
        multiplier(e.grad_multiplier != nullptr ? reinterpret_cast<P*>(e.grad_multiplier) + first : nullptr),
        sum(residual != nullptr && residual == multiplier) {}

  __device__ __forceinline__ bool wanted() const { return residual != nullptr || multiplier != nullptr; }

  // Stores pack v's gradients, given before their rounding to scalar_t (element_dp's gr, gm).
  template <typename acc_t, typename I>
  __device__ __forceinline__ void store(I v, const acc_t (&gr)[V], const acc_t (&gm)[V]) const {
    if (residual != nullptr) residual[v] = round_pack<scalar_t, V>(gr);
    if (multiplier != nullptr && !sum) multiplier[v] = round_pack<scalar_t, V>(gm);
  }
};

// dp at element j of pack v (element(v, j, xc, dz, r, m) reads it), x - m into xc, and with GRADS
// grad_residual = dp and grad_multiplier = dz * act(p) into gr and gm (their sum into gr when
// grads.sum). want_q: grad_multiplier wanted.
template <Activation A, bool GRADS, typename scalar_t, int V, typename acc_t, typename Element, typename I>
__device__ __forceinline__ acc_t element_dp(const EpiArgs<scalar_t>& e, const Element& element, I v, int j,
    acc_t ea, acc_t pc, bool want_q, const OperandGrads<scalar_t, V>& grads, acc_t& xc, acc_t& gr, acc_t& gm) {
  acc_t dz, r, m, q = acc_t(0);
  element(v, j, xc, dz, r, m);
  const acc_t dp = epi_dp<static_cast<int>(A)>(A, e.slope, xc, dz, r, m, ea, pc, GRADS && want_q, q);
  if (GRADS) operand_grads_at(grads.sum, dp, dz, q, gr, gm);
  return dp;
}

// The dx phase at one element: dx = ea * dp + b1 * ((x - m) - delta) + b2, dp read as the element's
// dz (the kept dp, or dz itself where dp = dz: no activation is applied here, see
// dispatch_dx_grads), and with GRADS grad_residual and grad_multiplier (element_dp), all before
// their rounding to scalar_t (round_pack, a pack at a time).
template <bool GRADS, typename scalar_t, int V, typename acc_t, typename Element, typename I>
__device__ __forceinline__ void backward_outputs(const EpiArgs<scalar_t>& e, const Element& element, I v, int j,
    const ChannelCoefs<acc_t>& k, const GroupGradCoefs<acc_t>& g, bool want_q, const OperandGrads<scalar_t, V>& grads,
    acc_t& dx, acc_t& gr, acc_t& gm) {
  acc_t xc;
  const acc_t dp = element_dp<Activation::None, GRADS>(e, element, v, j, k.ea, k.pc, want_q, grads, xc, gr, gm);
  dx = k.ea * dp + (g.b1 * (xc - g.delta) + g.b2);
}

// Keep (common/keep.cuh): what the sums phase leaves for the dx phase.

// Stores pack v's dp over its dz, and with DpAndGrads its grad_residual and grad_multiplier.
template <Keep K, typename scalar_t, int V, typename acc_t, typename Element, typename I>
__device__ __forceinline__ void keep_pack(const Element& element, I v, const acc_t (&dp)[V], const acc_t (&gr)[V],
    const acc_t (&gm)[V], const OperandGrads<scalar_t, V>& grads) {
  if constexpr (K != Keep::None) element.dz[v] = round_pack<scalar_t, V>(dp);
  if constexpr (K == Keep::DpAndGrads) grads.store(v, gr, gm);
}

// Adds dp, dp * (x - m) and x - m over the packs base + k of one channel, k = first, first + step,
// ... below end (element(v, j, xc, dz, r, m) reads element j of pack v): the per-channel sums of
// the one-CTA and team backwards, keeping what K says for the dx phase. I: the pack index type of
// the caller.
template <Activation A, int V, Keep K = Keep::None, typename scalar_t, typename acc_t, typename I, typename Element>
__device__ __forceinline__ void add_channel_sums(Sums<acc_t, 1>& s, const EpiArgs<scalar_t>& e,
    const Element& element, I base, I first, I end, int step, acc_t ea, acc_t pc,
    const OperandGrads<scalar_t, V>& grads = {}) {
  for (I k = first; k < end; k += step) {
    const I v = base + k;
    acc_t dpv[V], gr[V], gm[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      acc_t xc;
      const acc_t dp = element_dp<A, K == Keep::DpAndGrads>(e, element, v, j, ea, pc, e.grad_multiplier != nullptr,
          grads, xc, gr[j], gm[j]);
      s.dy[0] += dp;
      s.dyxc[0] += dp * xc;
      s.xc[0] += xc;
      dpv[j] = dp;
    }
    keep_pack<K>(element, v, dpv, gr, gm, grads);
  }
}

template <typename scalar_t>
Keep keep_for(const OnePassBackwardArgs<scalar_t>& a) {
  const EpiArgs<scalar_t>& e = a.epi;
  return keep_for(e.act, e.multiplier != nullptr, e.grad_residual != nullptr || e.grad_multiplier != nullptr);
}

// Calls f(std::integral_constant<Keep, k>()); with an activation k is never Keep::None, which is
// not instantiated there.
template <Activation A, typename F>
void dispatch_keep(Keep k, const F& f) {
  if constexpr (A == Activation::None) {
    if (k == Keep::None) {
      f(std::integral_constant<Keep, Keep::None>());
      return;
    }
  }
  if (k == Keep::DpAndGrads) {
    f(std::integral_constant<Keep, Keep::DpAndGrads>());
  } else {
    f(std::integral_constant<Keep, Keep::Dp>());
  }
}

// Calls f(operands) for the sums phase of a kernel keeping K: element, or where the sums write no
// operand gradients and neither residual nor multiplier is held, element.without_operands() (a
// loop without their reads, see dispatch_bool). With K == None neither is ever held (dp = dz), yet
// the test stays: without it (one sums loop fewer) the plain backwards' registers fell out
// differently and they took 1-2% longer (docs/design.md, "One-CTA backward").
template <Keep K, typename scalar_t, int V, typename F>
__device__ __forceinline__ void with_sums_operands(const EpiArgs<scalar_t>& e, const BackwardOperands<scalar_t, V>& element,
    const F& f) {
  if constexpr (K != Keep::DpAndGrads) {
    if (e.residual == nullptr && e.multiplier == nullptr) {
      f(element.without_operands());
      return;
    }
  }
  f(element);
}

// Calls write(std::bool_constant<GRADS>()) for the dx phase of a kernel keeping K, whose loop makes
// dx from x and dp alone as the plain backward (element.without_operands(), no activation): dp is
// the kept one, or dz with K == None (no activation, no multiplier). GRADS: grad_residual (= dp) is
// left to this loop, with K == None where it is wanted (grad_multiplier needs a multiplier, so is
// written by the sums phase). The loop without it holds fewer registers.
template <Keep K, typename scalar_t, int V, typename Write>
__device__ __forceinline__ void dispatch_dx_grads(const OperandGrads<scalar_t, V>& grads, const Write& write) {
  if constexpr (K == Keep::None) {
    if (grads.wanted()) {
      write(std::true_type());
      return;
    }
  }
  write(std::false_type());
}

// CTAs of up to kBackwardThreads threads, two an SM (at most 64 registers a thread): the groups
// of 1024 packs and more take 512 threads (backward_threads), the others kOnePassThreads.
constexpr int kBackwardThreads = 512;

template <typename scalar_t, int V, Activation A, Keep K>
__global__ void __launch_bounds__(kBackwardThreads, 2) group_norm_backward_one_pass_kernel(
    const OnePassBackwardArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(kSmemLineBytes) unsigned char one_pass_smem[];
  __shared__ acc_t red[kBackwardThreads / kWarp];
  __shared__ Sums<acc_t, 1> seg_smem[kBackwardThreads / kWarp];
  const int threads = static_cast<int>(blockDim.x);
  const EpiArgs<scalar_t>& e = a.epi;
  const int64_t item = blockIdx.x;
  const int64_t n = div_nn(item, a.G);
  const int64_t g = item - n * a.G;
  const int64_t off = item * a.len;
  const int64_t lenv = a.len / V;
  const BackwardOperands<scalar_t, V> element(reinterpret_cast<P*>(one_pass_smem), lenv, e, a.mean[item]);
  for (int64_t v = threadIdx.x; v < lenv; v += threads) element.copy_in(v, item * lenv + v, a);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();  // the sums below read packs that other threads copied
  const acc_t rstd = a.rstd[item];
  const bool want_q = e.grad_multiplier != nullptr;

  // Sums: this thread's share of sum w_eff * dp, sum w_eff * dp * (x - m) and sum (x - m), keeping
  // what K says for the dx phase.
  Sums<acc_t, 1> mine;
  clear(mine);
  const int64_t c_first = g * a.D;
  with_sums_operands<K>(e, element, [&](const auto& operands) {
    const OperandGrads<scalar_t, V> grads =
        K == Keep::DpAndGrads ? OperandGrads<scalar_t, V>(e, item * lenv) : OperandGrads<scalar_t, V>();
    if (a.S == 1) {
      for (int64_t v = threadIdx.x; v < lenv; v += threads) {
        acc_t dpv[V], gr[V], gm[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int64_t c = c_first + v * V + j;
          const ChannelCoefs<acc_t> k = channel_coefs(a, n, c, rstd);
          acc_t xc;
          const acc_t dp = element_dp<A, K == Keep::DpAndGrads>(e, operands, v, j, k.ea, k.pc, want_q, grads, xc, gr[j],
              gm[j]);
          if (a.part_c != nullptr) {
            a.part_c[(n * a.C + c) * 2] = dp;
            a.part_c[(n * a.C + c) * 2 + 1] = dp * xc;
          }
          mine.dy[0] += k.w_eff * dp;
          mine.dyxc[0] += k.w_eff * dp * xc;
          mine.xc[0] += xc;
          dpv[j] = dp;
        }
        keep_pack<K>(operands, v, dpv, gr, gm, grads);
      }
    } else {
      const int64_t spv = a.S / V;  // packs per channel
      const int seg = 1 << a.log_seg;
      const int lane = threadIdx.x & (seg - 1);
      // Rounds of threads / seg channels; every thread takes part in every round, so that the
      // segments' shuffles see whole warps.
      for (int64_t base = 0; base < a.D; base += threads >> a.log_seg) {
        const int64_t cl = base + (threadIdx.x >> a.log_seg);  // channel within the group
        Sums<acc_t, 1> s;
        clear(s);
        acc_t w_eff = acc_t(0);
        if (cl < a.D) {
          const ChannelCoefs<acc_t> k = channel_coefs(a, n, c_first + cl, rstd);
          w_eff = k.w_eff;
          add_channel_sums<A, V, K>(s, e, operands, cl * spv, static_cast<int64_t>(lane), spv, seg, k.ea, k.pc, grads);
        }
        s = segment_reduce(s, a.log_seg, seg_smem);
        if (lane == 0 && cl < a.D) {
          if (a.part_c != nullptr) {
            a.part_c[(n * a.C + c_first + cl) * 2] = s.dy[0];
            a.part_c[(n * a.C + c_first + cl) * 2 + 1] = s.dyxc[0];
          }
          mine.dy[0] += w_eff * s.dy[0];
          mine.dyxc[0] += w_eff * s.dyxc[0];
          mine.xc[0] += s.xc[0];
        }
      }
    }
  });
  // The block sums' barriers also order the kept dp before the dx phase reads it.
  const acc_t M = static_cast<acc_t>(a.len);
  const acc_t A_sum = one_pass_block_sum<kBackwardThreads>(mine.dy[0], red);
  const acc_t dev = one_pass_block_sum<kBackwardThreads>(mine.xc[0], red);
  const GroupGradCoefs<acc_t> coefs(A_sum, one_pass_block_sum<kBackwardThreads>(mine.dyxc[0], red), dev, rstd, M);
  if (threadIdx.x == 0 && a.rec != nullptr) coefs.store(a.rec + item * kRec, element.mean, rstd);

  // The dx phase (see dispatch_dx_grads), where anything is left to write.
  P* dxg = reinterpret_cast<P*>(offset_or_null(a.dx, off));
  const OperandGrads<scalar_t, V> grads(e, item * lenv);
  dispatch_dx_grads<K>(grads, [&](auto with_grads) {
    constexpr bool GRADS = decltype(with_grads)::value;
    if (!GRADS && dxg == nullptr) return;
    const auto operands = element.without_operands();
    int64_t cached_c = -1;
    ChannelCoefs<acc_t> k{acc_t(0), acc_t(0), acc_t(0)};
    for (int64_t v = threadIdx.x; v < lenv; v += threads) {
      acc_t o[V], gr[V], gm[V];
      int64_t c = div_nn(v * V, a.S);
      int64_t rem = v * V - c * a.S;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (j > 0 && ++rem == a.S) {
          rem = 0;
          ++c;
        }
        if (c_first + c != cached_c) {
          cached_c = c_first + c;
          k = channel_coefs(a, n, cached_c, rstd);
        }
        backward_outputs<GRADS>(e, operands, v, j, k, coefs, want_q, grads, o[j], gr[j], gm[j]);
      }
      if (dxg != nullptr) dxg[v] = round_pack<scalar_t, V>(o);
      if (GRADS) grads.store(v, gr, gm);
    }
  });
}

template <typename scalar_t, int V, Activation A, Keep K>
void launch_backward_one_pass(const OnePassBackwardArgs<scalar_t>& a, int64_t items, size_t smem_bytes, int threads) {
  auto kernel = group_norm_backward_one_pass_kernel<scalar_t, V, A, K>;
  allow_dynamic_smem(kernel, smem_bytes);
  kernel<<<static_cast<unsigned>(items), threads, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The arguments of the one-pass and team backwards (dx, grad_residual, grad_multiplier as `mask`
// asks; part_c and rec left null); false where the layout, S or a tensor-sized operand's alignment
// rules out 16-byte packs: both need S to be 1 or a multiple of V (a pack in one channel).
template <typename scalar_t, int V>
bool make_one_pass_backward_args(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, OnePassBackwardArgs<scalar_t>& a) {
  using acc_t = acc_type<scalar_t>;
  const int64_t len = sh.D * sh.S;
  if (layout != Layout::ChannelsFirst || len % V != 0 || (sh.S != 1 && sh.S % V != 0)) return false;
  // p is needed for act'(p) and for grad_multiplier = dz * act(p); only then the residual.
  a.epi = epi_args<scalar_t>(ep, ep.activation != Activation::None || mask[6]);
  a.epi.grad_residual = mask[5] ? g.residual.data_ptr<scalar_t>() : nullptr;
  a.epi.grad_multiplier = mask[6] ? g.multiplier.data_ptr<scalar_t>() : nullptr;
  a.x = x.data_ptr<scalar_t>();
  a.dz = dy.data_ptr<scalar_t>();
  a.dx = mask[0] ? g.input.data_ptr<scalar_t>() : nullptr;
  if (!aligned16(a.x) || !aligned16(a.dz) || !aligned_to(a.dx, 16) || !epi_aligned(a.epi)) return false;
  a.mean = mean.data_ptr<acc_t>();
  a.rstd = rstd.data_ptr<acc_t>();
  a.weight = param_ref<scalar_t>(weight);
  a.bias = param_ref<scalar_t>(bias);
  a.C = sh.C;
  a.S = sh.S;
  a.G = sh.G;
  a.D = sh.D;
  a.len = len;
  return true;
}

// Runs the backward's elementwise outputs (dx, grad_residual, grad_multiplier, as `mask` asks) in
// one CTA a group as planned (path OneCta); part_c and rec are then set for the parameter
// gradients when `want_params`.
template <typename scalar_t>
void backward_one_pass(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params,
    at::Tensor& part_c, at::Tensor& rec) {
  using acc_t = acc_type<scalar_t>;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    TORCH_INTERNAL_ASSERT(false, "one-CTA backward planned for double");
  } else {
    const int64_t items = sh.N * sh.G;
    OnePassBackwardArgs<scalar_t> a{};
    const bool made =
        make_one_pass_backward_args<scalar_t, V>(dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, a);
    TORCH_INTERNAL_ASSERT(made, "one-CTA backward planned for arguments it cannot take");
    if (want_params) {
      const auto opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
      part_c = at::detail::empty_cuda({sh.N * sh.C * 2}, opts);
      rec = at::detail::empty_cuda({items * kRec}, opts);
      a.part_c = part_c.data_ptr<acc_t>();
      a.rec = rec.data_ptr<acc_t>();
    }
    a.log_seg = pl.log_seg;
    const size_t bytes = static_cast<size_t>(pl.smem);
    dispatch_activation(ep.activation, [&](auto act) {
      constexpr Activation kA = decltype(act)::value;
      dispatch_keep<kA>(keep_for(a), [&](auto keep) {
        launch_backward_one_pass<scalar_t, V, kA, decltype(keep)::value>(a, items, bytes, pl.threads);
      });
    });
  }
}

}  // namespace

// The one-CTA backward entry point of paths.h, instantiated per dtype in kernels_<dtype>.cu.
template <typename scalar_t>
void one_cta_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params,
    at::Tensor& part_c, at::Tensor& rec) {
  backward_one_pass<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params, part_c, rec);
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(T)                                                             \
  template void fusednorm::one_cta_backward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,       \
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const GroupNormShape&,    \
      Layout, const Epilogue&, const FusedGradMask&, FusedGrads&, bool, at::Tensor&, at::Tensor&)
