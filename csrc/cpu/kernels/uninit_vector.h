// A std::vector whose elements are left uninitialised, for the CPU kernels' scratch arrays.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusednorm::cpu::CPU_CAPABILITY {
namespace {

// An allocator whose value-initialising construct() leaves the element uninitialised, for arrays
// whose every element is written before it is read. Zeroing them was serial work before the
// parallel region, and made the threads' first writes fetch lines the zeroing thread held: the
// backward's per-(n, c) sums, ~200 KB a call on N * C = 4096 rows, cost as long as a short-row
// pass of one thread; the channels-last forward's per-channel coefficients 6-13% of a small
// input's call on two threads (docs/design.md, 'CPU kernels').
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
