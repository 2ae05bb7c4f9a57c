// ColsPlace, a thread's place in a ChannelsLast group: how the ChannelsLast register kernel
// (one_pass_register_kernel.cuh) and the channels-last shared-memory kernel (cols_one_pass_kernel.cuh)
// lay their threads over a group's rows and channels. A header of its own, so that neither
// kernel's header includes the other's.

#pragma once

#include <cstdint>

namespace fusednorm {
namespace {

// Where a thread works in a ChannelsLast group of S rows of D channels (OnePassArgs::cols): in
// lanes of V channels, thread t keeps lane t % lanes, so that its channels' coefficients load
// once, and takes rows row0 = t / lanes, row0 + step, ...; threads past step * lanes hold none.
template <int V>
struct ColsPlace {
  int lanes = 0, row0 = 0, lane = 0, step = 0;

  ColsPlace() = default;
  __device__ __forceinline__ ColsPlace(int64_t D, int threads)
      : lanes(static_cast<int>(D / V)),
        row0(static_cast<int>(threadIdx.x) / lanes),
        lane(static_cast<int>(threadIdx.x) - row0 * lanes),
        step(threads / lanes) {}

  __device__ __forceinline__ bool active() const { return row0 < step; }
  // The thread's pack of row s: in elements from the group's first, and its index in the group
  // stored densely (pack (s, lane) at s * lanes + lane).
  __device__ __forceinline__ int64_t offset(int64_t s, int64_t C) const { return s * C + lane * V; }
  __device__ __forceinline__ int64_t dense(int64_t s) const { return s * lanes + lane; }
};

}  // namespace
}  // namespace fusednorm
