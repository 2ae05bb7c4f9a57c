// The one-pass forward with the group in registers (path Registers; docs/design.md, "Register
// kernel"): RegisterGroup, group_norm_registers_kernel and its launchers, for ChannelsFirst and
// ChannelsLast groups of at most 4 packs (ChannelsLast: rows) a thread of up to 512 (problem 3's
// rows of 8192, UNet's small groups). The arithmetic of the shared-memory kernel
// (one_pass_shared_kernel.cuh) without its staging, whose 64 KB per CTA bounded how many groups an
// SM held.

#pragma once

#include "cuda/cols_place.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_output.cuh"
#include "group_norm.h"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

// Sum over a pack of x - K, and of ((x - K) - shifted_mean)^2: the terms of the register
// kernel's two-pass moments (RegisterGroup::finish).
template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ acc_t pack_shifted_sum(const Pack<scalar_t, V>& p, acc_t K) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < V; ++j) s += pack_element<acc_t>(p, j) - K;
  return s;
}

template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ acc_t pack_squared_deviations(const Pack<scalar_t, V>& p, acc_t K, acc_t shifted_mean) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const acc_t d = (pack_element<acc_t>(p, j) - K) - shifted_mean;
    s += d * d;
  }
  return s;
}

// The one-pass forward with the group in registers, for groups of at most R packs per thread of
// a CTA (S == 1 rows such as problem 3's, UNet's small groups). The arithmetic is the
// shared-memory kernel's, but without its staging: every load of x is issued up front into
// registers, and a CTA holds no shared memory, so that the SM's register file rather than 64 KB per
// CTA bounds how many groups are in flight. E is the number of extra tensor-sized streams: 0,
// 1 (the residual, the multiplier, or both when they are one tensor, as in problem 3's
// (h + y) * y) or 2; it is a template parameter because registers are allocated for the worst path
// of a kernel. finish() takes the activation A at compile time (the output is unrolled over R * V
// elements, and a switch over every activation in it took ptxas ~10 s per kernel with R = 8).
//
// kLate (ChannelsFirst groups without per-channel parameters, OnePassArgs::uniform_channels, as
// problem 3's tail): compiled for three CTAs an SM rather than two, i.e. 40 registers a thread.
// The operands are loaded in the output phase, kLateBatch packs of each at a time, rather than up
// front beside x (the moments need x alone), and the output takes the group's one pair of
// coefficients without OnePassOutput's channel tracking: with either, the kernel spilled under the
// cap (ptxas sm_90: 120-128 bytes for problem 3's tail; 38 registers and none without both).
// Otherwise R * (1 + E) packs are held at once.
//
// kCols: the ChannelsLast layout, where group (n, g) is S rows of D channels, C elements apart
// (UNet's channels_last groups of 40 channels on 8x8 and 16x16 pixels, which the split passes
// took in three launches); a thread's packs are those of its ColsPlace, its k-th in row
// row0 + k * step.
constexpr int kLateBatch = 2;

template <typename scalar_t, int V, int R, int E, bool kCols = false, bool kLate = false>
struct RegisterGroup {
  static_assert(!(kLate && kCols), "the late-operand kernel is ChannelsFirst's");
  using P = Pack<scalar_t, V>;
  static constexpr int kHeld = E > 0 && !kLate ? E : 1;  // operand streams held from load() on
  P x[R];
  P extra[kHeld][kLate ? 1 : R];  // extra[0]: the residual if given, else the multiplier; [1]: the multiplier
  scalar_t first;                 // x's first element, K
  ColsPlace<V> place;             // kCols
  // ChannelsFirst with at most two packs a thread: each pack's channel parameters (weight, bias,
  // scale, shift), loaded beside x so that their latency passes during the moments instead of
  // after them (docs/design.md, "Register kernel"); the output multiplies in rstd as
  // OnePassOutput::channel does, so the bits are the same.
  static constexpr bool kEarlyParams = !kCols && !kLate && R <= 2;
  Affine<acc_type<scalar_t>> params[kEarlyParams ? R : 1];

