// The per-channel affine parameters (weight, bias) and the per-(n, c) modulation (scale, shift)
// of the CPU kernels, as opmath values.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// Weight / bias as opmath values, 1 and 0 where absent.
template <typename acc_t>
std::vector<acc_t> param_or(const c10::optional<at::Tensor>& p, int64_t C, acc_t fill) {
  std::vector<acc_t> out(C, fill);
  if (p.has_value() && p->defined()) {
    const at::Tensor pc = p->contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, pc.scalar_type(), "param_or", [&] {
      const scalar_t* data = pc.data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) out[c] = static_cast<acc_t>(data[c]);
    });
  }
  return out;
}

// Per-(n, c) values of the modulation, 1 + scale and shift (empty when absent).
template <typename acc_t>
std::vector<acc_t> per_sample_channel_or_empty(const at::Tensor& t, acc_t add) {
  std::vector<acc_t> out;
  if (!t.defined()) return out;
  const at::Tensor ta = t.to(c10::CppTypeToScalarType<acc_t>::value);  // (N, C) contiguous
  const acc_t* p = ta.data_ptr<acc_t>();
  out.resize(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = p[i] + add;
  return out;
}

// The modulation of channel c of sample n: v = u * gain + shift.
template <typename acc_t>
struct Modulation {
  std::vector<acc_t> gain, shift;  // (N * C) each, or empty: 1 and 0
  explicit Modulation(const Epilogue& ep)
      : gain(per_sample_channel_or_empty(ep.scale, acc_t(1))),
        shift(per_sample_channel_or_empty(ep.shift, acc_t(0))) {}
  acc_t gain_at(int64_t nc) const { return gain.empty() ? acc_t(1) : gain[nc]; }
  acc_t shift_at(int64_t nc) const { return shift.empty() ? acc_t(0) : shift[nc]; }
};

// The constant term of the folded map v = (x - hi) * scale + folded_shift, for
// u = (x - hi - lo) * rstd * w + b and v = u * gain + shift (scale = rstd * w * gain). With an
// infinite gain (an infinite `scale` operand) v is +-inf by u's sign: a zero bias and the mean's
// low part (a rounding remainder) are left out there so that they never meet the gain as
// 0 * inf or as inf - inf against the x term (docs/deviations.md, "Non-finite epilogue operands").
template <typename acc_t>
acc_t folded_shift(acc_t b, acc_t gain, acc_t shift, acc_t lo, acc_t scale) {
  if (std::isinf(gain)) return (b == acc_t(0) ? b : b * gain) + shift;
  return b * gain + shift - lo * scale;
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
