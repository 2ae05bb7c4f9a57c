// The team forward and backward, for ChannelsFirst groups of kTeamMinBytes and more (the GroupNorm
// problem's 8 MB groups, the VAE's 0.5-8 MB ones, attention's 128 KB) and, in the backward, the
// groups the one-CTA backward cannot hold. Included after group_norm_one_pass.cuh, whose
// arguments, output stage and backward arithmetic they share. The forward first:
//
// A group over kOnePassMaxBytes fits no CTA and no cluster, so the split forward read x twice
// from DRAM; smaller ones took a cluster of CTAs each, which loaded, reduced and wrote in turn,
// with no other work to overlap. Here a persistent grid, every CTA resident at once (a cooperative launch guarantees it, so the spin
// barrier below cannot wait on a CTA that never runs), is cut into teams of CTAs; a team takes
// its groups in turn (rounds), each CTA holding a contiguous chunk of each group in shared memory
// (an 8 MB float32 group is spread over ~80 CTAs, two an SM). For round i a CTA:
//   1. takes the chunk's count, mean and M2 of x - K (one pass over shared memory, a second
//      where the first loses M2's digits; K the group's first element), writes them to global
//      memory and arrives at the team's barrier (a counter in global memory);
//   2. once the whole team has arrived, merges its partials in one fixed order (every CTA and
//      every run gets the same bits: Chan's pairwise formula);
//   3. writes y from shared memory through OnePassOutput, and, as each pack is written, issues
//      the copy of the same pack of round i + 1 into its place, so that reads overlap writes.
// Before step 2's wait, a CTA of a large team brings part of its round i + 1 chunk into L2
// (kTeamPrefetchEighths), the only traffic it can issue while it waits.
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

// FUSEDNORM_TEAM_BACKWARD: the same for the backward ("0" off, "1" every group it can take;
// unset, the groups the one-CTA backward cannot take).
int team_backward_mode() {
  const char* env = std::getenv("FUSEDNORM_TEAM_BACKWARD");
  return env == nullptr ? -1 : std::atoi(env);
}

int64_t team_cta_bytes() {
  const char* env = std::getenv("FUSEDNORM_TEAM_CTA_KB");
  return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) * 1024 : kTeamCtaBytes;
}

// The team forward's L2 prefetch (group_norm_team_kernel): before it waits at round i's barrier, a
// CTA brings kTeamPrefetchEighths / 8 of its round i + 1 chunk into L2, so that the DRAM has work
// while the team synchronises; the output loop's copies of those packs then read L2. Measured on
// an H100 (RESULTS.md, twentieth run): with three teams of 88 CTAs (the GroupNorm problem) every
// round ended with the DRAM drained, and the barrier's wait cost 1.3 ms of 6.9; prefetching 3/8
// gave 6.6-6.8 -> 5.95 ms, InstanceNorm3d 0.485 -> 0.437, the VAE's float16 0.252 -> 0.237 and
// bfloat16 (1,128,512,512) 0.079 -> 0.075 (teams of 24), while 4/8 and more lost to L2 evictions
// (8/8: the GroupNorm problem back at 6.79 ms) and teams of 10 (the InstanceNorm problem's 26 teams,
// whose waits the other teams' traffic already covers) lost 5%. Hence only teams of
// kTeamPrefetchMinCtas CTAs and more. FUSEDNORM_TEAM_PREFETCH=k sets k / 8 for every team (0: off).
// The team backward does the same for each stream it holds (x, dz and the operands), where 4/8
// was best: the InstanceNorm problem's backward (13 teams of 20) 8.83 -> 8.36 ms, the VAE's
// float16 0.587 -> 0.543, the GroupNorm problem's one team of 264 CTAs 13.0 -> 11.3 (then faster
// than its split passes' 12.5).
constexpr int kTeamPrefetchEighths = 3;
constexpr int kTeamBackwardPrefetchEighths = 4;
constexpr int kTeamPrefetchMinCtas = 16;