  // Group (n, g)'s first element.
  __device__ __forceinline__ int64_t group_offset(const OnePassArgs<scalar_t>& a, int64_t item) const {
    if constexpr (kCols) {
      const int64_t n = div_nn(item, a.G);
      return a.cols_group_base(n, item - n * a.G);
    } else {
      return item * a.len;
    }
  }

  // The thread's k-th pack: its index counted from the group's first (ChannelsFirst: packs
  // threadIdx.x + k * blockDim.x), whether it lies in the group, and its first element's offset
  // from the group's first.
  __device__ __forceinline__ int pack_index(int k) const { return static_cast<int>(threadIdx.x + k * blockDim.x); }

  __device__ __forceinline__ bool valid(const OnePassArgs<scalar_t>& a, int k) const {
    if constexpr (kCols) {
      return place.active() && place.row0 + k * place.step < a.S;
    } else {
      return pack_index(k) < static_cast<int>(a.len / V);
    }
  }

  __device__ __forceinline__ int64_t pack_offset(const OnePassArgs<scalar_t>& a, int k) const {
    if constexpr (kCols) {
      return place.offset(place.row0 + k * place.step, a.C);
    } else {
      return static_cast<int64_t>(pack_index(k)) * V;
    }
  }

  // The operands' packs at element e: ops[0] the residual if given, else the multiplier; ops[1]
  // the multiplier.
  __device__ __forceinline__ static void load_operands(const OnePassArgs<scalar_t>& a, int64_t e, P* ops0, P* ops1) {
    const scalar_t* extra0 = a.epi.residual != nullptr ? a.epi.residual : a.epi.multiplier;
    if constexpr (E >= 1) *ops0 = *reinterpret_cast<const P*>(extra0 + e);
    if constexpr (E >= 2) *ops1 = *reinterpret_cast<const P*>(a.epi.multiplier + e);
  }

  // Pack k (batch slot u) of operand stream `stream` (0: the residual if given, else the
  // multiplier; the last: the multiplier): from the batch `late` loaded in the output loop
  // (kLate), else as held since load().
  template <typename Late>
  __device__ __forceinline__ const P& operand(const Late& late, int stream, int k, int u) const {
    if constexpr (kLate) {
      return late[stream][u];
    } else {
      return extra[stream == 0 ? 0 : kHeld - 1][k];
    }
  }

