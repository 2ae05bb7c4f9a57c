// The team forward and backward, for the ChannelsFirst groups the one-pass clusters cannot hold
// (the GroupNorm problem's 8 MB groups, the VAE's 2-8 MB ones) or hold in too few clusters to fill
// the GPU (the VAE's 0.5-1 MB groups, 32 of them) and, in the backward, the groups the one-CTA
// backward cannot hold (attention's 128 KB) (docs/design.md, "Team path"). They share the one-pass
// kernels' arguments and output stage and the one-CTA backward's arithmetic. The forward first:
//
// A group over kOnePassMaxBytes fits no CTA and no cluster, so the split forward read x twice
// from DRAM; smaller ones took a cluster of CTAs each, which loaded, reduced and wrote in turn,
// with no other work to overlap. Here a persistent grid, every CTA resident at once, is cut into
// teams of CTAs (TeamGrid, team_grid.cuh); a team takes its groups in turn (rounds), each CTA
// holding a contiguous chunk of each group in shared memory
// (an 8 MB float32 group is spread over ~80 CTAs, two an SM). For round i a CTA:
//   1. takes the chunk's count, mean and M2 of x - K (one pass over shared memory, a second
//      where the first loses M2's digits; K the group's first element), writes them to global
//      memory and arrives at the team's barrier (a counter in global memory);
//   2. once the whole team has arrived, merges its partials in one fixed order (every CTA and
//      every run gets the same bits: parts_moments' sums);
//   3. writes y from shared memory through OnePassOutput, and, as each pack is written, issues
//      the copy of the same pack of round i + 1 into its place, so that reads overlap writes.
// Before step 2's wait, a CTA of a large team brings part of its round i + 1 chunk into L2
// (kTeamPrefetchEighths), the only traffic it can issue while it waits.
// Holding two or three rounds a CTA (round i + 1's moments taken before round i's barrier) was
// slower on every row measured: the chunks shrink with the stages, and the rounds multiply.
// x is read from DRAM once. An earlier version re-read each
// chunk from global memory expecting L2 hits; with 12-50 MB of chunks in flight they were
// evicted first and DRAM moved three passes. Shared memory cannot evict.

#pragma once

#include <cuda_pipeline.h>
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/common/shared_memory.cuh"
#include "cuda/one_cta_backward.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_output.cuh"
#include "cuda/paths.h"
#include "cuda/team_grid.cuh"
#include "plan.h"

#include <ATen/cuda/EmptyTensor.h>