int team_prefetch_eighths(int team_size, bool backward) {
  const char* env = std::getenv("FUSEDNORM_TEAM_PREFETCH");
  if (env != nullptr) return std::clamp(std::atoi(env), 0, 8);
  if (team_size < kTeamPrefetchMinCtas) return 0;
  return backward ? kTeamBackwardPrefetchEighths : kTeamPrefetchEighths;
}

// Teams of at least this many rounds and CTAs are staggered (TeamGrid::start).
constexpr int64_t kStaggerRounds = 3;
constexpr int kStaggerTeamSize = 8;

// Values a CTA publishes per round: the forward's chunk moments (count, mean, M2), the
// backward's sums (see group_norm_team_backward_kernel).
constexpr int kTeamPartials = 3;

// Copies of a round's partials a backward CTA publishes (TeamGrid::replicas; CTA r reads copy
// r % replicas). Every CTA of a team reads every rank's partials at once after the barrier, and
// with one copy all those reads fall on the few L2 lines that hold them: the GroupNorm problem's
// backward (one team of 264 CTAs) spent about 1 us of each round's critical path in that fold
// (0.93 ms of 11.5, timing-only build skipping it). Measured on an H100 (RESULTS.md, twenty-first
// run) with 1, 4, 8 and 16 copies: that backward 11.35 -> 11.08, 10.95, 10.88 ms, InstanceNorm3d's
// 0.83 -> 0.79, the VAE's float16 0.536 -> 0.525. The forward rows did not move with copies, and
// the CTA-wide publish that copies need (TeamGrid::publish_copies) cost them 4-5%: the forward
// publishes one copy from thread 0 (TeamGrid::publish). A copy costs a CTA 12 bytes of stores a
// round. FUSEDNORM_TEAM_REPLICAS sets it (tuning).
constexpr int kTeamMaxReplicas = 16;

int team_backward_replicas(int team_size) {
  const char* env = std::getenv("FUSEDNORM_TEAM_REPLICAS");
  if (env != nullptr) return std::clamp(std::atoi(env), 1, kTeamMaxReplicas);
  return std::min(team_size, kTeamMaxReplicas);
}

__device__ __forceinline__ unsigned team_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A persistent grid of teams of CTAs, each team taking groups team, team + teams, ... (rounds),
// each CTA a chunk of every group; shared by the forward and backward team kernels.
template <typename acc_t>
struct TeamGrid {
  acc_t* part;        // kTeamPartials per (round parity, team, replica, rank)
  unsigned* arrived;  // one counter per team, zero at launch
  int64_t groups;     // N * G
  int64_t chunk;      // packs of a group per CTA
  int team_size, teams;
  int replicas = 1;   // copies of each CTA's partials: 1 forward, team_backward_replicas backward
  int prefetch = 0;   // packs of its next chunk (of each stream, backward) a CTA brings into L2 before a barrier wait

  // Device side: `team` is this CTA's team, blockIdx.x / team_size, computed once by the kernel.
  __device__ int64_t rounds(int team) const { return team < groups ? ceil_div(groups - team, teams) : 0; }
  __device__ int64_t item_of(int team, int64_t round) const { return team + round * teams; }
  // The team's partials of round i in copy `copy` (one slot of kTeamPartials a rank).
  __device__ acc_t* team_part(int team, int64_t i, int copy) const {
    return part + (((i & 1) * teams + team) * replicas + copy) * team_size * kTeamPartials;
  }
  // The copy CTA `rank` reads after round i's barrier: copy rank % replicas, so that a team's
  // reads spread over its copies (written by other SMs: the callers load it from L2, __ldcg).
  __device__ const acc_t* read_part(int team, int64_t i, int rank) const {
    return team_part(team, i, rank % replicas);
  }

  // Thread 0, once its CTA's partials of round i are final (one copy): writes them to its slot
  // and arrives at round i's barrier (the fence makes them visible to the team first).
  __device__ void publish(int team, int rank, int64_t i, acc_t v0, acc_t v1, acc_t v2) const {
    write_slot(team, rank, i, 0, v0, v1, v2);
    arrive(team);
  }

