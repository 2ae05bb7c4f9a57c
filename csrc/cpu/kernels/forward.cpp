// The CPU forward of group_norm_forward and fused_group_norm_forward (the plain op is the fused
// one with an empty epilogue), compiled once per CPU capability (docs/design.md, 'CPU
// capabilities').
//
// Two layouts are handled in place (see Layout in group_norm.h):
//   ChannelsFirst: group (n, g) is one contiguous run of D * S elements, D rows of S.
//   ChannelsLast:  sample n is S rows of C channels; group g is a slice of D channels of each row.
// Statistics take one pass over memory: each block of a group small enough to stay in cache is
// reduced exactly in two passes (mean, then squared deviations from it) in vector lanes of opmath
// (float, or double for double), and the blocks' (count, mean, M2) are merged in double with Chan's
// formula. Neither a large offset nor a huge group loses precision, and there is no
// E[x^2] - E[x]^2 (docs/design.md, 'Numerics').
//
// Results do not depend on the number of threads: every partial sum covers a range fixed by the
// shape alone and partials are combined in a fixed order (docs/design.md, 'Determinism').
#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <array>
#include <limits>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/kernels/affine_params.h"
#include "cpu/kernels/channels_last.h"
#include "cpu/kernels/elementwise_operands.h"
#include "cpu/kernels/uninit_vector.h"
#include "cpu/kernels/vec_io.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
namespace {

// Count, mean and sum of squared deviations of a set of values; merge() is Chan's formula.
struct Moments {
  double n = 0, mean = 0, m2 = 0;
  void merge(const Moments& o) {
    if (o.n == 0) return;
    const double total = n + o.n, delta = o.mean - mean;
    mean += delta * (o.n / total);
    m2 += o.m2 + delta * delta * (n * o.n / total);
    n = total;
  }
};

// A mean split into two opmath values, hi + lo. x - hi is exact for x near the mean (Sterbenz),
// so (x - hi) - lo centres x to within one rounding even when |mean| >> std, which a mean rounded
// to float32 alone would not (1e4 + randn loses ~5e-4 that way).
template <typename acc_t>
struct SplitMean {
  acc_t hi, lo;
  explicit SplitMean(double mean = 0)
      : hi(static_cast<acc_t>(mean)), lo(static_cast<acc_t>(mean - static_cast<double>(hi))) {}
};

// Moments of a contiguous run of at most kBlock elements (cache-resident for its second read).
template <typename T>
Moments block_moments(const T* x, int64_t len) {
  using Vec = typename VecIO<T>::Vec;
  using acc_t = at::opmath_type<T>;
  if (len == 0) return {};
  // Summing x - x[0] keeps the float lanes small when |mean| >> std. Padding lanes past `count`
  // load as zeros and are masked out.
  const acc_t first = static_cast<acc_t>(x[0]);
  const double shifted = reduce_row<1>(x, static_cast<const T*>(nullptr), len,
      [first](auto& acc, const Vec& xv, const Vec&, int64_t count) {
        const Vec d = xv - Vec(first);
        acc[0] += first_lanes(d, count);
      })[0];
  const double mean = first + shifted / len;
  const SplitMean<acc_t> m(mean);
  // sum((x - hi) - lo)^2 = sum(x - hi)^2 - len * lo^2, as sum(x - hi) = len * lo.
  const double m2 = reduce_row<1>(x, static_cast<const T*>(nullptr), len,
      [m](auto& acc, const Vec& xv, const Vec&, int64_t count) {
        const Vec d = xv - Vec(m.hi);
        acc[0] += first_lanes(d * d, count);
      })[0];
  return {static_cast<double>(len), mean, std::max(m2 - len * double(m.lo) * m.lo, 0.0)};
}

// The output uses the statistics at opmath precision, not their saved rounding.
double rstd_of(const Moments& m, double eps) {
  const double var = m.n > 0 ? std::max(m.m2 / m.n, 0.0) : 0.0;
  // An infinite M2 of finite values: the float lanes overflowed on the squared deviations
  // (|x - mean| above ~1.8e19 in float32 or bfloat16). No variance is known, and rstd = 0 would
  // make the output all zeros: NaN instead, as eager gives (docs/deviations.md).
  if (std::isinf(var)) return std::numeric_limits<double>::quiet_NaN();
  return 1.0 / std::sqrt(var + eps);
}

// out = epilogue(f(x)) over a contiguous run of n elements at element offset `off`: f's affine
// values go through a cache-resident opmath buffer (no rounding to T in between), then the
// epilogue's loop (one per activation) writes out. f(xv, _, i) takes the index within the run.
template <typename T, typename F>
void map_through_buffer(const T* x, T* out, int64_t off, int64_t n, F f, const ElementwiseOperands<T>& ep) {
  using IO = VecIO<T>;
  using acc_t = at::opmath_type<T>;
  static_assert(kBlock % IO::kSize == 0, "buf holds whole vectors");
  acc_t buf[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    for (int64_t i = 0; i < len; i += IO::kSize) {
      const int64_t count = std::min<int64_t>(IO::kSize, len - i);
#if FUSEDNORM_GENERIC_VECTORS
      // Whole vectors into buf (it holds whole vectors; forward_run reads len values): a store
      // of a run-time count is a memcpy call there (vec_io.h).
      f(IO::load(x + start + i, count), typename IO::Vec(0), start + i).store(buf + i);
#else
      f(IO::load(x + start + i, count), typename IO::Vec(0), start + i).store(buf + i, count);
#endif
    }
    ep.forward_run(buf, out + start, off + start, len);
  }
}

// The output rows of ChannelsFirst group g of sample n without an epilogue, in one flattened loop:
// through a call of map_row a row, a row of a few vectors (8x8 feature maps) paid the call and
// its loop's set-up (docs/design.md, "CPU kernels").
template <typename T>
FUSEDNORM_FLATTEN void group_rows_output(const T* xg, T* yg, const GroupNormShape& sh, int64_t n, int64_t g,
    double rstd, const SplitMean<at::opmath_type<T>>& m, const std::vector<at::opmath_type<T>>& w,
    const std::vector<at::opmath_type<T>>& b, const Modulation<at::opmath_type<T>>& mod) {
  using acc_t = at::opmath_type<T>;
  using Vec = typename VecIO<T>::Vec;
  for (int64_t d = 0; d < sh.D; ++d) {
    const int64_t c = g * sh.D + d;
    const acc_t gain = mod.gain_at(n * sh.C + c);
    const acc_t scale = static_cast<acc_t>(rstd) * w[c] * gain;
    const Vec scale_v(scale), hi(m.hi), shift(folded_shift(b[c], gain, mod.shift_at(n * sh.C + c), m.lo, scale));
    map_row(xg + d * sh.S, static_cast<const T*>(nullptr), yg + d * sh.S, sh.S,
        [&](const Vec& xv, const Vec&, int64_t) { return at::vec::fmadd(xv - hi, scale_v, shift); });
  }
}

// per_channel_params: a weight or bias was given (w and b are 1 and 0 otherwise).
template <typename T>
void forward_channels_first(
    const T* x, T* y, const GroupNormShape& sh, const std::vector<at::opmath_type<T>>& w,
    const std::vector<at::opmath_type<T>>& b, bool per_channel_params, double eps,
    const Modulation<at::opmath_type<T>>& mod, const ElementwiseOperands<T>& ep, at::opmath_type<T>* mean_out,
    at::opmath_type<T>* rstd_out) {
  using acc_t = at::opmath_type<T>;
  using Vec = typename VecIO<T>::Vec;
  const int64_t M = sh.D * sh.S;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(M, 1));
  // Small groups go in batches: the batch's statistics first, then its outputs. A small group's
  // moments, square root and division are one long chain of dependent operations, which the core
  // overlaps across the groups of a batch but not across a group's output loop in between. A
  // batch stays within kStatsBatchBytes (in L1 for its second read); a group of that size or
  // more is a batch of one, read a second time from L2 as before.
  constexpr int64_t kStatsBatchBytes = 8192, kMaxStatsBatch = 64;
  const int64_t batch = std::max<int64_t>(1,
      std::min<int64_t>(kMaxStatsBatch, kStatsBatchBytes / std::max<int64_t>(M * int64_t(sizeof(T)), 1)));
  at::parallel_for(0, sh.N * sh.G, grain, [&](int64_t begin, int64_t end) {
    double batch_mean[kMaxStatsBatch], batch_rstd[kMaxStatsBatch];
    for (int64_t b0 = begin; b0 < end; b0 += batch) {
      const int64_t b1 = std::min(end, b0 + batch);
      for (int64_t ng = b0; ng < b1; ++ng) {
        const T* xg = x + ng * M;
        Moments stats;
        for (int64_t start = 0; start < M; start += kBlock) {
          stats.merge(block_moments(xg + start, std::min(kBlock, M - start)));
        }
        const double rstd = rstd_of(stats, eps);
        mean_out[ng] = static_cast<acc_t>(stats.mean);
        rstd_out[ng] = static_cast<acc_t>(rstd);
        batch_mean[ng - b0] = stats.mean;
        batch_rstd[ng - b0] = rstd;
      }
      for (int64_t ng = b0; ng < b1; ++ng) {
        const T* xg = x + ng * M;
        const double rstd = batch_rstd[ng - b0];
        const SplitMean<acc_t> m(batch_mean[ng - b0]);
        const int64_t g = ng % sh.G;
        const int64_t n = ng / sh.G;
        if (sh.S == 1) {
          // One element per channel: the group is one run of D channels, each with its own
          // coefficients (computed as below, in the same order).
          const acc_t* wg = w.data() + g * sh.D;
          const acc_t* bg = b.data() + g * sh.D;
          const acc_t* gain = mod.gain.empty() ? nullptr : mod.gain.data() + n * sh.C + g * sh.D;
          const acc_t* tshift = mod.shift.empty() ? nullptr : mod.shift.data() + n * sh.C + g * sh.D;
          const Vec rs(static_cast<acc_t>(rstd)), hi(m.hi), lo(m.lo);
          if (!per_channel_params && !gain && !tshift) {
            // No coefficient per channel (problem 3's tail): one pair for the row, the values the
            // general loop makes from weight 1 and bias 0, and the epilogue in the same loop.
            const Vec shift = Vec(acc_t(0)) - lo * rs;
            auto affine = [&](const Vec& xv) { return at::vec::fmadd(xv - hi, rs, shift); };
            if (!ep.active()) {
              map_row(xg, static_cast<const T*>(nullptr), y + ng * M, sh.D,
                  [&](const Vec& xv, const Vec&, int64_t) { return affine(xv); });
            } else {
              ep.forward_each(y + ng * M, ng * M, sh.D,
                  [&](int64_t i, int64_t count) { return affine(VecIO<T>::load(xg + i, count)); });
            }
            continue;
          }
          auto affine = [&](const Vec& xv, const Vec&, int64_t i) {
            const int64_t count = std::min<int64_t>(Vec::size(), sh.D - i);
            Vec scale = rs * Vec::loadu(wg + i, count);
            Vec shift = Vec::loadu(bg + i, count);
            Vec lo_v = lo;
            if (gain) {  // lane by lane as folded_shift
              const Vec gv = Vec::loadu(gain + i, count);
              scale = scale * gv;
              shift = Vec::blendv(shift * gv, shift, shift == Vec(acc_t(0)));
              lo_v = Vec::blendv(lo, Vec(acc_t(0)), gv.abs() == Vec(std::numeric_limits<acc_t>::infinity()));
            }
            if (tshift) shift = shift + Vec::loadu(tshift + i, count);
            return at::vec::fmadd(xv - hi, scale, shift - lo_v * scale);
          };
          if (!ep.active()) {
            map_row(xg, static_cast<const T*>(nullptr), y + ng * M, sh.D, affine);
          } else {
            map_through_buffer(xg, y + ng * M, ng * M, sh.D, affine, ep);
          }
          continue;
        }
        if (!ep.active()) {
          group_rows_output(xg, y + ng * M, sh, n, g, rstd, m, w, b, mod);
          continue;
        }
        for (int64_t d = 0; d < sh.D; ++d) {
          const int64_t c = g * sh.D + d;
          const int64_t row = ng * M + d * sh.S;
          const acc_t gain = mod.gain_at(n * sh.C + c);
          const acc_t scale = static_cast<acc_t>(rstd) * w[c] * gain;
          const Vec scale_v(scale), hi(m.hi), shift(folded_shift(b[c], gain, mod.shift_at(n * sh.C + c), m.lo, scale));
          auto affine = [&](const Vec& xv, const Vec&, int64_t) { return at::vec::fmadd(xv - hi, scale_v, shift); };
          map_through_buffer(xg + d * sh.S, y + row, row, sh.S, affine, ep);
        }
      }
    }
  });
}

