// Which build of the CPU kernels runs: the run-time dispatch by CPU capability
// (docs/design.md, 'CPU capabilities').
#pragma once

#include "cpu/kernels.h"

namespace fusednorm::cpu {

// The builds of csrc/cpu/kernels/, as ATen's CPUCapability on x86-64.
enum class Capability { Default, AVX2, AVX512 };

// The capability the kernels use in this process: ATen's own choice (at::get_cpu_capability(),
// which honours ATEN_CPU_CAPABILITY and otherwise asks the CPU), capped at the widest build
// linked in. Fixed at the first call, as ATen's.
Capability capability();

// "default", "avx2" or "avx512": lower-case, as ATEN_CPU_CAPABILITY takes them.
const char* capability_name(Capability capability);

// The entry points of the build that capability() names.
struct Kernels {
  ForwardKernel* forward;
  BackwardKernel* backward;
};
const Kernels& kernels();

}  // namespace fusednorm::cpu
