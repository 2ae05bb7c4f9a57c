// What every kernel shares: the CTA shapes of the split passes, accumulation types, 64-bit index
// helpers, parameters read in their own dtype, and 16-byte packs (docs/design.md, "Split passes").
#pragma once

#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm {
namespace {

constexpr int kThreads = 256;
constexpr int kLogThreads = 8;
constexpr int kWarp = 32;
constexpr int kLogWarp = 5;
// Packs (16-byte vectors, or single elements on the scalar path) each thread loads before using
// any of them: memory-level parallelism.
constexpr int kUnroll = 4;
// The most partial results one finalize item merges. Bounds how finely the reduce passes split a
// group (and so the finalize's latency); the reduce passes still get enough CTAs for large inputs.
constexpr int64_t kMaxEntries = 4096;
// The same for the per-channel parameter gradients, reduced by few CTAs when C is small.
constexpr int64_t kMaxParamEntries = 512;
constexpr int kBlocksPerSM = 2048 / kThreads;
// Register cap (65536 / (kThreads * kMinBlocks) = 128) for the kernels that hold a pack of
// channels' worth of state per thread: at least 512 threads per SM keep enough loads in flight.
constexpr int kMinBlocks = 2;
// Values per (n, g) record consumed by the apply pass: hi, lo, rstd, b1, b2 (see Coef).
constexpr int kRec = 5;

template <typename scalar_t>
using acc_type = at::opmath_type<scalar_t>;  // float, or double for double

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a / b for a >= 0, b > 0. GPUs have no 64-bit divider (it is a long software sequence); take
// the 32-bit path whenever both operands fit, which is nearly always.
__device__ __forceinline__ int64_t div_nn(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) {
    return static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
  }
  return a / b;
}

// ---------------------------------------------------------------------------------------------
// Parameters and parameter gradients. Their dtype is the input's or float32 (mixed precision),
// chosen at run time so that kernels are not instantiated once per parameter dtype: they are
// read once per row or column, never per element, so the switch costs nothing.

struct ParamRef {
  const void* ptr;  // null: absent
  at::ScalarType dtype;
};

struct GradRef {
  void* ptr;  // null: not requested
  at::ScalarType dtype;
};

template <typename acc_t>
__device__ __forceinline__ acc_t load_param(const ParamRef& p, int64_t c, acc_t absent) {
  if (p.ptr == nullptr) return absent;
  switch (p.dtype) {
    case at::ScalarType::Double:
      return static_cast<acc_t>(static_cast<const double*>(p.ptr)[c]);
    case at::ScalarType::Half:
      return static_cast<acc_t>(static_cast<float>(static_cast<const at::Half*>(p.ptr)[c]));
    case at::ScalarType::BFloat16:
      return static_cast<acc_t>(static_cast<float>(static_cast<const at::BFloat16*>(p.ptr)[c]));
    default:
      return static_cast<acc_t>(static_cast<const float*>(p.ptr)[c]);
  }
}

template <typename acc_t>
__device__ __forceinline__ void store_grad(const GradRef& p, int64_t c, acc_t v) {
  if (p.ptr == nullptr) return;
  switch (p.dtype) {
    case at::ScalarType::Double:
      static_cast<double*>(p.ptr)[c] = static_cast<double>(v);
      break;
    case at::ScalarType::Half:
      static_cast<at::Half*>(p.ptr)[c] = static_cast<at::Half>(static_cast<float>(v));
      break;
    case at::ScalarType::BFloat16:
      static_cast<at::BFloat16*>(p.ptr)[c] = static_cast<at::BFloat16>(static_cast<float>(v));
      break;
    default:
      static_cast<float*>(p.ptr)[c] = static_cast<float>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Vectorised access. A pack is V consecutive elements, 16 bytes on the vector path (V = 1 on the
// scalar path, taken when a pointer is not 16-byte aligned or the row length is not a multiple of
// V: storage offsets and odd sizes).

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Element j of a pack, in acc_t. A bfloat16 pair is one 32-bit word, its high element the word
// with the low half masked (one LOP3) and its low element the word shifted (one SHF); element by
// element through c10::BFloat16 (cuda_bf16's conversion, opaque asm) the high one took a PRMT and
// an IMAD.U32 (SASS: 1.5 instructions an element in the team forward's moments loop, against
// half's one HADD2.F32). Exact either way, as every bfloat16 is a float with a zero low half.
template <typename acc_t, typename scalar_t, int V>
__device__ __forceinline__ acc_t pack_element(const Pack<scalar_t, V>& p, int j) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && V % 2 == 0 && std::is_same_v<acc_t, float>) {
    uint32_t w;
    memcpy(&w, &p.v[j & ~1], sizeof(w));
    return __uint_as_float((j & 1) != 0 ? (w & 0xffff0000u) : (w << 16));
  } else {
    return static_cast<acc_t>(p.v[j]);
  }
}

// The pack of z[0..V) rounded to scalar_t. 16-bit packs are built as 32-bit words, two
// elements a conversion: built element by element (a c10::Half or BFloat16 each), a half pack
// of the team forward took nine PRMTs to take the converted pairs apart and put them together
// again before its 16-byte store (SASS). Both round to nearest even, as static_cast does.
template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ Pack<scalar_t, V> round_pack(const acc_t (&z)[V]) {
  Pack<scalar_t, V> p;
  constexpr bool kHalf = std::is_same_v<scalar_t, c10::Half>;
  constexpr bool kBFloat16 = std::is_same_v<scalar_t, c10::BFloat16>;
  if constexpr ((kHalf || kBFloat16) && V % 2 == 0 && std::is_same_v<acc_t, float>) {
    uint32_t words[V / 2];
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      if constexpr (kHalf) {
        const __half2 h = __floats2half2_rn(z[2 * j], z[2 * j + 1]);
        memcpy(&words[j], &h, sizeof(uint32_t));
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(z[2 * j], z[2 * j + 1]);
        memcpy(&words[j], &h, sizeof(uint32_t));
      }
    }
    memcpy(&p, words, sizeof(p));
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = static_cast<scalar_t>(z[j]);
  }
  return p;
}

template <typename scalar_t>
constexpr int pack_width() {
  // 2 doubles per pack buy little over scalar 8-byte loads: doubles take the scalar path only,
  // which saves instantiations.
  return sizeof(scalar_t) >= 8 ? 1 : 16 / static_cast<int>(sizeof(scalar_t));
}

// Loads packs first + u * step for u < nvalid into registers, converted to acc_t; the others
// read as zero. All loads are issued before any is used.
template <int U, int V, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_packs(
    const scalar_t* base, int64_t first, int64_t step, int nvalid, acc_t (&out)[U][V]) {
  const Pack<scalar_t, V>* p = reinterpret_cast<const Pack<scalar_t, V>*>(base);
  Pack<scalar_t, V> raw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nvalid) raw[u] = p[first + u * step];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out[u][j] = u < nvalid ? pack_element<acc_t>(raw[u], j) : acc_t(0);
    }
  }
}

}  // namespace
}  // namespace fusednorm
