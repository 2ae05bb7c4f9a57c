// The per-element side of the fused epilogue (residual, activation, multiplier) in the CPU
// kernels' loops, forward and backward.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#include "cpu/kernels/vec_io.h"
#include "cpu/kernels/vec_math.h"
#include "epilogue.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// The per-element side of an epilogue: residual and multiplier share x's offsets (make_epilogue
// puts them in x's layout). The per-(n, c) side (scale, shift) is folded into the affine
// coefficients by the callers.
template <typename T>
struct ElementwiseOperands {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;

  const T* residual = nullptr;
  const T* multiplier = nullptr;
  Activation activation = Activation::None;
  acc_t slope = 0;
  // Backward outputs (null: not requested).
  T* grad_residual = nullptr;
  T* grad_multiplier = nullptr;

  ElementwiseOperands() = default;
  ElementwiseOperands(const Epilogue& ep, bool need_multiplier_grad = false)
      : residual(ep.residual.defined() ? ep.residual.data_ptr<T>() : nullptr),
        multiplier(ep.multiplier.defined() ? ep.multiplier.data_ptr<T>() : nullptr),
        activation(ep.activation),
        slope(static_cast<acc_t>(ep.negative_slope)),
        needs_p_(ep.activation != Activation::None || need_multiplier_grad) {}

  // Whether dp differs from dz or gradients are written per element. (grad_multiplier without a
  // multiplier is the gradient at multiplier = 1; grad_residual without a residual is dp.)
  bool active() const {
    return residual || multiplier || activation != Activation::None || grad_residual || grad_multiplier;
  }

  // out[i] = act(v[i] + residual[off + i]) * multiplier[off + i] for i < len.
  void forward_run(const acc_t* v, T* out, int64_t off, int64_t len) const {
    forward_each(out, off, len, [v](int64_t i, int64_t count) { return Vec::loadu(v + i, count); });
  }

  // The same with v's vector at i made by source(i, count), in the epilogue's loop: for a source
  // cheap enough to inline into each activation's loop, no buffer in between.
  template <typename Source>
  void forward_each(T* out, int64_t off, int64_t len, Source source) const {
    // As backward_run: the loop reads only forward_loop's locals.
    const T* const r = residual ? residual + off : nullptr;
    const T* const m = multiplier ? multiplier + off : nullptr;
    dispatch_activation(activation, [&](auto tag) {
      forward_loop<decltype(tag)::value>(out, len, source, r, m, m != nullptr && m == r, slope);
    });
  }

  template <Activation A, typename Source>
  FUSEDNORM_FLATTEN static void forward_loop(T* out, int64_t len, Source source, const T* residual,
      const T* multiplier, bool multiplier_is_residual, acc_t slope) {
    const auto step = [&](int64_t i, int64_t count) {
      Vec z = source(i, count);
      Vec r(acc_t(0));
      if (residual) {
        r = IO::load(residual + i, count);
        z = z + r;
      }
      z = vec_activation<A>(z, slope);
      if (multiplier) z = z * (multiplier_is_residual ? r : IO::load(multiplier + i, count));
      IO::store(out + i, z, count);
    };
    IO::for_each_vector(len, step);
  }

  // Sums over runs, in vector lanes: dp, dp * (x - centre) and x - centre (lanes past a run's end
  // add nothing).
  struct RunSums {
    Vec dp = Vec(0), dp_xc = Vec(0), xc = Vec(0);
  };