  // The whole CTA, every thread holding the same partials of round i: thread c writes them to its
  // slot of copy c, then thread 0 arrives at round i's barrier (the CTA barrier, where other
  // threads wrote copies, and the fence make every copy, and the CTA's earlier writes, visible to
  // the team first). The backward's: that CTA barrier cost the forward 4-5% (GroupNorm problem
  // 5.95 -> 6.27 ms on an H100, twenty-first and twenty-second runs), and thread 0 writing 16
  // copies itself cost the backward more than the copies gained. (ptxas: the barrier taken only
  // with copies leaves the 16-bit kernels 60 bytes spilled, 72 without the test.)
  __device__ void publish_copies(int team, int rank, int64_t i, acc_t v0, acc_t v1, acc_t v2) const {
    if (static_cast<int>(threadIdx.x) < replicas) write_slot(team, rank, i, static_cast<int>(threadIdx.x), v0, v1, v2);
    if (replicas > 1) __syncthreads();
    if (threadIdx.x == 0) arrive(team);
  }

  // The whole CTA, before its first copies: an odd team of kStaggerRounds rounds or more (and
  // kStaggerTeamSize CTAs) waits until the team before it has arrived at its round 0 barrier (its
  // copies landed, its moments taken), so that the two teams' barriers and folds, where a team
  // issues no DRAM traffic, fall at different times. (Team t - 1 has at least as many rounds as
  // team t, and all its CTAs are resident.) H100, forward: the VAE's float16 (1,128,1024,1024)
  // 0.268 -> 0.250 ms (3 teams of 11 rounds), InstanceNorm3d 0.507 -> 0.484 (3 of 22), the
  // bfloat16 (1,128,512,512) 0.082 -> 0.080; with one round the wait is pure delay (UNet
  // (8,640,32,32) float16 0.0218 -> 0.0245), attention's 132 teams of 2 CTAs lost 1.3%, and the
  // GroupNorm problem's 299 rounds did not move (its teams fall back into step).
  __device__ void start(int team) const {
    if ((team & 1) == 0 || rounds(team) < kStaggerRounds || team_size < kStaggerTeamSize) return;
    if (threadIdx.x == 0) {
      while (team_load_acquire(arrived + team - 1) < static_cast<unsigned>(team_size)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(100);
#endif
      }
    }
    __syncthreads();
  }

  // The first `prefetch` packs of the `count` at `chunk` (the CTA's next chunk) into L2: lane l of
  // the first warp takes pieces l, l + 32, ... of kPrefetchPiece packs, each one bulk prefetch.
  template <typename P>
  __device__ void prefetch_chunk(const P* chunk, int count) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(sizeof(P) % 16 == 0, "bulk prefetches move whole 16-byte units");
    constexpr int kPrefetchPiece = 1024;
    const int packs = prefetch < count ? prefetch : count;
    if (threadIdx.x >= kWarp) return;
    for (int p0 = static_cast<int>(threadIdx.x) * kPrefetchPiece; p0 < packs; p0 += kWarp * kPrefetchPiece) {
      const int n = packs - p0 < kPrefetchPiece ? packs - p0 : kPrefetchPiece;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(chunk + p0), "r"(static_cast<unsigned>(n * sizeof(P)))
                   : "memory");
    }
#endif
  }

  // Rank `rank`'s slot of round i's partials in copy `copy`.
  __device__ void write_slot(int team, int rank, int64_t i, int copy, acc_t v0, acc_t v1, acc_t v2) const {
    acc_t* p = team_part(team, i, copy) + rank * kTeamPartials;
    p[0] = v0;
    p[1] = v1;
    p[2] = v2;
  }

  // One thread of the CTA, after its partials: the arrival at the team's barrier, the fence
  // making them (and the CTA's earlier writes) visible to the team first.
  __device__ void arrive(int team) const {
    __threadfence();
    atomicAdd(arrived + team, 1u);
  }

  // The whole CTA: returns once every CTA of the team has arrived at round i's barrier. The
  // counter also counts round i + 1's arrivals, but a CTA arrives there only after the whole
  // team arrived at round i.
  __device__ void wait(int team, int64_t i) const {
    if (threadIdx.x == 0) {
      const unsigned target = static_cast<unsigned>((i + 1) * team_size);
      while (team_load_acquire(arrived + team) < target) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(20);
#endif
      }
    }
    __syncthreads();
  }
};