namespace fusednorm {
namespace {

template <typename scalar_t>
struct TeamArgs {
  OnePassArgs<scalar_t> op;           // op.chunk and op.cluster unused
  TeamGrid<acc_type<scalar_t>> team;  // partials: a chunk's count, mean and M2
};

// kStraddling: some packs straddle channels (!OnePassArgs::uniform_packs; the launcher picks). A
// kernel of its own, not a branch in the output loop: inlined beside the uniform pack, the
// straddling pack's per-element channel walk cost the bfloat16 kernel 40 bytes of stack (8 without
// it) and float16/float32 8 (0 without it), spilled inside the loop (docs/design.md, "Team
// path").
//
// kBias: with input_bias (docs/design.md, "Input bias"), its own instantiation (uniform packs, x
// alone, the common activations: team_adds_input_bias), so that the kernels without it keep their
// machine code. x' = x + p_c is never formed: a thread sums each pack of channel c against the
// shift T - (p_c - p_t) (p_t: input_bias at the channel of its first pack), the group's shift is
// K + p at its first channel, and the output shifts channel c by that less p_c.
template <typename scalar_t, int V, Activation A, bool kStraddling, bool kBias = false>
__global__ void __launch_bounds__(kTeamThreads, kTeamBlocksPerSM) group_norm_team_kernel(const TeamArgs<scalar_t> a) {
  static_assert(!(kBias && kStraddling), "input_bias on the fly takes packs within one channel");
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(kSmemLineBytes) unsigned char team_smem[];
  __shared__ acc_t red[kTeamThreads / kWarp];
  __shared__ acc_t fold[2 * kTeamThreads / kWarp];
  const OnePassArgs<scalar_t>& o = a.op;
  const TeamGrid<acc_t>& t = a.team;
  const EpiArgs<scalar_t>& e = o.epi;
  const int team = static_cast<int>(blockIdx.x) / t.team_size;
  const int rank = static_cast<int>(blockIdx.x) - team * t.team_size;
  const int64_t lenv = o.len / V;
  const int64_t v_begin = imin(lenv, rank * t.chunk);  // this CTA's packs of a group: [v_begin, v_end)
  const int count = static_cast<int>(imin(lenv, v_begin + t.chunk) - v_begin);
  // 32-bit (the planner keeps rounds * team_size within the barrier counters): the round counter
  // lives through every round, and at the 64-register cap its second word was one more spilled
  // value (float and half kernels 16 -> 8 bytes of stack; H200, InstanceNorm3d forward 0.364 ->
  // 0.353 ms, (8,128,512,512) float16 GN+SiLU 0.396 -> 0.388, the other rows level).
  const unsigned rounds = static_cast<unsigned>(t.rounds(team));
  // A thread's packs are threadIdx.x + k * kTeamThreads in every step, so that it writes only
  // packs it copied itself.
  P* x = reinterpret_cast<P*>(team_smem);
  // Round i's chunk moments (count, mean, M2) of x - K, to its partials slot, and the arrival at
  // round i's barrier, once its copies are in. K is the group's first element, as on the other
  // paths: the team merges and the output uses the shifted mean, so that a mean far from 0 keeps
  // its digits (each CTA's K + mean rounded to float32 cost the 1e4-offset test its y accuracy),
  // and a constant group gives exactly M2 = 0. A CTA writes round i's partials after passing
  // round i - 1's barrier, which the whole team reaches after reading round i - 2's: two slots
  // (round parities) suffice.
  // kBias: the group's channel of the thread's first pack (the same every round).
  const int64_t spv = o.S / V;
  const int64_t c_mine = kBias ? div_nn(v_begin + threadIdx.x, spv) : 0;
  const auto moments = [&](unsigned i, acc_t K) {
    // kBias: input_bias at the thread's first channel, loaded before the wait.
    const int64_t item = t.item_of(team, i);
    const int64_t ng = kBias ? div_nn(item, o.G) : 0;
    const int64_t c_first = kBias ? (item - ng * o.G) * o.D : 0;
    const acc_t p_t = kBias ? e.input_bias.template at<acc_t>(ng, c_first + c_mine) : acc_t(0);
    __pipeline_wait_prior(0);
    // Sums of x - T, T the thread's first element (block_moments_of_shifted_sums): no second
    // pass over the chunk where K lies far from it, which sat on every round's critical path
    // (docs/design.md, "Numerics").
    const acc_t T = threadIdx.x < count ? pack_element<acc_t>(load_pack(x[threadIdx.x]), 0) : acc_t(0);
    acc_t s1 = acc_t(0), s2 = acc_t(0);
    if constexpr (kBias) {
      // x + p_c - (T + p_t) = x - Tc, Tc = T - (p_c - p_t): the thread's packs a channel at a
      // time, each run the plain loop (a channel test a pack in it was 0-1.5% slower).
      acc_t Tc = T;
      int64_t c = c_mine;
      int v = threadIdx.x;
      for (;;) {
        const int end = static_cast<int>(imin((c + 1) * spv - v_begin, static_cast<int64_t>(count)));
        for (; v < end; v += kTeamThreads) add_shifted_sums(load_pack(x[v]), Tc, s1, s2);
        if (v >= count) break;
        c = div_nn(v_begin + v, spv);
        Tc = T - (e.input_bias.template at<acc_t>(ng, c_first + c) - p_t);
      }
    } else {
      for (int v = threadIdx.x; v < count; v += kTeamThreads) add_shifted_sums(load_pack(x[v]), T, s1, s2);
    }
    const int mine = count > static_cast<int>(threadIdx.x) ? (count - static_cast<int>(threadIdx.x) + kTeamThreads - 1) / kTeamThreads : 0;
    const acc_t n = static_cast<acc_t>(count * V);
    // kBias: K is the group's first element of x + input_bias (first_of), T's channel has p_t.
    const acc_t tk = kBias ? (T + p_t) - K : T - K;
    const BlockMoments<acc_t> bm = block_moments_of_shifted_sums<kTeamThreads>(
        static_cast<acc_t>(mine * V), tk, s1, s2, n, red);
    const acc_t mean = bm.mean;
    const acc_t m2 = bm.m2;
    if (threadIdx.x == 0) t.publish(team, rank, i, n, mean, m2);
  };
  // The group's first element (kBias: of x + input_bias), loaded well before moments() needs it.
  const auto first_of = [&](unsigned i) {
    const int64_t item = t.item_of(team, i);
    acc_t k = static_cast<acc_t>(o.x[item * o.len]);
    if constexpr (kBias) {
      const int64_t ng = div_nn(item, o.G);
      k += e.input_bias.template at<acc_t>(ng, (item - ng * o.G) * o.D);
    }
    return k;
  };

  acc_t K = acc_t(0);
  t.start(team);
  if (rounds > 0) {
    const P* src = reinterpret_cast<const P*>(o.x + t.item_of(team, 0) * o.len) + v_begin;
    for (int v = threadIdx.x; v < count; v += kTeamThreads) __pipeline_memcpy_async(&x[v], &src[v], sizeof(P));
    __pipeline_commit();
    K = first_of(0);
    moments(0, K);
  }
  for (unsigned i = 0; i < rounds; ++i) {
    if (i + 1 < rounds && t.prefetch > 0) {
      t.prefetch_chunk(reinterpret_cast<const P*>(o.x + t.item_of(team, i + 1) * o.len) + v_begin, count);
    }
    t.wait(team, i);
    const int64_t item = t.item_of(team, i);
    const acc_t* team_part = t.read_part(team, i, rank);  // written by other SMs: read from L2
    const BlockMoments<acc_t> m = parts_moments<kTeamThreads>(t.team_size, static_cast<acc_t>(o.len),
        [&](int r) {
          const acc_t* p = team_part + r * kTeamPartials;
          return ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)};
        },
        fold);
    // !(m2 <= 0): a NaN M2 stays NaN (as finalize_moments_kernel's).
    const acc_t var = !(m.m2 <= acc_t(0)) ? m.m2 / static_cast<acc_t>(o.len) : acc_t(0);
    // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
    const acc_t rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + o.eps);
    if (rank == 0 && threadIdx.x == 0) {
      o.mean[item] = K + m.mean;
      o.rstd[item] = rstd;
    }
    const int64_t ng = div_nn(item, o.G);
    OnePassOutput<scalar_t, V, A, kBias> out(o, ng, item - ng * o.G, K, m.mean, rstd);
    const int64_t off = item * o.len;
    const P* rg = reinterpret_cast<const P*>(offset_or_null(e.residual, off)) + v_begin;
    const P* mg = reinterpret_cast<const P*>(offset_or_null(e.multiplier, off)) + v_begin;
    P* yg = reinterpret_cast<P*>(o.y + off) + v_begin;
    // As each pack is written, the next round's copy of it is issued into its place (after the
    // store, which waits for the shared-memory read), so that reads overlap writes.
    const bool more = i + 1 < rounds;
    const acc_t K_next = more ? first_of(i + 1) : acc_t(0);
    const P* xnext = reinterpret_cast<const P*>(o.x + t.item_of(team, i + 1) * o.len) + v_begin;
    // Opaque to the compiler from here: at the 64-register cap it otherwise recomputed the
    // address (a 64-bit multiply, ~20 instructions) in every pack's copy (SASS).
    asm("" : "+l"(xnext));
    dispatch_bool(e.residual != nullptr || e.multiplier != nullptr, [&](auto operands) {
      const bool has_r = decltype(operands)::value && e.residual != nullptr;
      const bool has_m = decltype(operands)::value && e.multiplier != nullptr;
      for (int v = threadIdx.x; v < count; v += kTeamThreads) {
        P rp, mp;
        if (has_r) rp = rg[v];
        if (has_m) mp = mg[v];
        yg[v] = kStraddling ? out.straddling_pack(v_begin + v, load_pack(x[v]), rp, has_r, mp, has_m)
                            : out.uniform_pack(v_begin + v, load_pack(x[v]), rp, has_r, mp, has_m);
        if (more) __pipeline_memcpy_async(&x[v], &xnext[v], sizeof(P));
      }
    });
    if (more) {
      __pipeline_commit();
      K = K_next;
      moments(i + 1, K);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The team backward: the one-pass backward's arithmetic (one_cta_backward.cuh) for groups
// spread over a team, each CTA holding its chunk of x, dz and the operands p needs in shared
// memory, so that x and dz are read from DRAM once (the split backward reads them twice: five
// passes over memory instead of three). For round i a CTA:
//   1. makes dp from its chunk and sums, per channel it holds, dp and dp * (x - m) (the channel's
//      parts, for the parameter gradients), and over the chunk w_eff * dp, w_eff * dp * (x - m)
//      and x - m; publishes the last three and arrives at the team's barrier;
//   2. adds the team's sums in a fixed order (every CTA gets the same bits), giving the group's dx
//      coefficients (rank 0 writes them to rec, as finalize_grad_coefs_kernel would);
//   3. writes dx, grad_residual and grad_multiplier from shared memory, issuing round i + 1's
//      copies of each pack into its place as it goes;
//   4. adds the parts of the channels that begin in its chunk into part_c, so that the parameter
//      gradients read one entry per (n, c), as after the one-CTA backward (with an entry per
//      part, the GroupNorm problem's finalize read 3808 a channel and took 0.23 ms).

template <typename scalar_t>
struct TeamBackwardArgs {
  using acc_t = acc_type<scalar_t>;
  OnePassBackwardArgs<scalar_t> op;  // op.part_c: 2 per (n, c), as the one-CTA backward leaves them
  TeamGrid<acc_t> team;              // partials: a chunk's sums of w_eff * dp, w_eff * dp * (x - m), x - m
  acc_t* channel_parts;              // 2 per (n, c, k): CTA k of those holding parts of channel c
  int64_t split;                     // the most CTAs that hold parts of one channel
};

template <typename scalar_t, int V, Activation A, Keep K>
__global__ void __launch_bounds__(kTeamThreads, kTeamBlocksPerSM) group_norm_team_backward_kernel(
    const TeamBackwardArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(kSmemLineBytes) unsigned char team_smem[];
  __shared__ Sums<acc_t, 1> seg_smem[kTeamThreads / kWarp];
  __shared__ Sums<acc_t, 1> fold[kTeamThreads / kWarp];
  const OnePassBackwardArgs<scalar_t>& o = a.op;
  const TeamGrid<acc_t>& t = a.team;
  const EpiArgs<scalar_t>& e = o.epi;
  const int team = static_cast<int>(blockIdx.x) / t.team_size;
  const int rank = static_cast<int>(blockIdx.x) - team * t.team_size;
  const int64_t lenv = o.len / V;
  const int64_t spv = o.S / V;  // packs per channel (S is a multiple of V)
  const int64_t v_begin = imin(lenv, rank * t.chunk);
  const int count = static_cast<int>(imin(lenv, v_begin + t.chunk) - v_begin);
  const int64_t rounds = t.rounds(team);
  // The chunk's channels (within the group): [c_lo, c_hi].
  const int64_t c_lo = div_nn(v_begin, spv);
  const int64_t c_hi = count > 0 ? div_nn(v_begin + count - 1, spv) : c_lo - 1;
  BackwardOperands<scalar_t, V> element(reinterpret_cast<P*>(team_smem), t.chunk, e, acc_t(0));
  // Issues the copy of pack v of round i's chunk into every stream.
  const auto copy_in = [&](int64_t i, int v) { element.copy_in(v, t.item_of(team, i) * lenv + v_begin + v, o); };
  const bool want_q = e.grad_multiplier != nullptr;

  if (rounds > 0) {
    for (int v = threadIdx.x; v < count; v += kTeamThreads) copy_in(0, v);
    __pipeline_commit();
  }
  for (int64_t i = 0; i < rounds; ++i) {
    const int64_t item = t.item_of(team, i);
    const int64_t n = div_nn(item, o.G);
    const int64_t c_first = (item - n * o.G) * o.D;  // the group's first channel
    element.mean = o.mean[item];
    const acc_t rstd = o.rstd[item];
    // 1. Segments of 2^log_seg threads take the chunk's channels, in one sweep where they fit
    // (log_seg is chosen so), else in several (the loop is the same for every thread of the CTA,
    // so that the segments' reductions see all of it). The first sweep's coefficients are loaded
    // while the copies land.
    const int seg = 1 << o.log_seg;
    const int lane = threadIdx.x & (seg - 1);
    const int64_t per_sweep = kTeamThreads >> o.log_seg;
    const int64_t segment = threadIdx.x >> o.log_seg;  // a sweep's channel: base + segment
    ChannelCoefs<acc_t> k{acc_t(0), acc_t(0), acc_t(0)};
    if (c_lo + segment <= c_hi) k = channel_coefs(o, n, c_first + c_lo + segment, rstd);
    __pipeline_wait_prior(0);
    __syncthreads();  // the sums read packs that other threads copied
    // The sums keep what K says for step 3, and with DpAndGrads write the operands' gradients
    // (made where used, in steps 1 and 3: held across the round, they spilled).
    const int64_t first = item * lenv + v_begin;  // the tensors' pack held first
    Sums<acc_t, 1> mine;
    clear(mine);
    for (int64_t base = c_lo; base <= c_hi; base += per_sweep) {
      const int64_t cl = base + segment;
      Sums<acc_t, 1> s;
      clear(s);
      if (cl <= c_hi) {
        if (base != c_lo) k = channel_coefs(o, n, c_first + cl, rstd);
        const int lo = static_cast<int>(imax(cl * spv, v_begin) - v_begin);
        const int hi = static_cast<int>(imin((cl + 1) * spv, v_begin + count) - v_begin);
        with_sums_operands<K>(e, element, [&](const auto& operands) {
          add_channel_sums<A, V, K>(s, e, operands, 0, lo + lane, hi, seg, k.ea, k.pc,
              K == Keep::DpAndGrads ? OperandGrads<scalar_t, V>(e, first) : OperandGrads<scalar_t, V>());
        });
      }
      s = segment_reduce(s, o.log_seg, seg_smem);
      if (lane == 0 && cl <= c_hi) {
        if (o.part_c != nullptr) {
          const int64_t k = rank - div_nn(cl * spv, t.chunk);  // this CTA's place in channel cl
          acc_t* p = a.channel_parts + ((n * o.C + c_first + cl) * a.split + k) * 2;
          p[0] = s.dy[0];
          p[1] = s.dyxc[0];
        }
        mine.dy[0] += k.w_eff * s.dy[0];
        mine.dyxc[0] += k.w_eff * s.dyxc[0];
        mine.xc[0] += s.xc[0];
      }
    }
    const auto add = [](const Sums<acc_t, 1>& l, const Sums<acc_t, 1>& r) { return merge(l, r); };
    const Sums<acc_t, 1> cta = team_block_fold(mine, add, fold);
    t.publish_copies(team, rank, i, cta.dy[0], cta.dyxc[0], cta.xc[0]);

    // 2. The team's sums (every thread gets the same bits), and from them the group's dx
    // coefficients; first, part of round i + 1's chunk of each stream into L2 (the forward's
    // prefetch_chunk, for the same reason).
    if (i + 1 < rounds && t.prefetch > 0) {
      const int64_t next = t.item_of(team, i + 1) * lenv + v_begin;
      element.for_each_stream(o, [&](P*, const P* tensor) { t.prefetch_chunk(tensor + next, count); });
    }
    t.wait(team, i);
    const acc_t* team_part = t.read_part(team, i, rank);
    Sums<acc_t, 1> zero;
    clear(zero);
    const Sums<acc_t, 1> sums = team_fold(zero, t.team_size,
        [&](int r) {
          const acc_t* p = team_part + r * kTeamPartials;
          return Sums<acc_t, 1>{{__ldcg(p)}, {__ldcg(p + 1)}, {__ldcg(p + 2)}};
        },
        add, fold);
    const GroupGradCoefs<acc_t> coefs(sums.dy[0], sums.dyxc[0], sums.xc[0], rstd, static_cast<acc_t>(o.len));
    if (rank == 0 && threadIdx.x == 0 && o.rec != nullptr) coefs.store(o.rec + item * kRec, element.mean, rstd);

    // 3. dx from x and dp, with grad_residual where left to this loop (dispatch_dx_grads). A
    // thread takes the packs threadIdx.x + k * kTeamThreads, and copies round i + 1's into them.
    P* dxg = reinterpret_cast<P*>(o.dx) + first;  // dx is always wanted here
    const OperandGrads<scalar_t, V> grads(e, first);
    const bool more = i + 1 < rounds;
    dispatch_dx_grads<K>(grads, [&](auto with_grads) {
      constexpr bool GRADS = decltype(with_grads)::value;
      const auto operands = element.without_operands();
      // The packs [c_begin, c_end) of the chunk lie in the channel whose coefficients kc holds: a
      // range test a pack rather than a division.
      int64_t c_begin = 0, c_end = 0;
      ChannelCoefs<acc_t> kc;
      for (int v = threadIdx.x; v < count; v += kTeamThreads) {
        if (v < c_begin || v >= c_end) {
          const int64_t cl = div_nn(v_begin + v, spv);
          c_begin = cl * spv - v_begin;
          c_end = c_begin + spv;
          kc = channel_coefs(o, n, c_first + cl, rstd);
        }
        acc_t dxp[V], gr[V], gm[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          backward_outputs<GRADS>(e, operands, v, j, kc, coefs, want_q, grads, dxp[j], gr[j], gm[j]);
        }
        dxg[v] = round_pack<scalar_t, V>(dxp);
        if (GRADS) grads.store(v, gr, gm);
        if (more) copy_in(i + 1, v);
      }
    });
    if (more) __pipeline_commit();

    // 4. Each channel that begins in this chunk: its parts, all written before round i's barrier,
    // added in order into part_c (a warp a channel), while round i + 1's copies land.
    if (o.part_c != nullptr) {
      const int warp = threadIdx.x >> kLogWarp;
      const int l = threadIdx.x & (kWarp - 1);
      for (int64_t cl = div_nn(v_begin + spv - 1, spv) + warp; cl <= c_hi; cl += kTeamThreads / kWarp) {
        const int parts = static_cast<int>(div_nn((cl + 1) * spv - 1, t.chunk) - rank + 1);
        const acc_t* p = a.channel_parts + (n * o.C + c_first + cl) * a.split * 2;
        acc_t db = acc_t(0), dsc = acc_t(0);
        for (int k = l; k < parts; k += kWarp) {
          db += __ldcg(p + 2 * k);
          dsc += __ldcg(p + 2 * k + 1);
        }
#pragma unroll
        for (int off = kWarp / 2; off > 0; off >>= 1) {
          db += shfl_xor(db, off);
          dsc += shfl_xor(dsc, off);
        }
        if (l == 0) {
          o.part_c[(n * o.C + c_first + cl) * 2] = db;
          o.part_c[(n * o.C + c_first + cl) * 2 + 1] = dsc;
        }
      }
    }
  }
}

// The team forward's kernel for a call: instantiated for its activation, for packs that straddle
// channels or not and, packs within one channel and a common activation (team_adds_input_bias),
// for adding input_bias on the fly. forward_team launches it and team_residency asks how many fit
// an SM: one choice, so the planner's residency answer is about the kernel that runs.
template <typename scalar_t, int V = pack_width<scalar_t>()>
auto team_forward_kernel(Activation act, bool straddling, bool input_bias) {
  void (*kernel)(TeamArgs<scalar_t>) = nullptr;
  if (input_bias) {
    TORCH_INTERNAL_ASSERT(!straddling, "team forward: input_bias on the fly takes packs within one channel");
    dispatch_common_activation(
        act, [&](auto a) { kernel = group_norm_team_kernel<scalar_t, V, decltype(a)::value, false, true>; });
  } else {
    dispatch_activation(act, [&](auto a) {
      constexpr Activation kA = decltype(a)::value;
      kernel = straddling ? group_norm_team_kernel<scalar_t, V, kA, true> : group_norm_team_kernel<scalar_t, V, kA, false>;
    });
  }
  TORCH_INTERNAL_ASSERT(kernel != nullptr, "team forward planned for an activation it is not instantiated for");
  return kernel;
}

// Runs the team forward as planned (plan.path == Team); false, having launched nothing, where the
// device refuses the grid (the caller plans again without the team path).
template <typename scalar_t>
bool forward_team(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    TORCH_INTERNAL_ASSERT(false, "team forward planned for double");
    return false;
  } else {
    TeamArgs<scalar_t> a{};
    OnePassArgs<scalar_t>& o = a.op;
    const bool made = make_one_pass_args<scalar_t, V>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, o);
    TORCH_INTERNAL_ASSERT(made, "team forward planned for arguments it cannot take");
    o.cluster = 1;
    a.team.groups = sh.N * sh.G;
    set_team_grid(pl, a.team);
    constexpr int64_t pack_bytes = V * static_cast<int64_t>(sizeof(scalar_t));
    const bool straddling = team_packs_straddle(sh, V, weight, bias, ep);
    TORCH_INTERNAL_ASSERT(straddling == !o.template uniform_packs<V>(), "team forward: packs straddle or not");
    const bool input_bias = o.epi.input_bias.ptr != nullptr;
    TORCH_INTERNAL_ASSERT(!input_bias || team_adds_input_bias(sh, V, ep), "team forward given an input_bias it cannot add");
    const size_t smem = static_cast<size_t>(a.team.chunk * pack_bytes);
    return launch_team_grid(team_forward_kernel<scalar_t>(ep.activation, straddling, input_bias), a, a.team, smem, x);
  }
}