// Moments of every group over one chunk of rows of a channels-last sample. Per block of channels,
// one pass down the rows sums d = x - K and d^2 for each channel, K the mean of its first rows
// (lanes of opmath, added into double every kLaneRows rows), and M2 = sum d^2 - (sum d)^2 / rows.
// Where that lost its digits (M2 under an eighth of sum d^2: K far from the channel's mean; at
// most 3 bits lost above that), a second pass takes the block's squared deviations from the mean
// exactly, as the GPU's team and sweep moments do (docs/design.md, "Shifted moments and Chan
// merges"). The channels are then merged into their groups with Chan's formula in double.
template <typename T>
void chunk_moments(const T* xn, int64_t r0, int64_t r1, const GroupNormShape& sh, Moments* out) {
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  using acc_t = typename IO::acc_t;
  constexpr int64_t kSize = IO::kSize;
  const int64_t C = sh.C, rows = r1 - r0;
  // Each channel's mean and M2 (all count `rows` values), as arrays that block_moments writes a
  // vector at a time: at a few rows a chunk, per-channel scalar work cost as much as the rows'
  // sums (docs/design.md, "CPU kernels").
  thread_local std::vector<double> channel_buffer;
  channel_buffer.resize(2 * C);
  double* const channel_mean = channel_buffer.data();
  double* const channel_m2 = channel_mean + C;
  // The lane sums go from opmath to double every kLaneRows rows: a lane summing all of a chunk's
  // rows (up to kBlock values) rounds ~10x more than a ChannelsFirst lane, which sums
  // kBlock / (kUnroll * kSize) values; at |mean| >> std that was 10x the error (docs/design.md,
  // 'Numerics').
  constexpr int64_t kLaneRows = 64;
  // Writes the moments of the block's channels from their sums of d = x - center and d^2 (per
  // lane, in double) and says whether every channel's M2 kept its digits (not under an eighth of
  // its sum of d^2).
  const auto block_moments = [&](int64_t cb, const std::array<Vec, kChannelVecs>& center) {
    using DVec = at::vec::Vectorized<double>;
    using Wide = DoubleParts<acc_t>;
    constexpr int kParts = std::tuple_size_v<Wide>;
    std::array<Vec, kChannelVecs> s1, s2;
    // The lane sums in double, in registers (the first block of rows assigns them).
    std::array<Wide, kChannelVecs> s1_total, s2_total;
    for (int64_t rb = r0; rb < r1; rb += kLaneRows) {
      const int64_t re = std::min(r1, rb + kLaneRows);
      for_block_vectors(cb, C, kSize, [&](int64_t, int64_t, int u) { s1[u] = s2[u] = Vec(0); });
      for (int64_t r = rb; r < re; ++r) {
        for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
          const Vec d = IO::load(xn + r * C + c0, count) - center[u];
          s1[u] += d;
          s2[u] = at::vec::fmadd(d, d, s2[u]);
        });
      }
      for_block_vectors(cb, C, kSize, [&](int64_t, int64_t, int u) {
        const Wide a = widen_to_double(s1[u]), b = widen_to_double(s2[u]);
        for (int j = 0; j < kParts; ++j) {
          s1_total[u][j] = rb == r0 ? a[j] : s1_total[u][j] + a[j];
          s2_total[u][j] = rb == r0 ? b[j] : s2_total[u][j] + b[j];
        }
      });
    }
    // Every lane at once (those past `count` sum zeros and keep their digits), in double vectors.
    bool kept = true;
    const DVec n(static_cast<double>(rows)), eighth(0.125), zero(0.0);
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      const Wide k = widen_to_double(center[u]);
      DVec ok(1.0);
      double mean[kSize], m2[kSize];
      for (int j = 0; j < kParts; ++j) {
        const DVec t1 = s1_total[u][j], t2 = s2_total[u][j];
        const DVec offset = t1 / n;  // the channels' means less their centers
        const DVec d2 = t2 - t1 * offset;
        ok = ok * d2.ge(t2 * eighth);  // 1 where M2 kept its digits, 0 where not or NaN
        (k[j] + offset).store(mean + j * DVec::size());
        DVec::blendv(d2, zero, d2 < zero).store(m2 + j * DVec::size());  // std::max(d2, 0.0): NaN stays
      }
      kept = kept && ok.zero_mask() == 0;
      std::copy_n(mean, count, channel_mean + c0);
      std::copy_n(m2, count, channel_m2 + c0);
    });
    return kept;
  };
  // The shift: the mean of the chunk's first 2^k <= 8 rows (exact for a constant channel, so
  // that it keeps M2 = 0), which lies far enough from the channel's mean to need the second pass
  // far more rarely than one row: a row 2.65 standard deviations out (one channel in 120 of
  // Gaussian data) would send its whole block of up to 64 channels there.
  int64_t shift_rows = 1;
  while (shift_rows < 8 && 2 * shift_rows <= rows) shift_rows *= 2;
  const Vec shift_scale(acc_t(1) / static_cast<acc_t>(shift_rows));
  for (int64_t cb = 0; cb < C; cb += kChannelVecs * kSize) {
    std::array<Vec, kChannelVecs> shift;
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      Vec sum = IO::load(xn + r0 * C + c0, count);
      for (int64_t r = r0 + 1; r < r0 + shift_rows; ++r) sum += IO::load(xn + r * C + c0, count);
      shift[u] = sum * shift_scale;
    });
    if (block_moments(cb, shift)) continue;
    // The second pass, around each channel's mean from the first rounded to opmath, corrected by
    // the sum of d.
    std::array<Vec, kChannelVecs> mean;
    for_block_vectors(cb, C, kSize, [&](int64_t c0, int64_t count, int u) {
      acc_t m[kSize] = {};
      for (int64_t i = 0; i < count; ++i) m[i] = static_cast<acc_t>(channel_mean[c0 + i]);
      mean[u] = Vec::loadu(m);
    });
    block_moments(cb, mean);
  }
  // Every channel counts `rows` values: the group's mean is the channels' mean, and its M2 their
  // M2s plus rows times the squared deviations of their means (Chan's formula for equal counts,
  // without its per-merge divisions, which cost as much as the data at a few rows a chunk).
  for (int64_t g = 0; g < sh.G; ++g) {
    const double* const cm = channel_mean + g * sh.D;
    const double* const c2 = channel_m2 + g * sh.D;
    double mean = 0;
    for (int64_t d = 0; d < sh.D; ++d) mean += cm[d];
    mean /= sh.D;
    double m2 = 0, spread = 0;
    for (int64_t d = 0; d < sh.D; ++d) {
      const double dev = cm[d] - mean;
      m2 += c2[d];
      spread += dev * dev;
    }
    out[g] = Moments{static_cast<double>(rows * sh.D), mean, m2 + rows * spread};
  }
}