template <typename scalar_t>
struct TeamArgs {
  OnePassArgs<scalar_t> op;           // op.chunk and op.cluster unused
  TeamGrid<acc_type<scalar_t>> team;  // partials: a chunk's count, mean and M2
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

template <typename acc_t>
__device__ __forceinline__ ChunkMoments<acc_t> shfl_xor(const ChunkMoments<acc_t>& v, int mask) {
  return {shfl_xor(v.n, mask), shfl_xor(v.mean, mask), shfl_xor(v.m2, mask)};
}

// Combines every thread's `v` over the CTA in a fixed order: a butterfly in each warp (both
// lanes of a pair combine in the same order, so they get the same bits), then the warps' results
// in warp order. Every thread returns the same bits. `smem` (kTeamThreads / kWarp states) may be
// written again only after a later __syncthreads.
template <typename State, typename Combine>
__device__ __forceinline__ State team_block_fold(State v, const Combine& combine, State* smem) {
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const State other = shfl_xor(v, off);
    v = (threadIdx.x & off) ? combine(other, v) : combine(v, other);
  }
  if ((threadIdx.x & (kWarp - 1)) == 0) smem[threadIdx.x >> kLogWarp] = v;
  __syncthreads();
  State total = smem[0];
#pragma unroll
  for (int w = 1; w < kTeamThreads / kWarp; ++w) total = combine(total, smem[w]);
  return total;
}

// The team's partials of a round, one state a rank (`load` reads one from its slot), combined
// over the CTA as team_block_fold: thread t takes ranks t, t + kTeamThreads, ... in order. The
// whole CTA loads at once: one warp reading the ranks in turn waited team_size / 32 round trips
// to L2 (9 on the GroupNorm problem's backward, with every SM idle meanwhile).
template <typename State, typename Load, typename Combine>
__device__ __forceinline__ State team_fold(const State& identity, int team_size, const Load& load,
    const Combine& combine, State* smem) {
  State v = identity;
  for (int r = threadIdx.x; r < team_size; r += kTeamThreads) v = combine(v, load(r));
  return team_block_fold(v, combine, smem);
}