// Runs the backward's elementwise outputs and the sums behind the parameter gradients with the
// team kernel as planned; part_c and rec are then set for the parameter gradients when
// `want_params`, as backward_one_pass sets them. False, having launched nothing, where the device
// refuses the grid.
template <typename scalar_t>
bool backward_team(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh, Layout layout,
    const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params, at::Tensor& part_c,
    at::Tensor& rec) {
  using acc_t = acc_type<scalar_t>;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    TORCH_INTERNAL_ASSERT(false, "team backward planned for double");
    return false;
  } else {
    TeamBackwardArgs<scalar_t> a{};
    OnePassBackwardArgs<scalar_t>& o = a.op;
    const bool made =
        make_one_pass_backward_args<scalar_t, V>(dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, o);
    TORCH_INTERNAL_ASSERT(made, "team backward planned for arguments it cannot take");
    a.team.groups = sh.N * sh.G;
    set_team_grid(pl, a.team);
    a.split = pl.channel_split;
    o.log_seg = pl.log_seg;
    if (want_params) {
      const auto opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
      const int64_t NC = a.team.groups / o.G * o.C;
      at::Tensor buffer = at::detail::empty_cuda({NC * 2 * (1 + a.split)}, opts);
      part_c = buffer.narrow(0, 0, NC * 2);
      rec = at::detail::empty_cuda({a.team.groups * kRec}, opts);
      o.part_c = part_c.data_ptr<acc_t>();
      o.rec = rec.data_ptr<acc_t>();
      a.channel_parts = o.part_c + NC * 2;
    }
    const int64_t pack_bytes = o.streams() * V * static_cast<int64_t>(sizeof(scalar_t));
    bool launched = false;
    dispatch_activation(ep.activation, [&](auto act) {
      constexpr Activation kA = decltype(act)::value;
      dispatch_keep<kA>(keep_for(o), [&](auto keep) {
        auto kernel = group_norm_team_backward_kernel<scalar_t, V, kA, decltype(keep)::value>;
        launched = launch_team_grid(kernel, a, a.team, static_cast<size_t>(a.team.chunk * pack_bytes), x);
      });
    });
    return launched;
  }
}

}  // namespace

