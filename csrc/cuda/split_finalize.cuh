// The split passes' pass 2: the per-group statistics or dx coefficients, and the parameter
// gradients (docs/design.md, "Split passes", "Parameter gradients").
#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/clusters.cuh"

#include <cstdint>

namespace fusednorm {
namespace {

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
  int64_t D;                // channels a group
  InputBiasRef<scalar_t> input_bias;  // the channels-last sweep's: K is that of x + input_bias
  acc_t eps;
  acc_t* mean;              // (N, G) outputs
  acc_t* rstd;
  acc_t* rec;               // kRec per (n, g) for the apply pass
  int log_iw;
};

// The shift K of item (n, g): the first element of its group in x + input_bias.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
__device__ __forceinline__ acc_t finalize_shift(const MomentsFinalizeArgs<scalar_t>& a, int64_t item) {
  const int64_t n = div_nn(item, a.G);
  const int64_t g = item - n * a.G;
  return static_cast<acc_t>(a.x[n * a.sample_stride + g * a.group_stride]) + a.input_bias.template at<acc_t>(n, g * a.D);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) finalize_moments_kernel(const MomentsFinalizeArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t smem[kThreads / kWarp];
  const int lane = threadIdx.x & ((1 << a.log_iw) - 1);
  const int per_block = kThreads >> a.log_iw;
  const int64_t first_base = static_cast<int64_t>(blockIdx.x) * per_block;
  // The shift K of the thread's first item (the first element of its group in x + input_bias),
  // read before the wait: the moments kernel does not write x, and after the wait this load would
  // stand between the moments' end and the records.
  const int64_t first_item = first_base + (threadIdx.x >> a.log_iw);
  const acc_t first_K = lane == 0 && first_item < a.items ? finalize_shift(a, first_item) : acc_t(0);
  // Launched as a programmatic dependent of the channels-last sweep's moments kernel, and the
  // output kernel of its own (cols_sweep_path.cuh); no-ops otherwise.
  wait_for_primary();
  launch_dependents();
  for (int64_t base = first_base; base < a.items; base += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t item = base + (threadIdx.x >> a.log_iw);
    // The entries merged by sums (parts_moments' form, one_pass_moments.cuh): the count and the
    // sum of count * mean give the mean, then M2 is the sum of each entry's M2 and count * (its
    // mean - the mean)^2, every term nonnegative; Chan's pairwise merges chained a division each.
    const acc_t* p = a.part + imin(item, a.items - 1) * a.entries * 3;
    const int64_t entries = item < a.items ? a.entries : 0;
    acc_t n = acc_t(0), s = acc_t(0);
    for (int64_t e = lane; e < entries; e += (1 << a.log_iw)) {
      n += p[e * 3];
      s += p[e * 3] * p[e * 3 + 1];
    }
    n = segment_all_sum(n, a.log_iw, smem);
    s = segment_all_sum(s, a.log_iw, smem);
    const acc_t mean = n > acc_t(0) ? s / n : acc_t(0);
    acc_t m2 = acc_t(0);
    for (int64_t e = lane; e < entries; e += (1 << a.log_iw)) {
      const acc_t d = p[e * 3 + 1] - mean;
      m2 += p[e * 3 + 2] + p[e * 3] * d * d;
    }
    m2 = segment_all_sum(m2, a.log_iw, smem);
    Moments<acc_t, 1> st;
    st.n = n;
    st.mean[0] = mean;
    st.m2[0] = m2;
    if (lane == 0 && item < a.items) {
      const acc_t K = base == first_base ? first_K : finalize_shift(a, item);
      // !(m2 <= 0), not m2 > 0: a NaN M2 (chunks whose overflowed M2 met in the merge as inf - inf)
      // must stay NaN, not become variance 0 and a finite rstd of 1 / sqrt(eps).
      const acc_t var = st.n > acc_t(0) && !(st.m2[0] <= acc_t(0)) ? st.m2[0] / st.n : acc_t(0);
      // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
      const acc_t rs = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
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

}  // namespace
}  // namespace fusednorm
