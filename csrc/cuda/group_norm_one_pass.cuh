// The one-pass forward, for groups small enough to sit in one CTA's shared memory (included by
// group_norm_kernel.cu, whose helpers it uses).
//
// The split forward reads x twice and takes three launches; for small groups that is mostly
// latency and launch overhead (Stable Diffusion UNet shapes, problem 3's rows of 8192). Here one
// CTA takes one group (n, g) of the ChannelsFirst layout, D * S contiguous elements:
//   1. copies the group into shared memory with cp.async, every copy of a thread in flight at once
//      (a thread later reads only the packs it copied itself, so no barrier is needed for them);
//   2. mean, then the sum of squared deviations from it, both from shared memory: the exact
//      two-pass variance (of x - K, K the first element, as the split path), reduced in a fixed
//      order (deterministic);
//   3. writes y = act(((x - mean) * rstd * w_eff + b_eff) + residual) * multiplier from shared
//      memory, with the per-(n, c) modulation of epilogue.h folded into w_eff and b_eff.
// x is read from DRAM once. The activation is a template parameter, so that the element loop has
// no switch in it.

#include <cuda_pipeline.h>
#include "group_norm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include <cstdlib>

namespace fusednorm {
namespace {

constexpr int kOnePassThreads = 256;
// Largest shared-memory footprint (the group of x and of the tensor-sized operands, in bytes) taken
// by the one-pass kernel. Above 48 KB the kernel needs the opt-in shared-memory limit; at 96 KB two
// CTAs still fit on an SM.
constexpr int64_t kOnePassMaxBytes = 96 * 1024;

// FUSEDNORM_ONE_PASS_MAX_BYTES replaces that limit and forces the one-pass path for every group
// within it (0 turns the path off): the tests cover both paths with it. Read per call (cheap next
// to a launch), so that it can change within a process.
struct OnePassLimit {
  int64_t max_bytes;
  bool forced;
};

OnePassLimit one_pass_limit() {
  const char* env = std::getenv("FUSEDNORM_ONE_PASS_MAX_BYTES");
  return env != nullptr ? OnePassLimit{std::atoll(env), true} : OnePassLimit{kOnePassMaxBytes, false};
}

template <typename scalar_t>
struct OnePassArgs {
  using acc_t = acc_type<scalar_t>;
  const scalar_t* x;
  scalar_t* y;
  ParamRef weight, bias;
  acc_t* mean;  // (N, G)
  acc_t* rstd;
  int64_t C, S, G, D, len;  // len = D * S, the elements of a group
  acc_t eps;
  EpiArgs<scalar_t> epi;
};

// Sum of v over the CTA, in a fixed order; every thread gets the total.
template <typename acc_t>
__device__ __forceinline__ acc_t one_pass_block_sum(acc_t v, acc_t* smem) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += shfl_xor(v, off);
  if ((threadIdx.x & (kWarp - 1)) == 0) smem[threadIdx.x >> kLogWarp] = v;
  __syncthreads();
  acc_t total = acc_t(0);
#pragma unroll
  for (int w = 0; w < kOnePassThreads / kWarp; ++w) total += smem[w];
  __syncthreads();  // smem is reused by the next sum
  return total;
}

template <typename scalar_t, int V, Activation A>
__global__ void __launch_bounds__(kOnePassThreads) group_norm_one_pass_kernel(const OnePassArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char one_pass_smem[];
  __shared__ acc_t red[kOnePassThreads / kWarp];
  P* x_smem = reinterpret_cast<P*>(one_pass_smem);
  const int64_t item = blockIdx.x;  // (n, g)
  const int64_t n = div_nn(item, a.G);
  const int64_t g = item - n * a.G;
  const int64_t off = item * a.len;  // ChannelsFirst: group (n, g) starts at (n * C + g * D) * S
  const int64_t lenv = a.len / V;
  const EpiArgs<scalar_t>& e = a.epi;
  // Shared memory: the group of x, then the residual's and the multiplier's (one region when
  // they are the same tensor, as in problem 3's (h + y) * y), all copied at once.
  P* r_smem = e.residual != nullptr ? x_smem + lenv : nullptr;
  P* m_smem = e.multiplier == nullptr ? nullptr
          : e.multiplier == e.residual ? r_smem
                                       : x_smem + lenv * (r_smem != nullptr ? 2 : 1);
  const P* xg = reinterpret_cast<const P*>(a.x + off);
  const P* rg = reinterpret_cast<const P*>(offset_or_null(e.residual, off));
  const P* mg = reinterpret_cast<const P*>(offset_or_null(e.multiplier, off));
  for (int64_t v = threadIdx.x; v < lenv; v += kOnePassThreads) {
    __pipeline_memcpy_async(&x_smem[v], &xg[v], sizeof(P));
    if (r_smem != nullptr) __pipeline_memcpy_async(&r_smem[v], &rg[v], sizeof(P));
    if (m_smem != nullptr && m_smem != r_smem) __pipeline_memcpy_async(&m_smem[v], &mg[v], sizeof(P));
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);

  // Moments of x - K, K the group's first element, as the split path computes them: a constant
  // group gives exactly mean = K and variance 0, and a mean far from 0 keeps its digits.
  const acc_t K = static_cast<acc_t>(a.x[off]);
  acc_t sum = acc_t(0);
  for (int64_t v = threadIdx.x; v < lenv; v += kOnePassThreads) {
    const P p = x_smem[v];
#pragma unroll
    for (int j = 0; j < V; ++j) sum += static_cast<acc_t>(p.v[j]) - K;
  }
  const acc_t count = static_cast<acc_t>(a.len);
  const acc_t shifted_mean = one_pass_block_sum(sum, red) / count;
  acc_t m2 = acc_t(0);
  for (int64_t v = threadIdx.x; v < lenv; v += kOnePassThreads) {
    const P p = x_smem[v];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t d = (static_cast<acc_t>(p.v[j]) - K) - shifted_mean;
      m2 += d * d;
    }
  }
  const acc_t var = one_pass_block_sum(m2, red) / count;
  const acc_t group_rstd = acc_t(1) / sqrt(var + a.eps);
  if (threadIdx.x == 0) {
    a.mean[item] = K + shifted_mean;
    a.rstd[item] = group_rstd;
  }