  // Issues every load of group `item` (the operands' too unless kLate).
  __device__ __forceinline__ void load(const OnePassArgs<scalar_t>& a, int64_t item) {
    const int64_t off = group_offset(a, item);
    first = a.x[off];
    if constexpr (kCols) place = ColsPlace<V>(a.D, static_cast<int>(blockDim.x));
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) {
        const int64_t e = off + pack_offset(a, k);
        x[k] = *reinterpret_cast<const P*>(a.x + e);
        if constexpr (!kLate) load_operands(a, e, &extra[0][k], &extra[kHeld - 1][k]);
      }
    }
    if constexpr (kEarlyParams) {
      using acc_t = acc_type<scalar_t>;
      const int64_t n = div_nn(item, a.G);
      const int64_t c_first = (item - n * a.G) * a.D;
#pragma unroll
      for (int k = 0; k < R; ++k) {
        if (valid(a, k)) {
          const int64_t c = c_first + div_nn(pack_offset(a, k), a.S);
          params[k] = modulate(a.epi, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
        }
      }
    }
  }

  // Moments (two-pass, from registers), the statistics, and y of group `item`, once its loads
  // are in. `red`: 2 * MaxThreads / kWarp values of shared memory, a half for each block sum, so
  // that neither needs a barrier after its reads (a CTA takes one group: nothing reuses them).
  template <int MaxThreads, Activation A>
  __device__ __forceinline__ void finish(const OnePassArgs<scalar_t>& a, int64_t item, acc_type<scalar_t>* red) const {
    using acc_t = acc_type<scalar_t>;
    const acc_t K = static_cast<acc_t>(first);
    acc_t sum = acc_t(0);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) sum += pack_shifted_sum(x[k], K);
    }
    const acc_t total = static_cast<acc_t>(a.len);
    const acc_t shifted_mean = one_pass_block_sum<MaxThreads, false>(sum, red) / total;
    acc_t m2 = acc_t(0);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (valid(a, k)) m2 += pack_squared_deviations(x[k], K, shifted_mean);
    }
    const acc_t var = one_pass_block_sum<MaxThreads, false>(m2, red + MaxThreads / kWarp) / total;
    // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
    const acc_t rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
    if (threadIdx.x == 0) {
      a.mean[item] = K + shifted_mean;
      a.rstd[item] = rstd;
    }
    const int64_t n = div_nn(item, a.G);
    OnePassOutput<scalar_t, V, A> out(a, n, item - n * a.G, K, shifted_mean, rstd);
    const bool has_r = E >= 1 && a.epi.residual != nullptr;
    const bool has_m = E >= 1 && a.epi.multiplier != nullptr;
    acc_t lane_a[kCols ? V : 1], lane_b[kCols ? V : 1];
    if constexpr (kCols) {
      if (!place.active()) return;
      out.lane_coefficients(place.lane * V, lane_a, lane_b);
    }
    const int64_t off = group_offset(a, item);
    if constexpr (kLate) out.coefficients(out.c_first);  // every channel's
    // kLate: the operands of B packs are loaded together before their stores (the compiler cannot
    // move a load above a store to y, which they may alias).
    constexpr int B = kLate ? kLateBatch : R;
