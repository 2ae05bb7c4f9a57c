// The team forward, for ChannelsFirst groups of kTeamMinBytes and more (the GroupNorm problem's
// 8 MB groups, the VAE's 0.5-8 MB ones, attention's 128 KB). Included after
// group_norm_one_pass.cuh, whose arguments and output stage it shares.
//
// A group over kOnePassMaxBytes fits no CTA and no cluster, so the split forward read x twice
// from DRAM; smaller ones took a cluster of CTAs each, which loaded, reduced and wrote in turn,
// with no other work to overlap. Here a persistent grid, every CTA resident at once (a cooperative launch guarantees it, so the spin
// barrier below cannot wait on a CTA that never runs), is cut into teams of CTAs; a team takes
// its groups in turn (rounds), each CTA holding a contiguous chunk of each group in shared memory
// (an 8 MB float32 group is spread over ~80 CTAs, two an SM). For round i a CTA:
//   1. takes the chunk's count, mean and M2 of x - K (one pass over shared memory; K the group's
//      first element), writes them to global memory and arrives at the team's barrier (a
//      counter in global memory);
//   2. once the whole team has arrived, merges its partials in one fixed order (every CTA and
//      every run gets the same bits: Chan's pairwise formula);
//   3. writes y from shared memory through OnePassOutput, and, as each pack is written, issues
//      the copy of the same pack of round i + 1 into its place, so that reads overlap writes.
// Holding two or three rounds a CTA (round i + 1's moments taken before round i's barrier) was
// slower on every row measured: the chunks shrink with the stages, and the rounds multiply.
// x is read from DRAM once. An earlier version (branch experiment/team-forward) re-read each
// chunk from global memory expecting L2 hits; with 12-50 MB of chunks in flight they were
// evicted first and DRAM moved three passes. Shared memory cannot evict.

#include <cuda_pipeline.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdlib>
#include <limits>

