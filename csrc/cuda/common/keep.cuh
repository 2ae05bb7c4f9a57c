// What the sums phase of a one-CTA or team backward keeps for its dx phase (docs/design.md,
// "One-CTA backward"): a kernel template parameter that the host side (the planner's residency
// questions) also chooses, so it lives apart from the kernels.
#pragma once

#include "group_norm.h"

namespace fusednorm {
namespace {

// What the sums phase leaves for the dx phase (Keep): nothing (None: no activation and no
// multiplier, so dp = dz, as in the plain backward or with a residual alone); dp, written over dz
// in shared memory (Dp); or dp and grad_residual / grad_multiplier, written to global memory at
// once (DpAndGrads: both are known before the group's sums, and grad_multiplier = dz * act(p)
// needs the dz that dp replaces). The dx phase then reads x and dp only, as the plain backward
// does: the activation's derivative (and the residual's and multiplier's reads) taken once an
// element instead of twice.
// dp is kept rounded to scalar_t (exact in float), as eager PyTorch rounds the gradient that its
// activation or multiplication backward hands the normalization's.
enum class Keep { None, Dp, DpAndGrads };

// What the sums phase of a backward keeps (a kernel template parameter, so that each kernel holds
// one sums loop and one dx loop: with every choice in one kernel, the plain team backward spilled
// and took 12% longer): dp where the activation's derivative or a multiplier make it differ from
// dz, with the operands' gradients where either is wanted.
inline Keep keep_for(Activation act, bool multiplier, bool operand_grads) {
  if (act == Activation::None && !multiplier) return Keep::None;  // dp = dz
  return operand_grads ? Keep::DpAndGrads : Keep::Dp;
}

}  // namespace
}  // namespace fusednorm