// The team entry points of paths.h, instantiated per dtype in kernels_<dtype>.cu.
template <typename scalar_t>
bool team_forward(const plan::Plan& pl, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    double eps, const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  return forward_team<scalar_t>(pl, x, weight, bias, eps, sh, layout, ep, y, mean, rstd);
}

template <typename scalar_t>
bool team_backward(const plan::Plan& pl, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh,
    Layout layout, const Epilogue& ep, const FusedGradMask& mask, FusedGrads& g, bool want_params,
    at::Tensor& part_c, at::Tensor& rec) {
  return backward_team<scalar_t>(pl, dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, want_params, part_c,
      rec);
}

template <typename scalar_t>
int team_residency(Activation act, bool backward, int keep, bool straddling, bool input_bias, int64_t smem) {
  constexpr int V = pack_width<scalar_t>();
  if (!backward) {
    // Only the kernel forward_team launches is allowed the shared memory (one left at the default
    // 48 KB is refused the grid, and the call falls back to another path): asking of every
    // instantiation doubled the driver calls of every team forward's planning.
    return team_ctas_per_sm(team_forward_kernel<scalar_t, V>(act, straddling, input_bias), smem);
  }
  int per_sm = 0;
  dispatch_activation(act, [&](auto a) {
    constexpr Activation kA = decltype(a)::value;
    dispatch_keep<kA>(static_cast<Keep>(keep), [&](auto k) {
      per_sm = team_ctas_per_sm(group_norm_team_backward_kernel<scalar_t, V, kA, decltype(k)::value>, smem);
    });
  });
  return per_sm;
}

}  // namespace fusednorm

#define FUSEDNORM_INSTANTIATE_TEAM(T)                                                                         \
  template bool fusednorm::team_forward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,           \
      const at::Tensor&, double, const GroupNormShape&, Layout, const Epilogue&, at::Tensor&, at::Tensor&,  \
      at::Tensor&);                                                                                           \
  template bool fusednorm::team_backward<T>(const plan::Plan&, const at::Tensor&, const at::Tensor&,          \
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const GroupNormShape&,    \
      Layout, const Epilogue&, const FusedGradMask&, FusedGrads&, bool, at::Tensor&, at::Tensor&)
#define FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(T) \
  template int fusednorm::team_residency<T>(Activation, bool, int, bool, bool, int64_t)
