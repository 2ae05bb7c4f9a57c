// The team grid that the team forward and backward kernels share (docs/design.md, "Team path"):
// a persistent cooperative grid, every CTA resident at once (a cooperative launch guarantees it,
// so that a team's spin barrier cannot wait on a CTA that never runs), cut into teams of CTAs that
// take a tensor's groups in rounds, each CTA a chunk of every group. Here: the CTA shape, the
// teams' barriers, partial slots, start stagger and L2 prefetch (TeamGrid), the CTA folds of the
// backward's partials, and the host side (the residency question, the launch with the counters
// zeroed). The kernels are in group_norm_team.cuh.

#pragma once

#include "cuda/common/base.cuh"
#include "cuda/common/host.cuh"
#include "cuda/common/moments.cuh"
#include "cuda/common/shared_memory.cuh"
#include "plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

namespace fusednorm {
namespace {

// Two CTAs of 512 threads an SM (at most 64 registers a thread): while one computes its moments
// or waits at its barrier, the other's copies and stores keep the SM's DRAM traffic going. With
// one CTA an SM (16 warps) the SM spent a third of each round issuing no DRAM traffic.
constexpr int kTeamThreads = 512;
constexpr int kTeamBlocksPerSM = 2;
// Which groups take the team kernels, the CTAs' shared memory, the teams, the L2 prefetch and
// the partials' copies are the planner's (plan.cpp; docs/design.md, "Team path").

// Teams of at least this many rounds and CTAs are staggered (TeamGrid::start).
constexpr int64_t kStaggerRounds = 3;
constexpr int kStaggerTeamSize = 8;

// Values a CTA publishes per round: the forward's chunk moments (count, mean, M2), the
// backward's sums (see group_norm_team_backward_kernel).
constexpr int kTeamPartials = 3;

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
  int replicas = 1;   // copies of each CTA's partials (the plan's)
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

  // Thread 0, once its CTA's partials of round i are final: writes them to its slot of every copy
  // and arrives at round i's barrier (the fence makes them visible to the team first). The
  // forward's: thread 0 alone, no CTA barrier (docs/design.md, "Team replicas").
  __device__ void publish(int team, int rank, int64_t i, acc_t v0, acc_t v1, acc_t v2) const {
    for (int c = 0; c < replicas; ++c) write_slot(team, rank, i, c, v0, v1, v2);
    arrive(team);
  }

  // The whole CTA, every thread holding the same partials of round i: thread c writes them to its
  // slot of copy c, then thread 0 arrives at round i's barrier (the CTA barrier, where other
  // threads wrote copies, and the fence make every copy, and the CTA's earlier writes, visible to
  // the team first). The backward's: that CTA barrier cost the forward 4-5% (GroupNorm problem
  // 5.95 -> 6.27 ms on an H100; docs/design.md, "Team replicas"), and thread 0 writing 16
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

// Sets the team grid `t` (t.groups set) as planned.
template <typename acc_t>
void set_team_grid(const plan::Plan& pl, TeamGrid<acc_t>& t) {
  t.teams = pl.teams;
  t.team_size = pl.team_size;
  t.chunk = pl.chunk;
  t.replicas = pl.replicas;
  t.prefetch = static_cast<int>(pl.prefetch);
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
  at::Tensor buffer = at::detail::empty_cuda({counter_bytes + 2 * ctas * t.replicas * kTeamPartials * static_cast<int64_t>(sizeof(acc_t))},
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

// The planner's residency question about the team kernel of a call: CTAs an SM with `smem`
// bytes each (the kernel allowed that much first).
template <typename Kernel>
int team_ctas_per_sm(Kernel kernel, int64_t smem) {
  allow_dynamic_smem(kernel, static_cast<size_t>(smem));
  return team_blocks_per_sm(kernel, static_cast<size_t>(smem));
}

}  // namespace
}  // namespace fusednorm
