// How many items each task of an at::parallel_for takes in the CPU kernels.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace fusednorm::cpu::CPU_CAPABILITY {
namespace {

// ATen's grain for elementwise loops (at::internal::GRAIN_SIZE, declared in TensorIterator.h).
constexpr int64_t kMinTaskElements = 32768;

// Items a task so that every task has at least kMinTaskElements elements of work, at
// `elements_per_item` each (values read or written): below that a parallel region costs more
// than it saves, and at::parallel_for runs a range of one task inline. A grain of one item a task
// made small channels-last inputs slower on two threads than on one (2-core Xeon, (2,512,4,4)
// forward 19.8 -> 28.8 us; docs/design.md, 'CPU kernels').
inline int64_t grain_for(int64_t elements_per_item) {
  const int64_t per_item = std::max<int64_t>(1, elements_per_item);
  return std::max<int64_t>(1, (kMinTaskElements + per_item - 1) / per_item);
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