template <typename scalar_t, int V, Activation A>
__global__ void __launch_bounds__(kTeamThreads, kTeamBlocksPerSM) group_norm_team_kernel(const TeamArgs<scalar_t> a) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char team_smem[];
  __shared__ acc_t red[kTeamThreads / kWarp];
  __shared__ ChunkMoments<acc_t> fold[kTeamThreads / kWarp];
  const OnePassArgs<scalar_t>& o = a.op;
  const TeamGrid<acc_t>& t = a.team;
  const EpiArgs<scalar_t>& e = o.epi;
  const int team = static_cast<int>(blockIdx.x) / t.team_size;
  const int rank = static_cast<int>(blockIdx.x) - team * t.team_size;
  const int64_t lenv = o.len / V;
  const int64_t v_begin = imin(lenv, rank * t.chunk);  // this CTA's packs of a group: [v_begin, v_end)
  const int count = static_cast<int>(imin(lenv, v_begin + t.chunk) - v_begin);
  const int64_t rounds = t.rounds(team);
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
  const auto moments = [&](int64_t i, acc_t K) {
    __pipeline_wait_prior(0);
    acc_t s1 = acc_t(0), s2 = acc_t(0);
    for (int v = threadIdx.x; v < count; v += kTeamThreads) {
      const P p = load_pack(x[v]);
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
    const acc_t mean = count > 0 ? s1 / n : acc_t(0);
    acc_t m2 = s2 - s1 * mean;
    // M2 = s2 - s1 * mean loses digits as it falls below s2, i.e. as K lies far from the chunk
    // (1.5-3% variance error for a 1e4 first element among N(0, 1) values): there, and only
    // there (the test is the same on every thread), a second pass takes the squared deviations
    // from the mean. Always taking it cost bfloat16 rows a quarter of their time (the VAE's
    // 0.086 -> 0.107 ms, attention 0.081 -> 0.104 on an H100): the moments lie on every round's
    // critical path. Where M2 >= s2 / 8 the cancellation costs at most 3 bits.
    if (m2 < s2 * acc_t(0.125)) {
      m2 = acc_t(0);
      for (int v = threadIdx.x; v < count; v += kTeamThreads) m2 += pack_squared_deviations<acc_t>(load_pack(x[v]), K, mean);
      m2 = one_pass_block_sum<kTeamThreads>(m2, red);
    }
    if (threadIdx.x == 0) t.publish(team, rank, i, n, mean, m2);
  };
  // The group's first element, loaded well before moments() needs it.
  const auto first_of = [&](int64_t i) { return static_cast<acc_t>(o.x[t.item_of(team, i) * o.len]); };

  acc_t K = acc_t(0);
  t.start(team);
  if (rounds > 0) {
    const P* src = reinterpret_cast<const P*>(o.x + t.item_of(team, 0) * o.len) + v_begin;
    for (int v = threadIdx.x; v < count; v += kTeamThreads) __pipeline_memcpy_async(&x[v], &src[v], sizeof(P));
    __pipeline_commit();
    K = first_of(0);
    moments(0, K);
  }
  for (int64_t i = 0; i < rounds; ++i) {
    if (i + 1 < rounds && t.prefetch > 0) {
      t.prefetch_chunk(reinterpret_cast<const P*>(o.x + t.item_of(team, i + 1) * o.len) + v_begin, count);
    }
    t.wait(team, i);
    const int64_t item = t.item_of(team, i);
    const acc_t* team_part = t.team_part(team, i, 0);  // written by other SMs: read from L2
    const ChunkMoments<acc_t> m = team_fold(
        ChunkMoments<acc_t>{acc_t(0), acc_t(0), acc_t(0)}, t.team_size,
        [&](int r) {
          const acc_t* p = team_part + r * kTeamPartials;
          return ChunkMoments<acc_t>{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)};
        },
        [](const ChunkMoments<acc_t>& l, const ChunkMoments<acc_t>& r) { return merge_chunks(l, r); }, fold);
    const acc_t var = m.m2 > acc_t(0) ? m.m2 / static_cast<acc_t>(o.len) : acc_t(0);
    const acc_t rstd = acc_t(1) / sqrt(var + o.eps);
    if (rank == 0 && threadIdx.x == 0) {
      o.mean[item] = K + m.mean;
      o.rstd[item] = rstd;
    }
    const int64_t ng = div_nn(item, o.G);
    OnePassOutput<scalar_t, V, A> out(o, ng, item - ng * o.G, K, m.mean, rstd);
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
        yg[v] = out(v_begin + v, load_pack(x[v]), rp, has_r, mp, has_m);
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
// The team backward: the one-pass backward's arithmetic (group_norm_one_pass.cuh) for groups
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
  extern __shared__ __align__(16) unsigned char team_smem[];
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

// Sizes the team grid `t` of `kernel` (t.groups set) for groups of `lenv` packs, each pack taking
// `pack_bytes` of a CTA's shared memory (the pack times the streams held): the fewest CTAs that
// hold a group, then the teams (team_count), each spread over all the CTAs it can have (smaller
// chunks, the grid's share of the bandwidth), the packs a CTA prefetches and the copies of its
// partials (the `backward` kernel's rules or the forward's: team_prefetch_eighths,
// team_backward_replicas). False where the device has no cooperative launch or the group does
// not fit the resident grid.
template <typename acc_t, typename Kernel>
bool plan_team(Kernel kernel, int64_t lenv, int64_t pack_bytes, bool backward, TeamGrid<acc_t>& t) {
  const cudaDeviceProp& prop = *at::cuda::getCurrentDeviceProperties();
  if (!prop.cooperativeLaunch) return false;
  const int64_t max_chunk = std::min<int64_t>(team_cta_bytes(), prop.sharedMemPerBlockOptin - 2048) / pack_bytes;
  if (max_chunk <= 0) return false;
  const size_t max_smem = static_cast<size_t>(max_chunk * pack_bytes);
  allow_dynamic_smem(kernel, max_smem);
  const int per_sm = team_blocks_per_sm(kernel, max_smem);
  const int64_t resident = static_cast<int64_t>(per_sm) * prop.multiProcessorCount;
  const int64_t min_team = ceil_div(lenv, max_chunk);
  if (resident == 0 || min_team > resident) return false;
  const int64_t teams = team_count(t.groups, imin(resident / min_team, t.groups));
  const int64_t chunk = ceil_div(lenv, imin(resident / teams, lenv));
  const int64_t team_size = ceil_div(lenv, chunk);
  // The barrier counters reach rounds * team_size.
  if (ceil_div(t.groups, teams) * team_size > std::numeric_limits<unsigned>::max()) return false;
  t.teams = static_cast<int>(teams);
  t.team_size = static_cast<int>(team_size);
  t.chunk = chunk;
  t.replicas = backward ? team_backward_replicas(t.team_size) : 1;
  t.prefetch = static_cast<int>(chunk * team_prefetch_eighths(t.team_size, backward) / 8);
  return true;
}

// Launches `kernel` on the grid planned in `t` (a member of `args`) with `smem` bytes of shared
// memory a CTA, after giving `t` its barrier counters and partials: one buffer, the counters
// zeroed by a memset on the stream (at::zeros would launch a fill kernel of its own every call).
// False, having launched nothing, where the device refuses a grid that large (another context
// holds part of it): the caller then takes another path.
template <typename acc_t, typename Kernel, typename Args>
bool launch_team_grid(Kernel kernel, Args& args, TeamGrid<acc_t>& t, size_t smem, const at::Tensor& like) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t ctas = static_cast<int64_t>(t.teams) * t.team_size;
  const int64_t counter_bytes = ceil_div(t.teams * static_cast<int64_t>(sizeof(unsigned)), 16) * 16;
  at::Tensor buffer = at::empty({counter_bytes + 2 * ctas * t.replicas * kTeamPartials * static_cast<int64_t>(sizeof(acc_t))},
      like.options().dtype(at::kByte));
  unsigned char* base = static_cast<unsigned char*>(buffer.data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(base, 0, static_cast<size_t>(counter_bytes), stream));
  t.arrived = reinterpret_cast<unsigned*>(base);
  t.part = reinterpret_cast<acc_t*>(base + counter_bytes);
  void* kernel_args[] = {&args};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
      dim3(static_cast<unsigned>(ctas)), dim3(kTeamThreads), kernel_args, smem, stream);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

