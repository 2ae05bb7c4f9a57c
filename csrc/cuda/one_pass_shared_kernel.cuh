// The one-pass forward of ChannelsFirst groups in shared memory (docs/design.md, "One-pass
// forward", "Cluster path"): group_norm_one_pass_kernel and its launcher, for paths Shared (a CTA
// a group) and Cluster (a cluster of CTAs a group, their parts merged over distributed shared
// memory). A CTA takes its part of group (n, g) of the ChannelsFirst layout, D * S contiguous
// elements:
//   1. copies it into shared memory with cp.async, every copy of a thread in flight at once
//      (a thread later reads only the packs it copied itself, so no barrier is needed for them);
//   2. the moments of x - K (K the group's first element, as the split path) in one pass over
//      shared memory: each thread's sums of x - T and (x - T)^2, T its first element, merged
//      over the CTA, then over the cluster, in a fixed order (deterministic; one_pass_moments.cuh);
//   3. writes y = act(((x - mean) * rstd * w_eff + b_eff) + residual) * multiplier from shared
//      memory, with the per-(n, c) modulation of epilogue.h folded into w_eff and b_eff.
// With input_bias (kBias: channels-first packs in one channel each), each thread adds it to its
// copies in shared memory between steps 1 and 2.
// x is read from DRAM once. The activation is a template parameter, so that the element loop has
// no switch in it.

#pragma once

#include <cuda_pipeline.h>
#include "cuda/clusters.cuh"
#include "cuda/common/base.cuh"
#include "cuda/common/epilogue_math.cuh"
#include "cuda/common/shared_memory.cuh"
#include "cuda/one_pass_moments.cuh"
#include "cuda/one_pass_output.cuh"
#include "group_norm.h"

#include <ATen/cuda/CUDAContext.h>

#include <cstddef>
#include <cstdint>

namespace fusednorm {
namespace {

// The CTA size of the clusters probed by clusters_of_16 (the planner's largest one-pass CTA share,
// plan.cpp; which groups take the one-pass kernels, and in how many CTAs, is the planner's).
constexpr int64_t kOnePassCtaBytes = 64 * 1024;

template <typename scalar_t, int V, Activation A, bool kBias = false>
__global__ void __launch_bounds__(kOnePassThreads) group_norm_one_pass_kernel(const OnePassArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(kSmemLineBytes) unsigned char one_pass_smem[];
  __shared__ acc_t red[kOnePassThreads / kWarp];
  __shared__ ClusterExchange exchange;  // the cluster's parts
  const int64_t item = div_nn(blockIdx.x, a.cluster);  // (n, g)
  const int rank = static_cast<int>(blockIdx.x - item * a.cluster);  // the CTA's rank in its cluster
  const int64_t n = div_nn(item, a.G);
  const int64_t g = item - n * a.G;
  const int64_t off = item * a.len;  // ChannelsFirst: group (n, g) starts at (n * C + g * D) * S
  const int64_t lenv = a.len / V;
  exchange.begin(a.cluster, 1);
  // This CTA's packs of the group: [v_begin, v_end).
  const int64_t v_begin = imin(lenv, rank * a.chunk);
  const int64_t count = imin(lenv, v_begin + a.chunk) - v_begin;
  const EpiArgs<scalar_t>& e = a.epi;
  // Shared memory: the CTA's part of the group of x, then the residual's and the multiplier's (one
  // region when they are the same tensor, as in problem 3's (h + y) * y), all copied at once.
  P* x_smem = reinterpret_cast<P*>(one_pass_smem);
  P* r_smem = e.residual != nullptr ? x_smem + a.chunk : nullptr;
  P* m_smem = e.multiplier == nullptr ? nullptr
          : e.multiplier == e.residual ? r_smem
                                       : x_smem + a.chunk * (r_smem != nullptr ? 2 : 1);
  const P* xg = reinterpret_cast<const P*>(a.x + off) + v_begin;
  const P* rg = reinterpret_cast<const P*>(offset_or_null(e.residual, off)) + v_begin;
  const P* mg = reinterpret_cast<const P*>(offset_or_null(e.multiplier, off)) + v_begin;
  for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
    __pipeline_memcpy_async(&x_smem[v], &xg[v], sizeof(P));
    if (r_smem != nullptr) __pipeline_memcpy_async(&r_smem[v], &rg[v], sizeof(P));
    if (m_smem != nullptr && m_smem != r_smem) __pipeline_memcpy_async(&m_smem[v], &mg[v], sizeof(P));
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);
  // input_bias (docs/design.md, "Input bias"): each thread adds p[n, c] to the packs it copied,
  // which it alone reads, rounded to scalar_t as the sum the other channels-first paths are given
  // (ATen's input + input_bias) is; a pack lies in one channel (S % V == 0, the dispatcher's
  // condition), and a group of one CTA or cluster has under 2^32 elements.
  const InputBiasRef<scalar_t>& ib = e.input_bias;
  if constexpr (kBias) {
    const uint32_t S = static_cast<uint32_t>(a.S);
    for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
      const acc_t p = ib.template at<acc_t>(n, g * a.D + static_cast<uint32_t>((v_begin + v) * V) / S);
      const P xp = load_pack(x_smem[v]);
      acc_t z[V];
#pragma unroll
      for (int j = 0; j < V; ++j) z[j] = pack_element<acc_t>(xp, j) + p;
      x_smem[v] = round_pack<scalar_t, V>(z);
    }
  }

