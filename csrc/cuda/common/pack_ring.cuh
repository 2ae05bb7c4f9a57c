// A thread's own pipeline of 16-byte loads through shared memory (docs/design.md, "Channels-last
// sweep"): row i's pack is copied by cp.async into slot i % S of the thread's S slots, S - 1 rows
// ahead of its use, so that S - 1 packs a thread are in flight without holding a register each
// (the streaming kernels' register caps left them four, loaded and then used in bursts). Each
// thread reads back only what it copied itself, so no barrier is needed; a slot is refilled only
// after the thread has used the pack it held (one row later). On architectures without cp.async
// (before sm_80) the copies are synchronous: the same values, no overlap.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>

namespace fusednorm {
namespace {

template <int S>
struct PackRing {
  static_assert(S >= 2 && (S & (S - 1)) == 0, "a power of two of slots");
  uint4* base;  // the thread's slot 0; slot k at base + k * stride
  int stride;   // threads of the CTA (consecutive threads' slots adjacent: no bank conflicts)

  // The bytes of shared memory a CTA of `threads` threads needs.
  static constexpr size_t bytes(int threads) { return static_cast<size_t>(S) * threads * sizeof(uint4); }

  __device__ __forceinline__ uint4* slot(int64_t i) const { return base + static_cast<int>(i & (S - 1)) * stride; }

  // Starts the copy of row i's pack from src where `valid`, and closes a commit group either way
  // (take counts groups, one a row).
  __device__ __forceinline__ void issue(int64_t i, bool valid, const uint4* src) const {
    if (valid) __pipeline_memcpy_async(slot(i), src, sizeof(uint4));
    __pipeline_commit();
  }

  // Row i's pack, once issued rows 0 .. i + S - 2 (exactly) have been: waits for row i's copy.
  __device__ __forceinline__ uint4 take(int64_t i) const {
    __pipeline_wait_prior(S - 2);
    return *slot(i);
  }

  // The streaming protocol over a thread's rows 0 .. rows - 1, row i at src + i * stride:
  // start() issues rows 0 .. S - 2; next(i), for i = 0, 1, ..., rows - 1 in turn, returns row i
  // and issues row i + S - 1 (an empty commit group past the last row).
  __device__ __forceinline__ void start(int64_t rows, const uint4* src, int64_t stride) const {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i, i < rows, src + i * stride);
  }
  __device__ __forceinline__ uint4 next(int64_t i, int64_t rows, const uint4* src, int64_t stride) const {
    const uint4 w = take(i);
    const int64_t ahead = i + S - 1;
    issue(ahead, ahead < rows, src + ahead * stride);
    return w;
  }
};

// PackRing's protocol over two streams read row by row together (the residual-add prologue's
// input and addend): each row's two packs are one commit group, in slots i % S of the thread's
// two sets of S slots; S - 1 rows ahead, as PackRing.
template <int S>
struct PairRing {
  static_assert(S >= 2 && (S & (S - 1)) == 0, "a power of two of slots");
  uint4* base;  // the thread's slot 0 of the first stream; the second's S * stride further
  int stride;   // threads of the CTA

  static constexpr size_t bytes(int threads) { return 2 * static_cast<size_t>(S) * threads * sizeof(uint4); }

  __device__ __forceinline__ uint4* slot(int64_t i) const { return base + static_cast<int>(i & (S - 1)) * stride; }

  __device__ __forceinline__ void issue(int64_t i, bool valid, const uint4* a, const uint4* b) const {
    if (valid) {
      uint4* s = slot(i);
      __pipeline_memcpy_async(s, a, sizeof(uint4));
      __pipeline_memcpy_async(s + S * stride, b, sizeof(uint4));
    }
    __pipeline_commit();
  }

  // Row i's two packs, once issued rows 0 .. i + S - 2 (exactly) have been.
  __device__ __forceinline__ void take(int64_t i, uint4& a, uint4& b) const {
    __pipeline_wait_prior(S - 2);
    const uint4* s = slot(i);
    a = s[0];
    b = s[S * stride];
  }

  // Row i of each stream at a + i * step, b + i * step. start() issues rows 0 .. S - 2 and moves a
  // and b on to row S - 1; next(i) returns row i, issues the row a and b are at (i + S - 1) and
  // moves them on a row: running pointers, not a + (i + S - 1) * step each row (the residual-add
  // moments kernel's 64 registers spilled the products' operands; docs/design.md, "Residual-add
  // prologue").
  __device__ __forceinline__ void start(int64_t rows, const uint4*& a, const uint4*& b, int64_t step) const {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      issue(i, i < rows, a, b);
      a += step;
      b += step;
    }
  }
  __device__ __forceinline__ void next(int64_t i, int64_t rows, const uint4*& a, const uint4*& b, int64_t step,
      uint4& wa, uint4& wb) const {
    take(i, wa, wb);
    issue(i + S - 1, i + S - 1 < rows, a, b);
    a += step;
    b += step;
  }
};

}  // namespace
}  // namespace fusednorm