template <typename scalar_t, int V, Activation A>
bool launch_team(TeamArgs<scalar_t>& a, const at::Tensor& x) {
  auto kernel = group_norm_team_kernel<scalar_t, V, A>;
  constexpr int64_t pack_bytes = V * static_cast<int64_t>(sizeof(scalar_t));
  if (!plan_team(kernel, a.op.len / V, pack_bytes, /*backward=*/false, a.team)) return false;
  return launch_team_grid(kernel, a, a.team, static_cast<size_t>(a.team.chunk * pack_bytes), x);
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
    if (mode == 0 || layout != Layout::ChannelsFirst || sh.N * sh.G == 0 || sh.D * sh.S == 0) return false;
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
    a.team.groups = sh.N * sh.G;
    bool launched = false;
    dispatch_activation(ep.activation, [&](auto act) { launched = launch_team<scalar_t, V, decltype(act)::value>(a, x); });
    return launched;
  }
}

template <typename scalar_t, int V, Activation A, Keep K>
bool launch_team_backward(TeamBackwardArgs<scalar_t>& a, int mode, const at::Tensor& x, bool want_params,
    at::Tensor& part_c, at::Tensor& rec) {
  using acc_t = acc_type<scalar_t>;
  auto kernel = group_norm_team_backward_kernel<scalar_t, V, A, K>;
  OnePassBackwardArgs<scalar_t>& o = a.op;
  const int64_t pack_bytes = o.streams() * V * static_cast<int64_t>(sizeof(scalar_t));
  if (!plan_team(kernel, o.len / V, pack_bytes, /*backward=*/true, a.team)) return false;
  // One team takes the whole grid, every CTA waiting at every round's barrier: without the L2
  // prefetch, the split passes were faster there on the plain backward (H100: GroupNorm problem
  // 13.1 against 12.6 ms, InstanceNorm3d 0.95 against 0.92), unlike with an activation, whose
  // split backward costs more (the VAE's 8 MB float16 groups with SiLU: 0.66 against 0.74).
  if (mode != 1 && a.team.teams == 1 && a.team.prefetch == 0 && o.epi.act == Activation::None &&
      o.epi.multiplier == nullptr && o.epi.scale.ptr == nullptr) {
    return false;
  }
  const int64_t chunk = a.team.chunk;
  const int64_t spv = o.S / V;
  // A channel's spv packs overlap at most this many chunks.
  a.split = ceil_div(spv - 1, chunk) + 1;
  // Segments of threads per channel: as wide as a chunk's share of a channel, but narrow enough
  // that the most channels a chunk spans take one sweep (each sweep costs a segment reduction
  // and the coefficients' loads: six sweeps a round made the attention block's backward slower
  // than the split passes).
  const int64_t max_channels = std::min<int64_t>(o.D, ceil_div(chunk - 1, spv) + 1);
  int log_fit = 0;
  while ((int64_t(2) << log_fit) * max_channels <= kTeamThreads) ++log_fit;
  o.log_seg = std::min(log_fit, ceil_log2(std::min(spv, chunk)));
  if (want_params) {
    const auto opts = x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const int64_t NC = a.team.groups / o.G * o.C;
    at::Tensor buffer = at::empty({NC * 2 * (1 + a.split)}, opts);
    part_c = buffer.narrow(0, 0, NC * 2);
    rec = at::empty({a.team.groups * kRec}, opts);
    o.part_c = part_c.data_ptr<acc_t>();
    o.rec = rec.data_ptr<acc_t>();
    a.channel_parts = o.part_c + NC * 2;
  }
  return launch_team_grid(kernel, a, a.team, static_cast<size_t>(chunk * pack_bytes), x);
}

