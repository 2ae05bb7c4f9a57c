// The split passes' pass 1, the reduction, in both layouts (docs/design.md, "Split passes").
#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/moments.cuh"

#include <cstdint>

namespace fusednorm {
namespace {

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

// The forward's kernel is held to three CTAs an SM (register cap 65536 / (kThreads * 3) -> 80):
// left to itself its bfloat16 instance took 92 registers, two CTAs an SM, and read x at 2.2 TB/s
// (docs/design.md, "Split passes"). The backward's has no minimum (0: ptxas's own choice).
constexpr int kReduceRowsForwardMinBlocks = 3;

template <typename scalar_t, int V, bool GRADS, bool EPI>
__global__ void __launch_bounds__(kThreads, GRADS ? 0 : kReduceRowsForwardMinBlocks) reduce_rows_kernel(
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
// lane's (n, c) coefficients are computed once per tile. A (EPI): kAnyAct, or the activation of
// an epilogue without residual or multiplier (GN+SiLU's backward, the plan's cols_act_kernel):
// then the element loop holds that activation's temporaries alone and no operand stream, and
// keeps as many packs in flight as the plain kernel (docs/design.md, "Split passes").

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

template <typename scalar_t, int V, bool GRADS, bool EPI, int A = kAnyAct>
__global__ void __launch_bounds__(kThreads, kMinBlocks) reduce_cols_kernel(
    const KernelArgs<ColsArgs<scalar_t>, scalar_t, EPI> a) {
  using acc_t = acc_type<scalar_t>;
  static_assert(GRADS || !EPI, "the forward statistics are those of x alone");
  static_assert(EPI || A == kAnyAct, "an activation only in the EPI kernels");
  constexpr bool kActKernel = A != kAnyAct;
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
  // The activation kernels keep as many as the plain kernel: with 16-bit types ptxas spills 24-88
  // bytes of them under the register cap, and yet one pack a thread took 6-14% longer
  // (docs/design.md, "Split passes").
  constexpr int U = EPI && !kActKernel ? epi_unroll_lanes<V>() : V >= 8 ? 2 : kUnroll;
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
        if constexpr (kActKernel) {
          dz_to_dp<U, V, V, A>(a.epi, static_cast<const scalar_t*>(nullptr), static_cast<const scalar_t*>(nullptr),
              first, stride, nvalid, xs, center, ea, pc, ds);
        } else if constexpr (EPI) {
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

}  // namespace
}  // namespace fusednorm