  // Moments of x - K, K the group's first element, as the split path computes them: a constant
  // group gives exactly mean = K and variance 0, and a mean far from 0 keeps its digits. One pass
  // over shared memory: sums of x - T and (x - T)^2, T the thread's first element, merged over
  // the CTA in the two steps of block_moments_of_shifted_sums (cta_part_moments), then over the
  // cluster in one exchange (one_pass_cluster_moments; docs/design.md, "Cluster path").
  acc_t K = static_cast<acc_t>(a.x[off]);
  if constexpr (kBias) K = static_cast<acc_t>(static_cast<scalar_t>(K + ib.template at<acc_t>(n, g * a.D)));
  acc_t nt = acc_t(0), tk = acc_t(0), q1 = acc_t(0), q2 = acc_t(0);
  if (threadIdx.x < count) {
    const acc_t T = pack_element<acc_t>(load_pack(x_smem[threadIdx.x]), 0);
    tk = T - K;
    for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
      add_shifted_sums(load_pack(x_smem[v]), T, q1, q2);
      nt += static_cast<acc_t>(V);
    }
  }
  const acc_t total = static_cast<acc_t>(a.len);
  const PartMoments<acc_t> part = cta_part_moments(nt, tk, q1, q2, static_cast<acc_t>(count * V), 0, 1, red);
  const BlockMoments<acc_t> gm = one_pass_cluster_moments(part, total, 0, threadIdx.x == 0, exchange, rank, a.cluster, 1,
      [&](int r) {
        const int64_t b = imin(lenv, r * a.chunk);
        return static_cast<acc_t>((imin(lenv, b + a.chunk) - b) * V);
      });
  const acc_t shifted_mean = gm.mean;
  const acc_t var = gm.m2 / total;
  // An overflowed M2 (|x - mean| above ~1.8e19 in float lanes) is NaN, not rstd 0 and zeros.
  const acc_t group_rstd = isinf(var) ? acc_t(NAN) : acc_t(1) / sqrt(var + a.eps);
  if (rank == 0 && threadIdx.x == 0) {
    a.mean[item] = K + shifted_mean;
    a.rstd[item] = group_rstd;
  }

  OnePassOutput<scalar_t, V, A> out(a, n, g, K, shifted_mean, group_rstd);
  P* yg = reinterpret_cast<P*>(a.y + off) + v_begin;
  dispatch_bool(r_smem != nullptr || m_smem != nullptr, [&](auto operands) {
    const bool has_r = decltype(operands)::value && r_smem != nullptr;
    const bool has_m = decltype(operands)::value && m_smem != nullptr;
    for (int64_t v = threadIdx.x; v < count; v += kOnePassThreads) {
      P rp, mp;
      if (has_r) rp = load_pack(r_smem[v]);
      if (has_m) mp = load_pack(m_smem[v]);
      yg[v] = out(v_begin + v, load_pack(x_smem[v]), rp, has_r, mp, has_m);
    }
  });
}

// kBias: the instantiation adding input_bias, for the common activations alone
// (one_pass_adds_input_bias, paths.h).
template <typename scalar_t, int V, Activation A, bool kBias>
void launch_one_pass(const OnePassArgs<scalar_t>& a, int64_t items, size_t smem_bytes) {
  auto kernel = group_norm_one_pass_kernel<scalar_t, V, A, kBias>;
  allow_dynamic_smem(kernel, smem_bytes);
  TORCH_INTERNAL_ASSERT(a.cluster <= kWarp, "one-pass cluster of over a warp of CTAs (one_pass_cluster_moments)");
  TORCH_INTERNAL_ASSERT((a.epi.input_bias.ptr != nullptr) == kBias && (!kBias || a.S % V == 0),
      "one-pass kernel given input_bias it cannot add");
  launch_clustered(kernel, static_cast<unsigned>(items * a.cluster), kOnePassThreads, smem_bytes, a.cluster,
      at::cuda::getCurrentCUDAStream(), a);
}

}  // namespace
}  // namespace fusednorm