namespace fusednorm {
namespace {

// Two CTAs of 512 threads an SM (at most 64 registers a thread): while one computes its moments
// or waits at its barrier, the other's copies and stores keep the SM's DRAM traffic going. With
// one CTA an SM (16 warps) the SM spent a third of each round issuing no DRAM traffic.
constexpr int kTeamThreads = 512;
constexpr int kTeamBlocksPerSM = 2;
// x bytes a team CTA holds at most: two CTAs in the 227 KB of an H100 SM.
constexpr int64_t kTeamCtaBytes = 108 * 1024;
// Groups of at least this many bytes of x take the team forward by default, before the one-pass
// kernels. Measured on an H100 (compare_paths.py): faster than those from the UNet's 40 KB groups
// ((8,640,32,32) fp16: 0.0238 against 0.0250 ms) through the attention block's 128 KB (0.082
// against 0.107) and the 1 MB of the InstanceNorm problem (6.02 against 6.89 ms, clusters of 16);
// slower where the register kernel takes the group (20-32 KB: (2,1280,16,16) 0.0135 against 0.0099).
constexpr int64_t kTeamMinBytes = 36 * 1024;

// FUSEDNORM_TEAM_FORWARD: "0" turns the team path off, "1" forces it for every group it can take
// (the tests cover it on small groups that way); unset, it takes ChannelsFirst groups of at least
// kTeamMinBytes of x, or over kOnePassMaxBytes with their tensor-sized operands, except those
// within a forced FUSEDNORM_ONE_PASS_MAX_BYTES. FUSEDNORM_TEAM_CTA_KB replaces kTeamCtaBytes
// (tuning).
int team_forward_mode() {
  const char* env = std::getenv("FUSEDNORM_TEAM_FORWARD");
  return env == nullptr ? -1 : std::atoi(env);
}

int64_t team_cta_bytes() {
  const char* env = std::getenv("FUSEDNORM_TEAM_CTA_KB");
  return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) * 1024 : kTeamCtaBytes;
}

template <typename scalar_t>
struct TeamArgs {
  using acc_t = acc_type<scalar_t>;
  OnePassArgs<scalar_t> op;  // op.chunk: packs per CTA
  acc_t* part;               // 3 per (round parity, CTA): a chunk's count, mean and M2
  unsigned* arrived;         // one counter per team, zero at launch
  int64_t groups;            // N * G
  int team_size, teams;
};

// A chunk's moments. Merged with Chan's formula, as merge() of the split path does, but returning
// the other side outright when one is empty: the merge runs on every round's critical path (the
// whole CTA waits for it), where most lanes hold no chunk, and merge()'s unconditional division
// there cost 3-4% (InstanceNorm problem 6.03 -> 6.20 ms, attention GN 0.0846 -> 0.0877 ms on an
// H100, same run).
template <typename acc_t>
struct ChunkMoments {
  acc_t n, mean, m2;
};

template <typename acc_t>
__device__ __forceinline__ ChunkMoments<acc_t> merge_chunks(const ChunkMoments<acc_t>& a, const ChunkMoments<acc_t>& b) {
  const acc_t n = a.n + b.n;
  if (b.n == acc_t(0)) return a;
  if (a.n == acc_t(0)) return b;
  const acc_t delta = b.mean - a.mean;
  const acc_t fb = b.n / n;
  return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

__device__ __forceinline__ unsigned team_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename scalar_t, int V, Activation A>
__global__ void __launch_bounds__(kTeamThreads, kTeamBlocksPerSM) group_norm_team_kernel(const TeamArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char team_smem[];
  __shared__ acc_t red[kTeamThreads / kWarp];
  __shared__ acc_t merged[2];  // the group's mean and rstd
  const OnePassArgs<scalar_t>& o = a.op;
  const EpiArgs<scalar_t>& e = o.epi;
  const int team = static_cast<int>(blockIdx.x) / a.team_size;
  const int rank = static_cast<int>(blockIdx.x) - team * a.team_size;
  const int64_t lenv = o.len / V;
  const int64_t v_begin = imin(lenv, rank * o.chunk);  // this CTA's packs of a group: [v_begin, v_end)
  const int count = static_cast<int>(imin(lenv, v_begin + o.chunk) - v_begin);
  const int64_t rounds = team < a.groups ? ceil_div(a.groups - team, a.teams) : 0;
  // Round i is the team's group team + i * teams. A thread's packs are threadIdx.x + k *
  // kTeamThreads in every step, so that it writes only packs it copied itself.
  const auto item_of = [&](int64_t i) { return team + i * a.teams; };
  P* x = reinterpret_cast<P*>(team_smem);
  // Round i's chunk moments (count, mean, M2) of x - K, to slot i % 2, and the arrival at round
  // i's barrier, once its copies are in. K is the group's first element, as on the other paths:
  // the team merges and the output uses the shifted mean, so that a mean far from 0 keeps its
  // digits (each CTA's K + mean rounded to float32 cost the 1e4-offset test its y accuracy), and
  // a constant group gives exactly M2 = 0. A CTA writes round i's partials after passing round
  // i - 1's barrier, which the whole team reaches after reading round i - 2's: two slots suffice.
  const auto moments = [&](int64_t i, acc_t K) {
    __pipeline_wait_prior(0);
    acc_t s1 = acc_t(0), s2 = acc_t(0);
    for (int v = threadIdx.x; v < count; v += kTeamThreads) {
      const P p = x[v];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const acc_t d = static_cast<acc_t>(p.v[j]) - K;
        s1 += d;
        s2 += d * d;
      }
    }
    const acc_t n = static_cast<acc_t>(count * V);
    s1 = one_pass_block_sum<kTeamThreads>(s1, red);
    s2 = one_pass_block_sum<kTeamThreads>(s2, red);
    if (threadIdx.x == 0) {
      const acc_t shifted_mean = count > 0 ? s1 / n : acc_t(0);
      const acc_t m2 = s2 - s1 * shifted_mean;
      acc_t* p = a.part + (((i & 1) * a.teams + team) * a.team_size + rank) * 3;
      p[0] = n;
      p[1] = shifted_mean;
      p[2] = m2 > acc_t(0) ? m2 : acc_t(0);
      __threadfence();
      atomicAdd(a.arrived + team, 1u);
    }
  };
  // The group's first element, loaded well before moments() needs it.
  const auto first_of = [&](int64_t i) { return static_cast<acc_t>(o.x[item_of(i) * o.len]); };
  const bool uniform = o.template uniform_packs<V>();

  acc_t K = acc_t(0);
  if (rounds > 0) {
    const P* src = reinterpret_cast<const P*>(o.x + item_of(0) * o.len) + v_begin;
    for (int v = threadIdx.x; v < count; v += kTeamThreads) __pipeline_memcpy_async(&x[v], &src[v], sizeof(P));
    __pipeline_commit();
    K = first_of(0);
    moments(0, K);
  }
  for (int64_t i = 0; i < rounds; ++i) {
    if (threadIdx.x == 0) {
      // The counter also counts round i + 1's arrivals, but a CTA arrives there only after the
      // whole team arrived at round i.
      const unsigned target = static_cast<unsigned>((i + 1) * a.team_size);
      while (team_load_acquire(a.arrived + team) < target) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(20);
#endif
      }
    }
    __syncthreads();
    const int64_t item = item_of(i);
    if (threadIdx.x < kWarp) {
      // Lane l merges ranks l, l + 32, ... in order, then the lanes merge pairwise (fixed tree).
      const acc_t* team_part = a.part + ((i & 1) * a.teams + team) * a.team_size * 3;
      ChunkMoments<acc_t> m{acc_t(0), acc_t(0), acc_t(0)};
      for (int r = threadIdx.x; r < a.team_size; r += kWarp) {
        const acc_t* p = team_part + r * 3;  // written by other SMs: read from L2
        m = merge_chunks(m, ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)});
      }
#pragma unroll
      for (int off = 1; off < kWarp; off <<= 1) {
        const ChunkMoments<acc_t> other{shfl_xor(m.n, off), shfl_xor(m.mean, off), shfl_xor(m.m2, off)};
        // Both lanes of a pair merge in the same order, so that they get the same bits.
        m = (threadIdx.x & off) ? merge_chunks(other, m) : merge_chunks(m, other);
      }
      if (threadIdx.x == 0) {
        const acc_t var = m.m2 > acc_t(0) ? m.m2 / static_cast<acc_t>(o.len) : acc_t(0);
        merged[0] = m.mean;
        merged[1] = acc_t(1) / sqrt(var + o.eps);
        if (rank == 0) {
          o.mean[item] = K + m.mean;
          o.rstd[item] = merged[1];
        }
      }
    }
    __syncthreads();
    // merged is next written after the next round's barriers, which every thread passes after
    // reading it here.
    const int64_t ng = div_nn(item, o.G);
    OnePassOutput<scalar_t, V, A> out(o, ng, item - ng * o.G, K, merged[0], merged[1]);
    const int64_t off = item * o.len;
    const P* rg = reinterpret_cast<const P*>(offset_or_null(e.residual, off)) + v_begin;
    const P* mg = reinterpret_cast<const P*>(offset_or_null(e.multiplier, off)) + v_begin;
    P* yg = reinterpret_cast<P*>(o.y + off) + v_begin;
    const bool has_r = e.residual != nullptr;
    const bool has_m = e.multiplier != nullptr;
    // As each pack is written, the next round's copy of it is issued into its place (after the
    // store, which waits for the shared-memory read), so that reads overlap writes.
    const bool more = i + 1 < rounds;
    const acc_t K_next = more ? first_of(i + 1) : acc_t(0);
    const P* xnext = reinterpret_cast<const P*>(o.x + item_of(i + 1) * o.len) + v_begin;
    for (int v = threadIdx.x; v < count; v += kTeamThreads) {
      P rp, mp;
      if (has_r) rp = rg[v];
      if (has_m) mp = mg[v];
      yg[v] = uniform ? out.uniform_pack(v_begin + v, x[v], rp, has_r, mp, has_m)
                      : out(v_begin + v, x[v], rp, has_r, mp, has_m);
      if (more) __pipeline_memcpy_async(&x[v], &xnext[v], sizeof(P));
    }
    if (more) {
      __pipeline_commit();
      K = K_next;
      moments(i + 1, K);
    }
  }
}

