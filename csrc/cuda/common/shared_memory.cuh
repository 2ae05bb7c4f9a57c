// Groups staged in shared memory: the launcher's opt-in to more than 48 KB of dynamic shared
// memory (allow_dynamic_smem), and 16-byte packs read back from it in one load (load_pack,
// read_pack). Shared by the kernels that stage x in shared memory (the one-pass, channels-last
// one-pass, team, one-CTA backward and channels-last sweep kernels), none of which needs the
// others' code for it.

#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>

namespace fusednorm {
namespace {

// The alignment of the dynamic shared memory the kernels copy x into (`extern __shared__
// __align__(kSmemLineBytes)`): a 128-byte line. Behind a kernel's static arrays it began off one,
// and every warp's 512 bytes of copies and reads touched five lines, not four (docs/design.md,
// "Team path"; the planner's team chunks are whole lines too, plan.cpp's kTeamChunkAlign).
constexpr int kSmemLineBytes = 128;

// A 16-byte pack from shared memory in one 16-byte load. Read element by element where it lies
// (p.v[j] through a reference into shared memory), a half / bfloat16 pack took eight 2-byte loads.
template <typename P>
__device__ __forceinline__ P load_pack(const P& p) {
  static_assert(sizeof(P) == sizeof(uint4), "shared-memory packs are 16 bytes");
  const uint4 bits = *reinterpret_cast<const uint4*>(&p);
  P out;
  memcpy(&out, &bits, sizeof(P));
  return out;
}

// A pack from shared memory: 16-bit packs in one 16-byte load (load_pack), others as they are
// (float packs were loaded whole already; through load_pack, the float team backward with ReLU
// spilled registers it did not spill before).
template <typename P>
__device__ __forceinline__ P read_pack(const P& p) {
  if constexpr (sizeof(P) == sizeof(uint4) && sizeof(p.v[0]) == 2) {
    return load_pack(p);
  } else {
    return p;
  }
}

// Lets `kernel` take `bytes` of dynamic shared memory. Without the opt-in a CTA gets 48 KB in all,
// its static shared memory (under 1 KB in these kernels) included: a 48 KB group of the one-pass
// backward failed to launch ("invalid argument") when the opt-in began above 48 KB.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes + 1024 > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

}  // namespace
}  // namespace fusednorm