// Runs the backward's elementwise outputs and the sums behind the parameter gradients with the
// team kernel and returns true when it applies: dx wanted (without it one read pass suffices: the
// split path), ChannelsFirst, S a multiple of the pack width, 16-byte aligned tensors, a group that
// fits the resident grid, and a device with cooperative launches. part_c and rec are then set
// for the parameter gradients when `want_params`, as backward_one_pass sets them. mode:
// team_backward_mode(), read once a call.
template <typename scalar_t>
bool backward_team(int mode, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, const at::Tensor& bias, const GroupNormShape& sh, Layout layout, const Epilogue& ep,
    const FusedGradMask& mask, FusedGrads& g, bool want_params, at::Tensor& part_c, at::Tensor& rec) {
  constexpr int V = pack_width<scalar_t>();
  if constexpr (V == 1) {
    return false;  // double: the split path
  } else {
    if (mode == 0 || !mask[0] || sh.N * sh.G == 0 || sh.D * sh.S == 0 || sh.S % V != 0) return false;
    TeamBackwardArgs<scalar_t> a{};
    if (!make_one_pass_backward_args<scalar_t, V>(dy, x, mean, rstd, weight, bias, sh, layout, ep, mask, g, a.op)) {
      return false;
    }
    a.team.groups = sh.N * sh.G;
    bool launched = false;
    dispatch_activation(ep.activation, [&](auto act) {
      constexpr Activation kA = decltype(act)::value;
      dispatch_keep<kA>(keep_for(a.op), [&](auto keep) {
        launched = launch_team_backward<scalar_t, V, kA, decltype(keep)::value>(a, mode, x, want_params, part_c, rec);
      });
    });
    return launched;
  }
}

}  // namespace
}  // namespace fusednorm