// CTAs of `kernel` resident per SM with `smem` bytes each.
template <typename Kernel>
int team_blocks_per_sm(Kernel kernel, size_t smem) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kTeamThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return blocks;
}

// Teams for `groups` groups, at most `max_teams`. A round takes about group / team size, i.e.
// teams / resident CTAs, so the time goes as rounds * teams: fewer teams can finish sooner when
// the last round would leave many idle (the VAE's 32 groups of 1 MB over at most 26 teams: two
// rounds of 26 against two of 16, 0.068 -> 0.050 ms). Near-ties keep more teams (larger chunks,
// fewer barriers: the GroupNorm problem took 8.3 ms with two teams against 7.1 with three).
int64_t team_count(int64_t groups, int64_t max_teams) {
  const auto cost = [&](int64_t t) { return ceil_div(groups, t) * t; };
  int64_t best = max_teams;
  for (int64_t t = max_teams - 1; t >= 1; --t) {
    if (cost(t) * 20 < cost(best) * 19) best = t;  // 5% less
  }
  return best;
}

template <typename scalar_t, int V, Activation A>
bool launch_team(TeamArgs<scalar_t>& a, const at::Tensor& x) {
  using acc_t = acc_type<scalar_t>;
  auto kernel = group_norm_team_kernel<scalar_t, V, A>;
  const cudaDeviceProp& prop = *at::cuda::getCurrentDeviceProperties();
  if (!prop.cooperativeLaunch) return false;
  constexpr int64_t pack_bytes = V * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t lenv = a.op.len / V;
  const int64_t max_chunk = std::min<int64_t>(team_cta_bytes(), prop.sharedMemPerBlockOptin - 2048) / pack_bytes;
  if (max_chunk <= 0) return false;
  const size_t max_smem = static_cast<size_t>(max_chunk * pack_bytes);
  allow_dynamic_smem(kernel, max_smem);
  const int per_sm = team_blocks_per_sm(kernel, max_smem);
  const int64_t resident = static_cast<int64_t>(per_sm) * prop.multiProcessorCount;
  // The fewest CTAs that hold a group, then the teams (team_count), each spread over all the CTAs
  // it can have (smaller chunks, the grid's share of the bandwidth).
  const int64_t min_team = ceil_div(lenv, max_chunk);
  if (resident == 0 || min_team > resident) return false;
  const int64_t teams = team_count(a.groups, imin(resident / min_team, a.groups));
  const int64_t chunk = ceil_div(lenv, imin(resident / teams, lenv));
  const int64_t team_size = ceil_div(lenv, chunk);
  // The barrier counters reach rounds * team_size.
  if (ceil_div(a.groups, teams) * team_size > std::numeric_limits<unsigned>::max()) return false;
  a.teams = static_cast<int>(teams);
  a.team_size = static_cast<int>(team_size);
  a.op.chunk = chunk;
  // One buffer for the barrier counters and the partials; the counters are zeroed by a memset on
  // the stream (at::zeros would launch a fill kernel of its own on every forward).
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t counter_bytes = ceil_div(teams * static_cast<int64_t>(sizeof(unsigned)), 16) * 16;
  at::Tensor buffer = at::empty(
      {counter_bytes + 2 * teams * team_size * 3 * static_cast<int64_t>(sizeof(acc_t))}, x.options().dtype(at::kByte));
  unsigned char* base = static_cast<unsigned char*>(buffer.data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(base, 0, static_cast<size_t>(counter_bytes), stream));
  a.arrived = reinterpret_cast<unsigned*>(base);
  a.part = reinterpret_cast<acc_t*>(base + counter_bytes);
  void* args[] = {&a};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
      dim3(static_cast<unsigned>(teams * team_size)), dim3(kTeamThreads), args,
      static_cast<size_t>(chunk * pack_bytes), stream);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // e.g. another context holds part of the device: the split path
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

