// The run-time choice of the CPU kernels' build (docs/design.md, 'CPU capabilities'). ATen makes
// the same choice for its own kernels (DispatchStub): its answer, at::get_cpu_capability(), is
// taken as is, so that ATEN_CPU_CAPABILITY=default (or =avx2) moves fusednorm and ATen together.
// setup.py defines FUSEDNORM_CPU_<CAPABILITY> for each build it links in.
#include "cpu/capability.h"

#include <ATen/Version.h>

#include <algorithm>
#include <string>

namespace fusednorm::cpu {
namespace {

// ATen's capability by its name in at::get_cpu_capability(): "AVX512", "AVX2", otherwise the
// portable build ("DEFAULT", "NO AVX", or another architecture's names).
Capability aten_capability() {
  const std::string name = at::get_cpu_capability();
  if (name == "AVX512") return Capability::AVX512;
  if (name == "AVX2") return Capability::AVX2;
  return Capability::Default;
}

// The widest build linked into this library.
constexpr Capability widest_build() {
#if defined(FUSEDNORM_CPU_AVX512)
  return Capability::AVX512;
#elif defined(FUSEDNORM_CPU_AVX2)
  return Capability::AVX2;
#else
  return Capability::Default;
#endif
}

Kernels kernels_of(Capability c) {
  switch (c) {
#if defined(FUSEDNORM_CPU_AVX512)
    case Capability::AVX512:
      return {&AVX512::fused_forward, &AVX512::fused_backward};
#endif
#if defined(FUSEDNORM_CPU_AVX2)
    case Capability::AVX2:
      return {&AVX2::fused_forward, &AVX2::fused_backward};
#endif
    default:
      return {&DEFAULT::fused_forward, &DEFAULT::fused_backward};
  }
}

}  // namespace

Capability capability() {
  static const Capability chosen = std::min(aten_capability(), widest_build());
  return chosen;
}

const char* capability_name(Capability c) {
  switch (c) {
    case Capability::AVX512: return "avx512";
    case Capability::AVX2: return "avx2";
    default: return "default";
  }
}

const Kernels& kernels() {
  static const Kernels chosen = kernels_of(capability());
  return chosen;
}

}  // namespace fusednorm::cpu