  // Coefficients of channel c (absolute), cached: with S >= V a pack lies in one channel.
  int64_t cached_c = -1;
  acc_t ca = acc_t(0), cb = acc_t(0);
  auto coefficients = [&](int64_t c) {
    if (c != cached_c) {
      const Affine<acc_t> m =
          modulate(e, n * a.C + c, load_param(a.weight, c, acc_t(1)), load_param(a.bias, c, acc_t(0)));
      ca = group_rstd * m.w;
      cb = m.b;
      cached_c = c;
    }
  };
  P* yg = reinterpret_cast<P*>(a.y + off);
  const int64_t c_first = g * a.D;
  for (int64_t v = threadIdx.x; v < lenv; v += kOnePassThreads) {
    const P xp = x_smem[v];
    P rp, mp, o;
    if (r_smem != nullptr) rp = r_smem[v];
    if (m_smem != nullptr) mp = m_smem[v];
    // Channel of the pack's first element, then counted forward element by element.
    int64_t c = div_nn(v * V, a.S);
    int64_t rem = v * V - c * a.S;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j > 0 && ++rem == a.S) {
        rem = 0;
        ++c;
      }
      coefficients(c_first + c);
      acc_t p = ((static_cast<acc_t>(xp.v[j]) - K) - shifted_mean) * ca + cb;
      if (r_smem != nullptr) p += static_cast<acc_t>(rp.v[j]);
      acc_t z = activation_forward(A, p, e.slope);
      if (m_smem != nullptr) z *= static_cast<acc_t>(mp.v[j]);
      o.v[j] = static_cast<scalar_t>(z);
    }
    yg[v] = o;
  }
}

