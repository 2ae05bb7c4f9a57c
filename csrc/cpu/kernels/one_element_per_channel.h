// The CPU backward's path for inputs of one element per channel (S == 1), where the general
// path's per-(n, c) sums would be the elements themselves.
#pragma once

#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/EmptyTensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "cpu/kernels/affine_params.h"
#include "cpu/kernels/backward_sums.h"
#include "cpu/kernels/elementwise_operands.h"
#include "cpu/kernels/vec_io.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
// Internal linkage, as in one translation unit: GCC inlines these as before (where FMAs are
// contracted depends on it, and with it the results' bits; docs/design.md, 'CPU capabilities').
namespace {

// S == 1: each group (n, g) is one contiguous run of D channels of one element each (both layouts
// are the same memory). The per-(n, c) sums of the general path would be the elements themselves,
// materialised three times over in double (slow: page faults on hundreds of MB for a (1024, 8192)
// input), so this path keeps per-group sums only (phase 1, parallel over groups) and sums the
// parameter gradients per channel over the batch (phase 2, parallel over blocks of channels, the
// batch in order: deterministic). Both phases work in vectors of opmath values: phase 1 sums runs of
// at most kBlock elements in vector lanes before moving to double (as reduce_row), phase 2 sums the
// parameter gradients of kSampleBlock samples per channel in opmath before adding them to double
// totals. The batch goes through both phases a block of samples at a time (a multiple of
// kSampleBlock, ~kDpBlockElements elements; at most the input's size). With an elementwise
// epilogue phase 1 keeps the block's dp for phase 2 instead of making it again (the residual's
// and multiplier's loads, the activation); without one dp is dy, read in place by both phases.
// The results are bit for bit those of making dp twice; problem 3's tail backward (256, 8192)
// took 4-15% less time on the 2-core development machine, in interleaved runs. Where nothing is
// summed over the batch (no grad_weight or grad_bias: problem 3's tail), each group's phase 2
// follows its phase 1 at once instead, while the group's x and dp are in cache: the same
// arithmetic (the same bits), one pass over memory instead of two (the tail's fused backward
// 1.7-1.9 -> 1.3-1.5 ms, the plain one 0.9-1.0 -> 0.7-0.8 on that machine).
constexpr int64_t kSampleBlock = 64;
constexpr int64_t kDpBlockElements = 1 << 20;

template <typename T>
void backward_one_element_per_channel(const T* dy, const T* x, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w, const std::vector<at::opmath_type<T>>& b,
    const Modulation<at::opmath_type<T>>& mod, bool uniform, const at::opmath_type<T>* mean,
    const at::opmath_type<T>* rstd, const ElementwiseOperands<T>& ep, T* dx, FusedGrads& grads) {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  const int64_t C = sh.C, D = sh.D, G = sh.G;
  const double M = static_cast<double>(D);

  // Phase 1's per-element coefficients of elements [c0, c0 + len) of sample n (len <= kBlock) and,
  // with an elementwise epilogue, dp into dp_out (len values). Without one dp is dy, read in place
  // by both phases (a copy of it cost a write and a read of the input's size).
  struct Run {
    std::vector<acc_t> centre, pa, pc, w_eff, r;
    Run() {
      for (auto* v : {&centre, &pa, &pc, &w_eff, &r}) v->resize(kBlock);
    }
    void fill(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t n, int64_t c0,
        int64_t len, const GroupNormShape& sh, const std::vector<acc_t>& w,
        const std::vector<acc_t>& b, const Modulation<acc_t>& mod, const acc_t* mean,
        const acc_t* rstd, acc_t* dp_out) {
      // The group's statistics: phase 1 walks group by group, so the block lies in one group.
      // rstd only for p's coefficients.
      const int64_t ng = n * sh.G + c0 / sh.D;
      std::fill(centre.begin(), centre.begin() + len, mean[ng]);
      if (ep.active()) std::fill(r.begin(), r.begin() + len, rstd[ng]);
      const int64_t nc0 = n * sh.C + c0;
      for (int64_t i = 0; i < len; i += IO::kSize) {
        const int64_t count = std::min<int64_t>(IO::kSize, len - i);
        const Vec gv = mod.gain.empty() ? Vec(1) : Vec::loadu(&mod.gain[nc0 + i], count);
        const Vec we = Vec::loadu(&w[c0 + i], count) * gv;
        we.store(&w_eff[i], count);
        if (ep.active()) {  // p's coefficients, for dp
          (we * Vec::loadu(&r[i], count)).store(&pa[i], count);
          const Vec sv = mod.shift.empty() ? Vec(0) : Vec::loadu(&mod.shift[nc0 + i], count);
          at::vec::fmadd(Vec::loadu(&b[c0 + i], count), gv, sv).store(&pc[i], count);
        }
      }
      if (ep.active()) {
        const int64_t o = n * sh.C + c0;
        ep.template backward_run<true>(dy + o, x + o, o, len, centre.data(), pa.data(), pc.data(), dp_out, /*write=*/true);
      }
    }
  };
  // Lanes past `count` load as zeros (coefficients and dp), so they add nothing below.
  auto lanes = [](const std::vector<acc_t>& v, int64_t i, int64_t count) { return Vec::loadu(v.data() + i, count); };

  std::vector<double> A(sh.N * G), B(sh.N * G), delta(sh.N * G);
  std::vector<acc_t> K1(sh.N * G), K2(sh.N * G);
  std::vector<double> dw(C, 0.0), dbias(C, 0.0);
  // Phase 2's per-channel sums only where grad_weight or grad_bias is wanted (not in problem 3's
  // tail, which has neither parameter).
  const bool want_params = grads.weight.numel() > 0 || grads.bias.numel() > 0;
  // grad_scale / grad_shift are written in acc_t, then converted to their dtypes (the scale's and
  // shift's) where those differ.
  const auto acc_opts = grads.scale.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  auto acc_buffer = [&](const at::Tensor& out) {
    return out.numel() == 0 || out.scalar_type() == acc_opts.dtype() ? out : at::Tensor(at::detail::empty_cpu(out.sizes(), acc_opts));
  };
  at::Tensor dscale_acc = acc_buffer(grads.scale), dshift_acc = acc_buffer(grads.shift);
  acc_t* dscale = grads.scale.numel() > 0 ? dscale_acc.data_ptr<acc_t>() : nullptr;
  acc_t* dshift = grads.shift.numel() > 0 ? dshift_acc.data_ptr<acc_t>() : nullptr;

  // `count` values of dp at element o: entry i of dp_group (the group's dp, with an epilogue), or
  // dy's without one (dp_group unused).
  auto dp_lanes = [&](const acc_t* dp_group, int64_t i, int64_t o, int64_t count) {
    return ep.active() ? Vec::loadu(dp_group + i, count) : IO::load(dy + o, count);
  };

  // Phase 1 of group ng: A = sum w_eff * dp, B = sum w_eff * dp * (x - m), delta = mean(x - m),
  // and K1, K2 (dx = w_eff * rstd * dp + K1 * (x - m) + K2); with an epilogue, the group's D
  // values of dp into dp_group.
  auto group_sums = [&](int64_t ng, Run& run, acc_t* dp_group) {
    const int64_t n = ng / G, g = ng % G;
    double a = 0, bsum = 0, dev = 0;
    for (int64_t start = 0; start < D; start += kBlock) {
      const int64_t len = std::min(kBlock, D - start), c0 = g * D + start;
      const int64_t o = n * C + c0;
      const acc_t centre = mean[ng];  // the block lies in one group
      acc_t* dp_out = ep.active() ? dp_group + start : nullptr;
      Vec va(0), vb(0), vdev(0);
      if (uniform && ep.active()) {
        // w_eff = 1, pa = rstd, pc = 0 for every channel: dp from the group's values as
        // broadcasts, with no per-element arrays (the arrays' values exactly: the same bits), and
        // its sums in the same pass.
        const acc_t pa = rstd[ng], pc = 0;
        typename ElementwiseOperands<T>::RunSums rs;
        ep.template backward_run<false, true>(dy + o, x + o, o, len, &centre, &pa, &pc, dp_out, true, &rs);
        va = rs.dp;
        vb = rs.dp_xc;
        vdev = rs.xc;
      } else {
        if (!uniform) run.fill(ep, dy, x, n, c0, len, sh, w, b, mod, mean, rstd, dp_out);
        const Vec cv(centre);
        for (int64_t i = 0; i < len; i += IO::kSize) {
          const int64_t count = std::min<int64_t>(IO::kSize, len - i);
          const Vec xc = first_lanes(IO::load(x + o + i, count) - cv, count);  // padding lanes add nothing
          const Vec dp = dp_lanes(dp_group, start + i, o + i, count);
          const Vec wdp = uniform ? dp : lanes(run.w_eff, i, count) * dp;
          va += wdp;
          vb = at::vec::fmadd(wdp, xc, vb);
          vdev += xc;
        }
      }
      a += horizontal_sum(va);
      bsum += horizontal_sum(vb);
      dev += horizontal_sum(vdev);
    }
    delta[ng] = M > 0 ? dev / M : 0.0;
    A[ng] = a;
    B[ng] = bsum - delta[ng] * a;
    const double r = rstd[ng];
    const double b1 = -r * r * r / M * B[ng];
    K1[ng] = static_cast<acc_t>(b1);
    K2[ng] = static_cast<acc_t>(-r / M * A[ng] - b1 * delta[ng]);
  };

  // Phase 2 for channels [c0, c1) of group g of sample n: dx, grad_scale, grad_shift, and with
  // pw / pb (indexed from c0) the parameter gradients' sums. The group's statistics and K1, K2,
  // delta are vectors of one value: made element by element into arrays (with the per-channel
  // coefficients, as phase 1 makes them), they took most of this phase.
  auto channel_outputs = [&](int64_t n, int64_t g, int64_t c0, int64_t c1, const acc_t* dp_group, acc_t* pw,
                             acc_t* pb) {
    const int64_t ng = n * G + g;
    const Vec centre(mean[ng]), r(rstd[ng]), k1(K1[ng]), k2(K2[ng]), delta_g(static_cast<acc_t>(delta[ng]));
    for (int64_t c = c0; c < c1; c += IO::kSize) {
      const int64_t count = std::min<int64_t>(IO::kSize, c1 - c), o = n * C + c;
      // Lanes past `count` hold garbage from the broadcasts but are never stored, and dp loads as
      // zero there.
      const Vec gain = mod.gain.empty() ? Vec(1) : Vec::loadu(&mod.gain[o], count);
      const Vec xc = IO::load(x + o, count) - centre;
      const Vec dp = dp_lanes(dp_group, c - g * D, o, count);
      // sum_s dp * xhat for this (n, c): dp * ((x - m) - delta) * rstd.
      const Vec xhat_sum = dp * (xc - delta_g) * r;
      if (want_params) {
        const int64_t p = c - c0;
        at::vec::fmadd(gain, xhat_sum, Vec::loadu(pw + p, count)).store(pw + p, count);
        at::vec::fmadd(gain, dp, Vec::loadu(pb + p, count)).store(pb + p, count);
      }
      if (dscale) {
        const Vec ws = at::vec::fmadd(Vec::loadu(w.data() + c, count), xhat_sum,
            Vec::loadu(b.data() + c, count) * dp);
        ws.store(dscale + o, count);
      }
      if (dshift) dp.store(dshift + o, count);
      if (dx != nullptr) {
        const Vec pa = Vec::loadu(w.data() + c, count) * gain * r;  // w_eff * rstd
        IO::store(dx + o, at::vec::fmadd(pa, dp, at::vec::fmadd(k1, xc, k2)), count);
      }
    }
  };

  const int64_t group_grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1));
  if (!want_params && D <= kDpBlockElements && sh.N * G >= at::get_num_threads()) {
    // No sums over the batch: each group's phase 2 follows its phase 1 at once, while its x and dp
    // are in cache, so that x, dy and the operands cross memory once (problem 3's tail).
    at::parallel_for(0, sh.N * G, group_grain, [&](int64_t begin, int64_t end) {
      Run run;
      std::vector<acc_t> dp_group(ep.active() ? D : 0);
      for (int64_t ng = begin; ng < end; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        group_sums(ng, run, dp_group.data());
        channel_outputs(n, g, g * D, (g + 1) * D, dp_group.data(), nullptr, nullptr);
      }
    });
  } else {
    // Samples per block, a multiple of kSampleBlock (phase 2 adds its opmath sums to the double
    // totals every kSampleBlock samples, in order), and the block's dp (with an epilogue).
    const int64_t block = kSampleBlock * std::max<int64_t>(1, kDpBlockElements / (kSampleBlock * std::max<int64_t>(C, 1)));
    std::vector<acc_t> dp_block(ep.active() ? std::min(block, sh.N) * C : 0);
    for (int64_t n0 = 0; n0 < sh.N; n0 += block) {
      const int64_t n1 = std::min(sh.N, n0 + block);
      // The dp of group g of sample n, within the block (with an epilogue).
      auto dp_of = [&](int64_t n, int64_t g) { return ep.active() ? dp_block.data() + (n - n0) * C + g * D : nullptr; };
      at::parallel_for(n0 * G, n1 * G, group_grain, [&](int64_t begin, int64_t end) {
        Run run;
        for (int64_t ng = begin; ng < end; ++ng) group_sums(ng, run, dp_of(ng / G, ng % G));
      });
      // Phase 2, parallel over channels, the block's samples in order: the parameter gradients
      // summed over the batch per channel, deterministically.
      at::parallel_for(0, C, 512, [&](int64_t cbegin, int64_t cend) {
        // This thread's channels' parameter-gradient sums over the current block of samples.
        std::vector<acc_t> pw(want_params ? cend - cbegin : 0, acc_t(0)), pb(want_params ? cend - cbegin : 0, acc_t(0));
        for (int64_t n = n0; n < n1; ++n) {
          // Runs of channels of one group.
          for (int64_t c0 = cbegin, g = cbegin / D; c0 < cend; c0 = std::min(cend, (++g) * D)) {
            const int64_t c1 = std::min(cend, (g + 1) * D);
            acc_t* pw_c0 = want_params ? pw.data() + (c0 - cbegin) : nullptr;
            acc_t* pb_c0 = want_params ? pb.data() + (c0 - cbegin) : nullptr;
            channel_outputs(n, g, c0, c1, dp_of(n, g), pw_c0, pb_c0);
          }
          if (want_params && ((n + 1) % kSampleBlock == 0 || n + 1 == sh.N)) {
            for (int64_t c = cbegin; c < cend; ++c) {
              dw[c] += pw[c - cbegin];
              dbias[c] += pb[c - cbegin];
            }
            std::fill(pw.begin(), pw.end(), acc_t(0));
            std::fill(pb.begin(), pb.end(), acc_t(0));
          }
        }
      });
    }
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  if (grads.weight.numel() > 0) grads.weight.copy_(at::from_blob(dw.data(), {C}, f64));
  if (grads.bias.numel() > 0) grads.bias.copy_(at::from_blob(dbias.data(), {C}, f64));
  if (!dscale_acc.is_same(grads.scale)) grads.scale.copy_(dscale_acc);
  if (!dshift_acc.is_same(grads.shift)) grads.shift.copy_(dshift_acc);
}

}  // namespace
}  // namespace fusednorm::cpu::CPU_CAPABILITY
