// The output loop of the streaming forwards (sweep_path.cuh, cols_sweep_path.cuh): y written a
// batch of 16-byte packs at a time from x's packs and, where present, the residual's and the
// multiplier's.
#pragma once

#include "cuda/common/base.cuh"

#include <cstring>

namespace fusednorm {
namespace {

// The packs u < U with valid(u), at pack offsets offset(u) of xs, rs, ms and ys: every load
// first, each pack kept a 16-byte word until used (as packs of eight 2-byte elements in flight
// they took a register each and spilled), then y's pack from element(j, x, r, m), element j of
// the pack before rounding; r / m are read only where has_r / has_m.
template <int U, typename scalar_t, int V, typename Valid, typename Offset, typename Element>
__device__ __forceinline__ void output_packs(const uint4* xs, const uint4* rs, const uint4* ms, uint4* ys,
    bool has_r, bool has_m, const Valid& valid, const Offset& offset, const Element& element) {
  using acc_t = acc_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  static_assert(sizeof(P) == sizeof(uint4), "16-byte packs");
  uint4 xw[U], rw[U], mw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (valid(u)) {
      xw[u] = __ldg(xs + offset(u));
      if (has_r) rw[u] = __ldg(rs + offset(u));
      if (has_m) mw[u] = __ldg(ms + offset(u));
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (valid(u)) {
      P xp, rp, mp;
      memcpy(&xp, &xw[u], sizeof(P));
      if (has_r) memcpy(&rp, &rw[u], sizeof(P));
      if (has_m) memcpy(&mp, &mw[u], sizeof(P));
      acc_t z[V];
#pragma unroll
      for (int j = 0; j < V; ++j) z[j] = element(j, xp, rp, mp);
      const P yp = round_pack<scalar_t, V>(z);
      uint4 yw;
      memcpy(&yw, &yp, sizeof(P));
      ys[offset(u)] = yw;
    }
  }
}

}  // namespace
}  // namespace fusednorm