template <typename scalar_t, int V, Activation A>
void launch_one_pass(const OnePassArgs<scalar_t>& a, int64_t items, size_t smem_bytes) {
  auto kernel = group_norm_one_pass_kernel<scalar_t, V, A>;
  if (smem_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  }
  kernel<<<static_cast<unsigned>(items), kOnePassThreads, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Runs the forward in one pass and returns true when the group fits (see above), the layout is
// ChannelsFirst and every tensor-sized operand takes 16-byte packs; otherwise returns false and
// the caller runs the split forward.
template <typename scalar_t>
bool forward_one_pass(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  using acc_t = acc_type<scalar_t>;
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    return false;  // double: the split path (cp.async copies 16-byte packs here)
  } else {
    const int64_t len = sh.D * sh.S;
    const int64_t items = sh.N * sh.G;
    if (layout != Layout::ChannelsFirst || len % V != 0 || items > std::numeric_limits<int>::max()) return false;
    OnePassArgs<scalar_t> a{};
    a.epi = epi_args<scalar_t>(ep, /*with_residual=*/true);
    a.x = x.data_ptr<scalar_t>();
    a.y = y.data_ptr<scalar_t>();
    if (!aligned16(a.x) || !aligned16(a.y) || (a.epi.residual != nullptr && !aligned16(a.epi.residual)) ||
        (a.epi.multiplier != nullptr && !aligned16(a.epi.multiplier))) {
      return false;
    }
    const int64_t streams = 1 + (a.epi.residual != nullptr) +
        (a.epi.multiplier != nullptr && a.epi.multiplier != a.epi.residual);
    const int64_t smem = streams * len * static_cast<int64_t>(sizeof(scalar_t));
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    const OnePassLimit limit = one_pass_limit();
    if (smem > std::min<int64_t>(limit.max_bytes, static_cast<int64_t>(prop->sharedMemPerBlockOptin))) {
      return false;
    }
    // A CTA works through its group alone: large groups need enough of them to occupy every SM,
    // or the split passes (which spread a group over many CTAs) are faster. Measured on an H100:
    // 64 groups of 80 KB took 38 us here against 33 us split; 64 groups of 40 KB, 24 against 27.
    if (!limit.forced && smem > 48 * 1024 && items < prop->multiProcessorCount) return false;
    a.weight = param_ref<scalar_t>(weight);
    a.bias = param_ref<scalar_t>(bias);
    a.mean = mean.data_ptr<acc_t>();
    a.rstd = rstd.data_ptr<acc_t>();
    a.C = sh.C;
    a.S = sh.S;
    a.G = sh.G;
    a.D = sh.D;
    a.len = len;
    a.eps = static_cast<acc_t>(eps);
    switch (ep.activation) {
      case Activation::SiLU: launch_one_pass<scalar_t, V, Activation::SiLU>(a, items, static_cast<size_t>(smem)); break;
      case Activation::GELU: launch_one_pass<scalar_t, V, Activation::GELU>(a, items, static_cast<size_t>(smem)); break;
      case Activation::GELUTanh: launch_one_pass<scalar_t, V, Activation::GELUTanh>(a, items, static_cast<size_t>(smem)); break;
      case Activation::ReLU: launch_one_pass<scalar_t, V, Activation::ReLU>(a, items, static_cast<size_t>(smem)); break;
      case Activation::LeakyReLU: launch_one_pass<scalar_t, V, Activation::LeakyReLU>(a, items, static_cast<size_t>(smem)); break;
      case Activation::Mish: launch_one_pass<scalar_t, V, Activation::Mish>(a, items, static_cast<size_t>(smem)); break;
      default: launch_one_pass<scalar_t, V, Activation::None>(a, items, static_cast<size_t>(smem));
    }
    return true;
  }
}

}  // namespace
}  // namespace fusednorm
