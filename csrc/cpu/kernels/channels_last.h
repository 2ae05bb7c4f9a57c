// How the CPU kernels walk a ChannelsLast sample: chunks of rows (the unit of parallel work and
// of partial sums) and blocks of channel vectors within them.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu/kernels/parallel_grain.h"
#include "cpu/kernels/vec_io.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// Rows of a channels-last sample processed as one unit of work: fixed by C alone, so that
// partial sums never depend on the thread count. About 64K elements: per-chunk work (merging the
// channels into groups, the per-chunk partials) is paid once per chunk, and four times as many
// rows as with 16K elements took the (8, 320, 32, 32) forward from ~0.35 to ~0.28 ms. At most
// kBlock rows, so that no channel sums more values in opmath lanes than a ChannelsFirst block.
inline int64_t rows_per_chunk(int64_t C) {
  return std::min<int64_t>(kBlock, std::max<int64_t>(1, 65536 / std::max<int64_t>(C, 1)));
}

// Channels-last chunks are walked in blocks of kChannelVecs vectors of channels, each block down
// all rows of the chunk with its per-channel state in registers: a running state in memory would
// cost a load and a store per vector, as much as the data.
constexpr int kChannelVecs = 4;

// Calls f(c0, count, u) for the vectors u < kChannelVecs of channels of the block starting at cb
// (count: channels in the vector, the last one may be partial). The loop over u is unrolled, so
// that the callers' per-vector state (arrays indexed by u) stays in registers; full blocks take a
// path with no bounds checks.
template <typename F>
inline void for_block_vectors(int64_t cb, int64_t C, int64_t size, F f) {
  if (cb + kChannelVecs * size <= C) {
#pragma GCC unroll 4
    for (int u = 0; u < kChannelVecs; ++u) f(cb + u * size, size, u);
  } else {
#pragma GCC unroll 4
    for (int u = 0; u < kChannelVecs; ++u) {
      const int64_t c0 = cb + u * size;
      if (c0 < C) f(c0, std::min<int64_t>(size, C - c0), u);
    }
  }
}

// Per-channel sums over rows [r0, r1) of a channels-last sample: out[k * C + c] for K
// accumulators. `f(acc, xv, yv, c0, count)` updates the accumulators of channels
// [c0, c0 + count); lanes past `count` load as zeros and are never stored. Each channel's rows are
// added in row order.
template <int K, typename T, typename Y = T, typename F>
void reduce_channels(const T* x, const Y* y, int64_t r0, int64_t r1, int64_t C, double* out, F f) {
  using IO = VecIO<T>;
  using YIO = VecIO<Y>;
  using Vec = typename IO::Vec;
  using acc_t = typename IO::acc_t;
  using Acc = std::array<Vec, K>;
  constexpr int64_t kSize = IO::kSize;
  static_assert(kChannelVecs == 4, "a block's accumulators are written out for 4 vectors");
  // A block's rows, its accumulators four objects of their own, which GCC keeps in registers: as
  // one array indexed through for_block_vectors' lambda they stayed on the stack, a store and a
  // reload of each a row (docs/design.md, "CPU kernels"). `whole`: every vector of the block lies
  // below C (no bounds checks); otherwise vector u covers channels [c0, min(c0 + kSize, C)).
  const auto block = [&](int64_t cb, auto whole) {
    Acc a0, a1, a2, a3;
    for (int k = 0; k < K; ++k) a0[k] = a1[k] = a2[k] = a3[k] = Vec(0);
    const auto step = [&](Acc& a, int64_t r, int u) {
      const int64_t c0 = cb + u * kSize;
      if (!decltype(whole)::value && c0 >= C) return;
      const int64_t count = decltype(whole)::value ? kSize : std::min(kSize, C - c0), o = r * C + c0;
      f(a, IO::load(x + o, count), y ? YIO::load(y + o, count) : Vec(0), c0, count);
    };
    for (int64_t r = r0; r < r1; ++r) {
      step(a0, r, 0);
      step(a1, r, 1);
      step(a2, r, 2);
      step(a3, r, 3);
    }
    const Acc* const acc[kChannelVecs] = {&a0, &a1, &a2, &a3};
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      for (int k = 0; k < K; ++k) {
        acc_t buf[kSize];
        (*acc[u])[k].store(buf);
        for (int64_t i = 0; i < count; ++i) out[k * C + c0 + i] = buf[i];
      }
    });
  };
  for (int64_t cb = 0; cb < C; cb += kChannelVecs * kSize) {
    if (cb + kChannelVecs * kSize <= C) {
      block(cb, std::true_type{});
    } else {
      block(cb, std::false_type{});
    }
  }
}