// The channels-last output map of a 16-bit output folds into y = x * scale + (shift - hi * scale)
// where the mean is at most kFoldMaxOffset standard deviations from zero and the coefficients are
// finite: the float32 rounding of x * scale against hi * scale, ~2^-24 of that offset in units of
// the output's scale, stays under 2^-15 of it, far below a 16-bit output's own rounding (ATen
// folds every channels-last map so), and the map costs one FMA and two coefficient loads a
// vector instead of a subtraction more and three (docs/design.md, "CPU kernels"). Float32
// outputs keep the shifted map.
template <typename T>
constexpr bool kFoldsOutputMap = sizeof(T) == 2;
constexpr double kFoldMaxOffset = 256;

template <typename T>
void forward_channels_last(
    const T* x, T* y, const GroupNormShape& sh, const std::vector<at::opmath_type<T>>& w,
    const std::vector<at::opmath_type<T>>& b, double eps, const Modulation<at::opmath_type<T>>& mod,
    const ElementwiseOperands<T>& ep, at::opmath_type<T>* mean_out, at::opmath_type<T>* rstd_out) {
  using acc_t = at::opmath_type<T>;
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C, chunks = num_chunks(sh);

  std::vector<Moments> partial(sh.N * chunks * sh.G);
  // The output map takes `run` rows at a time (rows_per_run), its per-channel coefficients
  // repeated as many times: run_len values a sample. Its coefficients' lanes are counted against
  // a whole run (a last, shorter run loads some it does not store), one constant as C was. At
  // most a sample's rows: the three arrays then hold at most three values an input element (as
  // they did with one row of coefficients a sample at S = 1), however many samples.
  const int64_t run = std::min(rows_per_run(C, Vec::size()), std::max<int64_t>(sh.S, 1)), run_len = run * C;
  // (Every element written by sample_coefficients before it is read: not zeroed, see UninitVector.)
  UninitVector<acc_t> mean_hi(sh.N * run_len), scale(sh.N * run_len), shift(sh.N * run_len);
  // Samples whose map folds into y = x * scale + shift (mean_hi unused), see output_chunk.
  std::vector<char> folded(sh.N, 0);

  // Sample n's statistics, merged in chunk order, then each group's copied per channel so that
  // the output pass is a vector loop over channels.
  auto sample_coefficients = [&](int64_t n) {
    bool fold = kFoldsOutputMap<T>;
    for (int64_t g = 0; g < sh.G; ++g) {
      Moments stats;
      for (int64_t k = 0; k < chunks; ++k) stats.merge(partial[(n * chunks + k) * sh.G + g]);
      const int64_t ng = n * sh.G + g;
      const double rstd = rstd_of(stats, eps);
      mean_out[ng] = static_cast<acc_t>(stats.mean);
      rstd_out[ng] = static_cast<acc_t>(rstd);
      const SplitMean<acc_t> m(stats.mean);
      for (int64_t c = g * sh.D; c < (g + 1) * sh.D; ++c) {
        const int64_t nc = n * C + c, i = n * run_len + c;
        const acc_t gain = mod.gain_at(nc);
        mean_hi[i] = m.hi;
        scale[i] = static_cast<acc_t>(rstd) * w[c] * gain;
        shift[i] = folded_shift(b[c], gain, mod.shift_at(nc), m.lo, scale[i]);
        fold = fold && std::abs(m.hi * rstd) <= kFoldMaxOffset && std::isfinite(scale[i]) && std::isfinite(shift[i]);
      }
    }
    const int64_t first = n * run_len;
    if (fold) {
      for (int64_t i = first; i < first + C; ++i) {
        shift[i] = static_cast<acc_t>(shift[i] - static_cast<double>(mean_hi[i]) * scale[i]);
      }
    }
    for (auto* a : {&mean_hi, &scale, &shift}) {
      for (int64_t r = 1; r < run; ++r) std::copy_n(a->data() + first, C, a->data() + first + r * C);
    }
    folded[n] = fold;
  };

  // y = (x - hi) * scale + (bias - lo * scale) over rows [r0, r1) of sample n, see SplitMean,
  // row by row (short rows a run of them at a time: rows_per_run): the loads and stores run along
  // memory, the coefficients (12 bytes a channel) come from L1. (Blocks of channels down the rows
  // with the coefficients in registers, as the moments take them, made strided loads and stores:
  // 1.5x ATen's time on (8, 320, 32, 32).)
  auto output_chunk = [&](int64_t n, int64_t r0, int64_t r1) {
    const acc_t* hi = mean_hi.data() + n * run_len;
    const acc_t* sc = scale.data() + n * run_len;
    const acc_t* sf = shift.data() + n * run_len;
    auto rows = [&](auto affine) {
      for (int64_t r = r0; r < r1; r += run) {
        const int64_t off = (n * sh.S + r) * C, len = std::min(run, r1 - r) * C;
        if (!ep.active()) {
          map_row(x + off, static_cast<const T*>(nullptr), y + off, len, affine);
        } else {
          map_through_buffer(x + off, y + off, off, len, affine, ep);
        }
      }
    };
    // The maps take the coefficients' pointers by value: by reference, each vector's store (a
    // may-alias intrinsic) made the compiler reload them from the closure (docs/design.md, "CPU
    // kernels").
    if (folded[n]) {
      rows([sc, sf, run_len](const Vec& xv, const Vec&, int64_t c0) {
        const int64_t count = std::min<int64_t>(Vec::size(), run_len - c0);
        return at::vec::fmadd(xv, Vec::loadu(sc + c0, count), Vec::loadu(sf + c0, count));
      });
    } else {
      rows([hi, sc, sf, run_len](const Vec& xv, const Vec&, int64_t c0) {
        const int64_t count = std::min<int64_t>(Vec::size(), run_len - c0);
        return at::vec::fmadd(xv - Vec::loadu(hi + c0, count), Vec::loadu(sc + c0, count), Vec::loadu(sf + c0, count));
      });
    }
  };

  if (sh.N >= at::get_num_threads()) {
    // A sample for every thread: each thread takes whole samples, statistics then output, so that
    // the output pass rereads x from cache. The same chunks and merge order as below: same bits.
    at::parallel_for(0, sh.N, grain_for(sh.S * C), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for_sample_chunks(sh, [&](int64_t k, int64_t r0, int64_t r1) {
          chunk_moments(x + n * sh.S * C, r0, r1, sh, &partial[(n * chunks + k) * sh.G]);
        });
        sample_coefficients(n);
        for_sample_chunks(sh, [&](int64_t, int64_t r0, int64_t r1) { output_chunk(n, r0, r1); });
      }
    });
    return;
  }
  for_each_chunk(sh, [&](int64_t n, int64_t k, int64_t r0, int64_t r1) {
    chunk_moments(x + n * sh.S * C, r0, r1, sh, &partial[(n * chunks + k) * sh.G]);
  });
  for (int64_t n = 0; n < sh.N; ++n) sample_coefficients(n);
  for_each_chunk(sh, [&](int64_t n, int64_t, int64_t r0, int64_t r1) { output_chunk(n, r0, r1); });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_forward(const at::Tensor& x,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const GroupNormShape& sh, Layout layout, const Epilogue& epilogue) {
  at::Tensor y = empty_in_layout(x, layout, x.scalar_type());
  at::Tensor mean = at::detail::empty_cpu({sh.N, sh.G}, x.options().dtype(stats_dtype(x.scalar_type())));
  at::Tensor rstd = at::detail::empty_cpu({sh.N, sh.G}, x.options().dtype(stats_dtype(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "group_norm_forward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = param_or<acc_t>(weight, sh.C, acc_t(1));
    const auto b = param_or<acc_t>(bias, sh.C, acc_t(0));
    const Modulation<acc_t> mod(epilogue);
    const ElementwiseOperands<scalar_t> ep(epilogue);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    acc_t* mp = mean.data_ptr<acc_t>();
    acc_t* rp = rstd.data_ptr<acc_t>();
    if (layout == Layout::ChannelsFirst) {
      const bool per_channel_params = (weight.has_value() && weight->defined()) || (bias.has_value() && bias->defined());
      forward_channels_first(xp, yp, sh, w, b, per_channel_params, eps, mod, ep, mp, rp);
    } else {
      forward_channels_last(xp, yp, sh, w, b, eps, mod, ep, mp, rp);
    }
  });
  return {y, mean, rstd};
}

}  // namespace fusednorm::cpu::CPU_CAPABILITY