#pragma unroll
    for (int k0 = 0; k0 < R; k0 += B) {
      P late[kLate && E > 0 ? E : 1][kLate ? B : 1];
      if constexpr (kLate && E > 0) {
#pragma unroll
        for (int u = 0; u < B; ++u) {
          if (k0 + u < R && valid(a, k0 + u)) {
            load_operands(a, off + pack_offset(a, k0 + u), &late[0][u], &late[E - 1][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int k = k0 + u;
        if (k < R && valid(a, k)) {
          const P& r = operand(late, 0, k, u);
          const P& m = operand(late, E >= 2 ? 1 : 0, k, u);
          P& y = *reinterpret_cast<P*>(a.y + off + pack_offset(a, k));
          if constexpr (kCols) {
            y = out.lane_pack(lane_a, lane_b, x[k], r, has_r, m, has_m);
          } else if constexpr (kLate) {
            y = out.constant_pack(x[k], r, has_r, m, has_m);
          } else if constexpr (kEarlyParams) {
            out.ca = out.rstd * params[k].w;
            out.cb = params[k].b;
            y = out.constant_pack(x[k], r, has_r, m, has_m);
          } else {
            y = out.uniform_pack(pack_index(k), x[k], r, has_r, m, has_m);
          }
        }
      }
    }
  }
};

// One CTA a group, of up to kRegisterThreads threads: warps enough to hide the latency of the
// reductions' barriers and shuffles. With 256 threads of 8 packs (96 registers, 16 warps an SM)
// problem 3's rows ran at 71% of the copy bandwidth; persistent CTAs that loaded the next group
// during the current one's reductions, with 16 warps an SM, did no better (67%): the SM was
// waiting on its own instruction latencies.
constexpr int kRegisterThreads = 512;

// CTAs an SM the register kernel is compiled for: two (at most 64 registers a thread) while it
// holds the operands through the reductions, three (40) when it loads them late.
template <bool kLate>
constexpr int kRegisterCtasPerSm = kLate ? 3 : 2;

template <typename scalar_t, int V, int R, int E, Activation A, bool kCols, bool kLate>
__global__ void __launch_bounds__(kRegisterThreads, kRegisterCtasPerSm<kLate>)
    group_norm_registers_kernel(const OnePassArgs<scalar_t> a) {
  __shared__ acc_type<scalar_t> red[2 * kRegisterThreads / kWarp];
  RegisterGroup<scalar_t, V, R, E, kCols, kLate> group;
  group.load(a, blockIdx.x);
  group.finish<kRegisterThreads, A>(a, blockIdx.x, red);
}

// Packs per thread of the register kernel, and its extra streams: R * (1 + E) <= kRegisterPacks
// 16-byte packs a thread (32 registers) fit two CTAs of kRegisterThreads per SM under the kernel's
// register cap of 64.
constexpr int kRegisterPacks = 8;

// One CTA a group of `threads` threads (the plan's: whole warps enough for R packs a thread;
// ChannelsLast: R rows a thread, D / V threads a row); `late`: the variant that loads the
// operands after the moments (ChannelsFirst, not bfloat16: its late kernels spilled 4-14 bytes
// under the cap).
template <typename scalar_t, int V, int R, int E, bool kCols>
void launch_registers(const OnePassArgs<scalar_t>& a, int64_t items, int threads, bool late) {
  static_assert(R * (1 + E) <= kRegisterPacks, "register kernel over its budget");
  const auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(items), threads, 0, at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  constexpr bool kLateAllowed = !kCols && !std::is_same_v<scalar_t, at::BFloat16>;
  const bool launched = dispatch_common_activation(a.epi.act, [&](auto act) {
    constexpr Activation kA = decltype(act)::value;
    if constexpr (kLateAllowed) {
      if (late) return launch(group_norm_registers_kernel<scalar_t, V, R, E, kA, false, true>);
    }
    launch(group_norm_registers_kernel<scalar_t, V, R, E, kA, kCols, false>);
  });
  TORCH_INTERNAL_ASSERT(launched, "register kernel planned for an activation it is not instantiated for");
}

// The register kernel as planned: R packs (rows) a thread and E extra streams, among the
// instantiations the planner picks from (docs/design.md, "Register kernel"; bfloat16 has none
// with more than one extra stream, or one beside 4 packs, and channels-last bfloat16 only 2 rows
// and no extra stream: those spilled).
template <typename scalar_t, int V>
void launch_registers_planned(const OnePassArgs<scalar_t>& a, int64_t items, const plan::Plan& pl) {
  constexpr bool kSmall = std::is_same_v<scalar_t, at::BFloat16>;
  const int R = pl.reg_packs, E = pl.reg_streams;
  const auto wrong = [&] { TORCH_INTERNAL_ASSERT(false, "register kernel planned with ", R, " packs and ", E, " streams"); };
  if (a.cols) {
    if (R == 2 && E == 0) return launch_registers<scalar_t, V, 2, 0, true>(a, items, pl.threads, pl.late);
    if constexpr (!kSmall) {
      if (R == 2 && E == 1) return launch_registers<scalar_t, V, 2, 1, true>(a, items, pl.threads, pl.late);
      if (R == 4 && E == 0) return launch_registers<scalar_t, V, 4, 0, true>(a, items, pl.threads, pl.late);
    }
    return wrong();
  }
  if (R == 2 && E == 0) return launch_registers<scalar_t, V, 2, 0, false>(a, items, pl.threads, pl.late);
  if (R == 2 && E == 1) return launch_registers<scalar_t, V, 2, 1, false>(a, items, pl.threads, pl.late);
  if (R == 4 && E == 0) return launch_registers<scalar_t, V, 4, 0, false>(a, items, pl.threads, pl.late);
  if constexpr (!kSmall) {
    if (R == 2 && E == 2) return launch_registers<scalar_t, V, 2, 2, false>(a, items, pl.threads, pl.late);
    if (R == 4 && E == 1) return launch_registers<scalar_t, V, 4, 1, false>(a, items, pl.threads, pl.late);
  }
  wrong();
}

}  // namespace
}  // namespace fusednorm