// Runs the forward with the team kernel and returns true when it applies: ChannelsFirst, 16-byte
// aligned tensors, a group whose x fits the resident grid's shared memory, large groups (see
// team_forward_mode; any size when forced), and a device with cooperative launches.
template <typename scalar_t>
bool forward_team(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& ep, at::Tensor& y, at::Tensor& mean,
    at::Tensor& rstd) {
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    return false;  // double: the split path
  } else {
    const int mode = team_forward_mode();
    if (mode == 0 || sh.N * sh.G == 0 || sh.D * sh.S == 0) return false;
    TeamArgs<scalar_t> a{};
    OnePassArgs<scalar_t>& o = a.op;
    if (!make_one_pass_args<scalar_t, V>(x, weight, bias, eps, sh, layout, ep, y, mean, rstd, o)) return false;
    if (mode != 1) {
      const int64_t x_bytes = o.len * static_cast<int64_t>(sizeof(scalar_t));
      const int64_t bytes = o.streams() * x_bytes;
      const OnePassLimit limit = one_pass_limit();
      if (limit.forced ? bytes <= limit.max_bytes : bytes <= kOnePassMaxBytes && x_bytes < kTeamMinBytes) return false;
    }
    o.cluster = 1;
    a.groups = sh.N * sh.G;
    bool launched = false;
    dispatch_activation(ep.activation, [&](auto act) { launched = launch_team<scalar_t, V, decltype(act)::value>(a, x); });
    return launched;
  }
}

}  // namespace
}  // namespace fusednorm