// Rows taken at a time by the channels-last element passes (the forward's output map, the
// backward's dp and dx). A row of C channels that is not a whole number of vectors ends in a
// partial vector, a masked load and store and a run of the epilogue's loop for a few elements,
// once per row: at C = 3 those passes took 10-30x their channels-first time; and a row of a few
// vectors paid a call and its loop's set-up once per row: at C = 64 the output map took 4x the
// statistics' pass (docs/design.md, "CPU kernels"). rows_per_run(C) rows are one run of
// elements, with the per-channel coefficients repeated as many times (RowRunCoeffs), so that
// every vector but the run's last is whole and a run holds kRunVectors vectors or more; each
// element is computed as before, so the results keep their bits. 1 where a row holds
// kRunVectors vectors already (32 gained nothing more on C = 64-320).
constexpr int64_t kRunVectors = 16;

inline int64_t rows_per_run(int64_t C, int64_t vector_size) {
  if (C >= kRunVectors * vector_size) return 1;
  // The fewest rows whose elements are whole vectors, doubled up to kRunVectors vectors or more.
  int64_t rows = vector_size / std::gcd(C, vector_size);
  while (rows * C < kRunVectors * vector_size) rows *= 2;
  return rows;
}

// Per-channel coefficient arrays of one sample (C values each) for runs of up to `rows` rows
// starting at a row: the arrays themselves for runs of one row, else each repeated `rows` times.
template <typename acc_t, int K>
class RowRunCoeffs {
 public:
  RowRunCoeffs(const std::array<const acc_t*, K>& per_channel, int64_t C, int64_t rows) : ptr_(per_channel) {
    if (rows == 1) return;
    repeated_.resize(K * rows * C);
    for (int k = 0; k < K; ++k) {
      acc_t* out = repeated_.data() + k * rows * C;
      for (int64_t r = 0; r < rows; ++r) std::copy_n(per_channel[k], C, out + r * C);
      ptr_[k] = out;
    }
  }
  // Coefficient array k, indexed by the element's position in its run.
  const acc_t* operator[](int k) const { return ptr_[k]; }

 private:
  std::array<const acc_t*, K> ptr_;
  std::vector<acc_t> repeated_;
};

// Calls body(r, rows) over rows [r0, r1) in runs of at most `run` rows.
template <typename F>
void for_row_runs(int64_t r0, int64_t r1, int64_t run, F body) {
  for (int64_t r = r0; r < r1; r += run) body(r, std::min(run, r1 - r));
}

inline int64_t num_chunks(const GroupNormShape& sh) {
  const int64_t rows = rows_per_chunk(sh.C);
  return (sh.S + rows - 1) / rows;
}

// Calls body(k, r0, r1) for chunk k = rows [r0, r1) of a sample.
template <typename F>
void with_chunk_rows(const GroupNormShape& sh, int64_t k, F body) {
  const int64_t rows = rows_per_chunk(sh.C);
  body(k, k * rows, std::min(sh.S, (k + 1) * rows));
}

// Runs body(chunk, r0, r1) over the chunks of rows of one sample, in order.
template <typename F>
void for_sample_chunks(const GroupNormShape& sh, F body) {
  for (int64_t k = 0, chunks = num_chunks(sh); k < chunks; ++k) with_chunk_rows(sh, k, body);
}

// Runs body(n, chunk, r0, r1) over every chunk of rows of every sample, in parallel.
template <typename F>
void for_each_chunk(const GroupNormShape& sh, F body) {
  const int64_t chunks = num_chunks(sh);
  const int64_t chunk_elements = std::min(sh.S, rows_per_chunk(sh.C)) * sh.C;
  at::parallel_for(0, sh.N * chunks, grain_for(chunk_elements), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / chunks;
      with_chunk_rows(sh, i % chunks, [&](int64_t k, int64_t r0, int64_t r1) { body(n, k, r0, r1); });
    }
  });
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