  // dp[i] for i < len, the gradient at the pre-activation p = (x - centre) * pa + pc + residual of
  // element off + i, from dz; also grad_residual (= dp) and grad_multiplier (= dz * act(p)) there
  // when `write` and requested (their sum into grad_residual when the two are one buffer). dz and
  // x point at element off. The coefficients are one value for the run, or (PerLane) one per
  // element of it. With `sums` (one centre for the run), dp's sums are added there in the same
  // pass, as a loop over x and the stored dp would add them.
  template <bool PerLane, bool WithSums = false>
  void backward_run(const T* dz, const T* x, int64_t off, int64_t len, const acc_t* centre,
      const acc_t* pa, const acc_t* pc, acc_t* dp, bool write, RunSums* sums = nullptr) const {
    static_assert(!(PerLane && WithSums), "the sums take one centre for the run");
    // The loop reads only backward_loop's locals, copied from here: a vector store may alias any
    // memory (ATen's stores go through may_alias types), so members and captured references were
    // reloaded after each one, through pointers, and the tests of the operands stayed in the loop.
    // The fused ReLU backward of (8, 320, 32, 32) float32 took 1.5-1.8x the plain one, 1.1-1.4x
    // since (one thread; docs/design.md, 'CPU kernels').
    RunArgs r;
    r.dz = dz;
    r.x = x;
    r.residual = residual ? residual + off : nullptr;
    r.multiplier = multiplier ? multiplier + off : nullptr;
    r.grad_residual = write && grad_residual ? grad_residual + off : nullptr;
    r.grad_multiplier = write && grad_multiplier ? grad_multiplier + off : nullptr;
    r.grads_in_one = grad_multiplier != nullptr && grad_multiplier == grad_residual;
    r.centre = centre;
    r.pa = pa;
    r.pc = pc;
    r.dp = dp;
    r.slope = slope;
    r.needs_p = needs_p_;
    dispatch_activation(activation, [&](auto tag) {
      constexpr Activation A = decltype(tag)::value;
      const RunSums s = backward_loop<A, PerLane, WithSums>(r, len);
      if constexpr (WithSums) {
        sums->dp += s.dp;
        sums->dp_xc += s.dp_xc;
        sums->xc += s.xc;
      }
    });
  }

 private:
  // backward_run's operands, offset to the run's first element.
  struct RunArgs {
    const T *dz, *x, *residual, *multiplier;
    T *grad_residual, *grad_multiplier;  // null: not written
    bool grads_in_one, needs_p;
    const acc_t *centre, *pa, *pc;
    acc_t* dp;
    acc_t slope;
  };

  // The loop of backward_run; returns the run's sums (zero without WithSums).
  template <Activation A, bool PerLane, bool WithSums>
  FUSEDNORM_FLATTEN static RunSums backward_loop(const RunArgs r, int64_t len) {
    RunSums sums;
    // One coefficient for the run (PerLane: one an element, loaded in the loop).
    const Vec centre1 = PerLane ? Vec(0) : Vec(*r.centre);
    const Vec pa1 = PerLane ? Vec(0) : Vec(*r.pa);
    const Vec pc1 = PerLane ? Vec(0) : Vec(*r.pc);
    const auto step = [&](int64_t i, int64_t count) {
      const Vec dzv = IO::load(r.dz + i, count);
      Vec g = dzv;
      Vec grad_m(acc_t(0));
      const auto coef = [&](const acc_t* c, const Vec& one) { return PerLane ? Vec::loadu(c + i, count) : one; };
      Vec xc(acc_t(0));
      // ReLU's gradient is a select, as eager's threshold_backward: 0 where p <= 0 whatever
      // dz * multiplier is (a NaN or inf there would otherwise reach the group sums as NaN).
      Vec relu_inactive(acc_t(0));
      if (r.needs_p || WithSums) xc = IO::load(r.x + i, count) - coef(r.centre, centre1);
      if (r.needs_p) {
        Vec p = at::vec::fmadd(xc, coef(r.pa, pa1), coef(r.pc, pc1));
        if (r.residual) p = p + IO::load(r.residual + i, count);
        if (r.grad_multiplier) {
          grad_m = dzv * vec_activation<A>(p, r.slope);
          if (!r.grads_in_one) IO::store(r.grad_multiplier + i, grad_m, count);
        }
        if constexpr (A == Activation::ReLU) {
          relu_inactive = p <= Vec(acc_t(0));
        } else if constexpr (A != Activation::None) {
          g = g * vec_activation_derivative<A>(p, r.slope);
        }
      }
      if (r.multiplier) g = g * IO::load(r.multiplier + i, count);
      if constexpr (A == Activation::ReLU) g = Vec::blendv(g, Vec(acc_t(0)), relu_inactive);
      if (r.grad_residual) IO::store(r.grad_residual + i, r.grads_in_one ? g + grad_m : g, count);
      g.store(r.dp + i, count);
      if constexpr (WithSums) {
        // Padding lanes add nothing (dp as stored and reloaded: zero).
        xc = first_lanes(xc, count);
        g = first_lanes(g, count);
        sums.dp += g;
        sums.dp_xc = at::vec::fmadd(g, xc, sums.dp_xc);
        sums.xc += xc;
      }
    };
    IO::for_each_vector(len, step);
    return sums;
  }

  bool needs_p_ = false;
};

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
