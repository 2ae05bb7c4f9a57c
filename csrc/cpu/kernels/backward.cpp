// The CPU backward of group_norm_backward and fused_group_norm_backward, compiled once per CPU
// capability (docs/design.md, 'CPU capabilities'). The formulas are in backward_sums.h; this file
// holds the passes over memory for both layouts. As the forward, results do not depend on the
// number of threads (docs/design.md, 'Determinism').
#ifndef CPU_CAPABILITY
#error "compiled once per CPU capability through setup.py's wrappers, which define CPU_CAPABILITY"
#endif

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/kernels/affine_params.h"
#include "cpu/kernels/backward_sums.h"
#include "cpu/kernels/channels_last.h"
#include "cpu/kernels/elementwise_operands.h"
#include "cpu/kernels/one_element_per_channel.h"
#include "cpu/kernels/vec_io.h"
#include "group_norm.h"

namespace fusednorm::cpu::CPU_CAPABILITY {
namespace {

// Calls body(dp, x_run, len) over a contiguous run of `len` elements starting at element `off`
// of a ChannelsFirst row (n, c): dp is dy itself, or the epilogue's gradient computed block by
// block (blocks aligned as reduce_row's, so sums do not depend on the path) into a stack buffer,
// or, with `cache`, into cache + (off - cache_origin): there the first pass (`write`) computes it
// and the second reads it back.
template <typename T, typename Body>
void for_each_dp_run(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t off,
    int64_t len, at::opmath_type<T> centre, at::opmath_type<T> pa, at::opmath_type<T> pc,
    bool write, Body body, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  if (!ep.active()) {
    body(dy + off, x + off, len);
    return;
  }
  acc_t buf[kBlock];
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t block = std::min(kBlock, len - start);
    const int64_t o = off + start;
    acc_t* dp = cache != nullptr ? cache + (o - cache_origin) : buf;
    if (write || cache == nullptr) ep.template backward_run<false>(dy + o, x + o, o, block, &centre, &pa, &pc, dp, write);
    body(static_cast<const acc_t*>(dp), x + o, block);
  }
}

// The same for rows [r0, r1) of a ChannelsLast sample starting at element `base`: body(dp, x,
// rows) with dp and x pointing at row r0 (rows of C elements); dp in `buf`, or in
// cache + (element - cache_origin) as for_each_dp_run.
template <typename T, typename Body>
void for_each_dp_chunk(const ElementwiseOperands<T>& ep, const T* dy, const T* x, int64_t base,
    int64_t r0, int64_t r1, int64_t C, const GradInputCoeffs<at::opmath_type<T>>& k, int64_t n,
    bool write, std::vector<at::opmath_type<T>>& buf, Body body, at::opmath_type<T>* cache = nullptr,
    int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  const int64_t first = base + r0 * C;
  if (!ep.active()) {
    body(dy + first, x + first, r1 - r0);
    return;
  }
  acc_t* dp = cache;
  if (cache != nullptr) {
    dp += first - cache_origin;
  } else {
    buf.resize((r1 - r0) * C);
    dp = buf.data();
  }
  if (write || cache == nullptr) {
    // Runs of rows where rows are short (rows_per_run): the same values, fewer partial vectors.
    const int64_t run = rows_per_run(C, VecIO<T>::kSize);
    const RowRunCoeffs<acc_t, 3> co({&k.mean[n * C], &k.a[n * C], &k.pc[n * C]}, C, run);
    for_row_runs(r0, r1, run, [&](int64_t r, int64_t count) {
      const int64_t o = base + r * C;
      ep.template backward_run<true>(dy + o, x + o, o, count * C, co[0], co[1], co[2], dp + (r - r0) * C, write);
    });
  }
  body(static_cast<const acc_t*>(dp), x + first, r1 - r0);
}

// The per-channel sums of chunk [r0, r1) of ChannelsLast sample n, into `partial` (3 x C).
template <typename T>
void chunk_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t n,
    int64_t r0, int64_t r1, double* partial, std::vector<at::opmath_type<T>>& buf,
    at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C;
  const at::opmath_type<T>* mc = &k.mean[n * C];
  for_each_dp_chunk(ep, dy, x, n * sh.S * C, r0, r1, C, k, n, /*write=*/true, buf,
      [&](const auto* dp, const T* xr, int64_t rows) {
        reduce_channels<3>(xr, dp, 0, rows, C, partial,
            [mc](auto& acc, const Vec& xv, const Vec& dpv, int64_t c0, int64_t count) {
              accumulate_grad_sums(acc, dpv, xv - Vec::loadu(mc + c0, count));
            });
      },
      cache, cache_origin);
}

// dx of chunk [r0, r1) of ChannelsLast sample n.
template <typename T>
void chunk_grad_input(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t n,
    int64_t r0, int64_t r1, std::vector<at::opmath_type<T>>& buf, at::opmath_type<T>* cache = nullptr,
    int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const int64_t C = sh.C, first = (n * sh.S + r0) * C;
  for_each_dp_chunk(ep, dy, x, n * sh.S * C, r0, r1, C, k, n, /*write=*/false, buf,
      [&](const auto* dp, const T* xr, int64_t rows) {
        // Runs of rows where rows are short (rows_per_run): the same values, fewer partial vectors.
        const int64_t run = rows_per_run(C, Vec::size());
        const RowRunCoeffs<at::opmath_type<T>, 4> co({&k.a[n * C], &k.b[n * C], &k.mean[n * C], &k.e[n * C]}, C, run);
        for_row_runs(0, rows, run, [&](int64_t r, int64_t count) {
          const int64_t len = count * C;
          map_row(xr + r * C, dp + r * C, dx + first + r * C, len, [&](const Vec& xv, const Vec& dpv, int64_t c0) {
            const int64_t lanes = std::min<int64_t>(Vec::size(), len - c0);
            return at::vec::fmadd(Vec::loadu(co[0] + c0, lanes), dpv,
                at::vec::fmadd(Vec::loadu(co[1] + c0, lanes), xv - Vec::loadu(co[2] + c0, lanes),
                    Vec::loadu(co[3] + c0, lanes)));
          });
        });
      },
      cache, cache_origin);
}

// The sums of row (n, c) = nc of a ChannelsFirst input (dp through `cache` as for_each_dp_run).
template <typename T>
void channel_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t nc,
    GradSums& out, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const Vec m(k.mean[nc]);
  std::array<double, 3> sums{};
  for_each_dp_run(ep, dy, x, nc * sh.S, sh.S, k.mean[nc], k.a[nc], k.pc[nc], /*write=*/true,
      [&](const auto* dp, const T* xr, int64_t len) {
        const auto part = reduce_row<3>(xr, dp, len,
            [&m](auto& acc, const Vec& xv, const Vec& dpv, int64_t count) {
              // Padding lanes hold dp = x = 0: only x - m needs masking.
              accumulate_grad_sums(acc, dpv, first_lanes(xv - m, count));
            });
        for (int i = 0; i < 3; ++i) sums[i] += part[i];
      },
      cache, cache_origin);
  out.db[nc] = sums[0];
  out.dsc[nc] = sums[1];
  out.dev[nc] = sums[2];
}

// dx of row nc of a ChannelsFirst input.
template <typename T>
void channel_grad_input(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t nc,
    at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using Vec = typename VecIO<T>::Vec;
  const Vec a(k.a[nc]), b(k.b[nc]), e(k.e[nc]), m(k.mean[nc]);
  for_each_dp_run(ep, dy, x, nc * sh.S, sh.S, k.mean[nc], k.a[nc], k.pc[nc], /*write=*/false,
      [&](const auto* dp, const T* xr, int64_t len) {
        map_row(xr, dp, dx + (xr - x), len, [&](const Vec& xv, const Vec& dpv, int64_t) {
          return at::vec::fmadd(a, dpv, at::vec::fmadd(b, xv - m, e));
        });
      },
      cache, cache_origin);
}

// The lanes' sums of Vec::size() vectors at once: lane j of the result sums the lanes of
// v[bit_reverse(j)]. Each step interleaves pairs of vectors lane by lane (at::vec::interleave2)
// and adds the two halves, halving the vectors and doubling the period of their rows' pattern.
template <typename Vec>
Vec transpose_sum(std::array<Vec, Vec::size()> v) {
  for (int n = Vec::size(); n > 1; n /= 2) {
    for (int i = 0; i < n / 2; ++i) {
      const auto halves = at::vec::interleave2(v[2 * i], v[2 * i + 1]);
      v[i] = halves.first + halves.second;
    }
  }
  return v[0];
}

// j with its log2(n) low bits in reverse order.
constexpr int bit_reverse(int j, int n) {
  int r = 0;
  for (int bit = 1; bit < n; bit <<= 1) r = (r << 1) | ((j & bit) ? 1 : 0);
  return r;
}

// The row whose sums transpose_sum leaves in each lane.
template <int L>
constexpr std::array<int, L> transpose_sum_rows() {
  std::array<int, L> rows{};
  for (int j = 0; j < L; ++j) rows[j] = bit_reverse(j, L);
  return rows;
}

// {f(0), ..., f(n - 1)}, each element constructed from f (in order): no default construction.
template <typename V, int n, typename F, int... I>
std::array<V, n> generate_impl(F& f, std::integer_sequence<int, I...>) {
  return {{f(I)...}};
}
template <typename V, int n, typename F>
std::array<V, n> generate(F f) {
  return generate_impl<V, n>(f, std::make_integer_sequence<int, n>());
}

// Rows of at most this many vectors take the backward's sums a block of rows at a time: with an
// elementwise epilogue, whose dp a block makes in stack buffers of that size, kShortRowVectors;
// without one, kPlainShortRowVectors (a row's lanes then add at most 32 values each, fewer than
// reduce_row's kBlock; row by row, rows of 100 and 225 elements took 2x and 1.6x the time;
// docs/design.md, "CPU kernels").
constexpr int64_t kShortRowVectors = 4;
constexpr int64_t kPlainShortRowVectors = 32;

template <typename T>
bool short_rows(const GroupNormShape& sh, bool epilogue) {
  return sh.S <= (epilogue ? kShortRowVectors : kPlainShortRowVectors) * VecIO<T>::kSize;
}

// The ChannelsFirst sums of rows [first, first + Vec::size()) that lie below `rows`, short rows
// (short_rows): each row's three sums in one vector each, then the lanes of the
// block's rows summed together (transpose_sum), in place of three horizontal sums a row. Those,
// with reduce_row's set-up, were a fixed ~90 cycles a row: (8, 1280, 16) took 4x ATen's time,
// (2, 1280, 8, 8) 2.2x (one thread; docs/design.md, 'CPU kernels'). Every lane of transpose_sum adds its
// row's lanes in the same tree, so a row's sums depend neither on its place in the block nor on
// the block's other rows (absent ones are zeros): any split over threads, and blocks aligned to
// groups or not, give the same bits. With an epilogue, the block's dp is made first (into
// `cache` as for_each_dp_run), in one backward_run with each row's coefficients spread over its
// elements: the same values as channel_grad_sums makes row by row, without a call a row.
template <typename T>
void short_rows_grad_sums(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, int64_t first, int64_t rows,
    GradSums& out, at::opmath_type<T>* cache = nullptr, int64_t cache_origin = 0) {
  using acc_t = at::opmath_type<T>;
  using IO = VecIO<T>;
  using Vec = typename IO::Vec;
  constexpr int L = Vec::size();
  const int64_t present = std::min<int64_t>(L, rows - first), len = present * sh.S, o_first = first * sh.S;
  acc_t block_dp[kShortRowVectors * L * L];
  acc_t* const dp_first = cache != nullptr ? cache + (o_first - cache_origin) : block_dp;
  const bool active = ep.active();  // (a local: the loop below would reload ep's members)
  if (active) {
    acc_t centre[kShortRowVectors * L * L], pa[kShortRowVectors * L * L], pc[kShortRowVectors * L * L];
    for (int64_t r = 0; r < present; ++r) {
      const int64_t nc = first + r;
      std::fill_n(centre + r * sh.S, sh.S, k.mean[nc]);
      std::fill_n(pa + r * sh.S, sh.S, k.a[nc]);
      std::fill_n(pc + r * sh.S, sh.S, k.pc[nc]);
    }
    ep.template backward_run<true>(dy + o_first, x + o_first, o_first, len, centre, pa, pc, dp_first, /*write=*/true);
  }
  // Built element by element (generate): a default-constructed std::array<Vec, L> is zeroed
  // first, 3 KB a block (AVX512), which took a fifth of this function on rows of one vector.
  const auto row_sums = generate<std::array<Vec, 3>, L>([&](int r) {
    std::array<Vec, 3> acc{Vec(0), Vec(0), Vec(0)};
    if (r < present) {
      const int64_t nc = first + r, o = nc * sh.S;
      const Vec m(k.mean[nc]);
      // dp's address is formed where it is read, with an epilogue: without one, dp_first is
      // block_dp, which rows of up to kPlainShortRowVectors would run past.
      const int64_t dp_row = r * sh.S;
      IO::for_each_vector(sh.S, [&](int64_t i, int64_t count) {
        // Padding lanes hold dp = x = 0: only x - m needs masking.
        const Vec dpv = active ? Vec::loadu(dp_first + (dp_row + i), count) : IO::load(dy + o + i, count);
        accumulate_grad_sums(acc, dpv, first_lanes(IO::load(x + o + i, count) - m, count));
      });
    }
    return acc;
  });
  // Row kRows[j] in place j: lane j of transpose_sum then sums row kRows[kRows[j]] = j (bit
  // reversal is its own inverse), so the lanes come out in row order and are stored as a run.
  static constexpr std::array<int, L> kRows = transpose_sum_rows<L>();
  const auto db = generate<Vec, L>([&](int r) { return row_sums[kRows[r]][0]; });
  const auto dsc = generate<Vec, L>([&](int r) { return row_sums[kRows[r]][1]; });
  const auto dev = generate<Vec, L>([&](int r) { return row_sums[kRows[r]][2]; });
  acc_t lanes[3][L];
  transpose_sum(db).store(lanes[0]);
  transpose_sum(dsc).store(lanes[1]);
  transpose_sum(dev).store(lanes[2]);
  double* const outs[3] = {out.db.data() + first, out.dsc.data() + first, out.dev.data() + first};
  for (int i = 0; i < 3; ++i) {
    if (present == L) {
      for (int j = 0; j < L; ++j) outs[i][j] = lanes[i][j];
    } else {
      for (int j = 0; j < present; ++j) outs[i][j] = lanes[i][j];
    }
  }
}

// dx of rows [first, last) of a ChannelsFirst input from dp at dp + (element - dp_origin): dy
// itself (origin 0) without an epilogue, or the epilogue's dp cached by the sums' pass. The
// arithmetic of channel_grad_input, in one flattened loop: through channel_grad_input a row of
// one or a few vectors paid a call and its closure's loads.
template <typename T, typename P>
FUSEDNORM_FLATTEN void rows_grad_input(const P* dp, int64_t dp_origin, const T* x, T* dx,
    const GroupNormShape& sh, const GradInputCoeffs<at::opmath_type<T>>& k, int64_t first, int64_t last) {
  using Vec = typename VecIO<T>::Vec;
  for (int64_t nc = first; nc < last; ++nc) {
    const Vec a(k.a[nc]), b(k.b[nc]), e(k.e[nc]), m(k.mean[nc]);
    const int64_t o = nc * sh.S;
    map_row(x + o, dp + (o - dp_origin), dx + o, sh.S, [&](const Vec& xv, const Vec& dpv, int64_t) {
      return at::vec::fmadd(a, dpv, at::vec::fmadd(b, xv - m, e));
    });
  }
}

template <typename T>
void grad_sums_channels_first(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& out) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sh.S, 1));
  constexpr int64_t L = VecIO<T>::kSize;
  if (short_rows<T>(sh, ep.active())) {
    const int64_t rows = sh.N * sh.C;
    at::parallel_for(0, (rows + L - 1) / L, std::max<int64_t>(1, grain / L), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) short_rows_grad_sums(dy, x, sh, k, ep, b * L, rows, out);
    });
    return;
  }
  at::parallel_for(0, sh.N * sh.C, grain, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) channel_grad_sums(dy, x, sh, k, ep, nc, out);
  });
}

// The ChannelsFirst sums and dx group by group (sums, the group's coefficients, dx), with the
// same arithmetic as the two-pass path, so the results are the same bits. With an epilogue whose
// dp is worth computing once, a group's dp (D * S values, at most kMaxGroupDpBytes) goes into a
// per-thread buffer in the sums' pass and is read back by the dx pass. Without one (dp = dy), the
// order alone pays where a group's x and dy (at most kMaxPlainGroupBytes, which leaves room for
// dx in a 1-2 MB L2) are still in L1 / L2 for the dx pass, as ATen's batch-norm backward keeps a
// channel: the two-pass path reads the whole batch's x and dy a second time from L3
// (docs/design.md, "CPU kernels"). Only with several groups a thread (the two-pass path spreads
// rows, not groups), and not for short rows, whose sums go L rows a block across groups
// (short_rows_grad_sums).
constexpr int64_t kMaxGroupDpBytes = 512 * 1024;
constexpr int64_t kMaxPlainGroupBytes = 512 * 1024;
constexpr int64_t kMinPlainGroupsPerThread = 4;

// Groups a step of backward_groups_channels_first takes: 1, or for short rows enough groups that
// their rows fill whole blocks of L rows (L / gcd(D, L) groups, at most kMaxShortRowBatchRows
// rows): a group of D < L rows alone would leave the rest of its block's transpose_sum empty.
// The sums of a row do not depend on its block (short_rows_grad_sums), so the batch changes no
// bits. (With an epilogue the batch's dp is cached: kMaxShortRowBatchRows rows of at most
// kShortRowVectors vectors, 32 KB of float at most under AVX512.)
constexpr int64_t kMaxShortRowBatchRows = 128;

template <typename T>
int64_t short_rows_group_batch(const GroupNormShape& sh, bool epilogue) {
  constexpr int64_t L = VecIO<T>::kSize;
  if (!short_rows<T>(sh, epilogue) || sh.D >= L) return 1;
  const int64_t full = L / std::gcd(sh.D, L);
  return full * sh.D <= kMaxShortRowBatchRows ? full : (L + sh.D - 1) / sh.D;
}

template <typename T>
void backward_groups_channels_first(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w_eff, const at::opmath_type<T>* rstd,
    GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& sums) {
  using acc_t = at::opmath_type<T>;
  const int64_t M = sh.D * sh.S;
  const bool blocks = short_rows<T>(sh, ep.active());
  const int64_t batch = short_rows_group_batch<T>(sh, ep.active());
  at::parallel_for(0, sh.N * sh.G, std::max<int64_t>(1, 32768 / std::max<int64_t>(M, 1)), [&](int64_t begin, int64_t end) {
    // The batch's dp (without an epilogue dp = dy: no buffer).
    std::vector<acc_t> group_dp(ep.active() ? batch * M : 0);
    for (int64_t g0 = begin; g0 < end; g0 += batch) {
      const int64_t g1 = std::min(end, g0 + batch);
      const int64_t rows_end = g1 * sh.D;
      if (blocks) {
        for (int64_t nc = g0 * sh.D; nc < rows_end; nc += VecIO<T>::kSize) {
          short_rows_grad_sums(dy, x, sh, k, ep, nc, rows_end, sums, group_dp.data(), g0 * M);
        }
      } else {
        for (int64_t nc = g0 * sh.D; nc < rows_end; ++nc) {
          channel_grad_sums(dy, x, sh, k, ep, nc, sums, group_dp.data(), g0 * M);
        }
      }
      for (int64_t ng = g0; ng < g1; ++ng) finish_group(sh, ng, w_eff, rstd, sums, &k);
      if (!ep.active()) {
        rows_grad_input(dy, 0, x, dx, sh, k, g0 * sh.D, rows_end);
      } else if (blocks) {
        rows_grad_input(static_cast<const acc_t*>(group_dp.data()), g0 * M, x, dx, sh, k, g0 * sh.D, rows_end);
      } else {
        for (int64_t nc = g0 * sh.D; nc < rows_end; ++nc) {
          channel_grad_input(dy, x, dx, sh, k, ep, nc, group_dp.data(), g0 * M);
        }
      }
    }
  });
}

// The backward sums of sample n from its per-chunk partials [chunks][3][C], added in chunk order
// to totals that start at 0.0 (so that partials of -0.0 still sum to +0.0), a chunk at a time
// along its run of channels: channel by channel the partials were read 3 * C apart.
void sample_grad_totals(const double* partial, const GroupNormShape& sh, int64_t n, GradSums& out) {
  const int64_t C = sh.C, chunks = num_chunks(sh);
  double* const totals[3] = {&out.db[n * C], &out.dsc[n * C], &out.dev[n * C]};
  for (int j = 0; j < 3; ++j) std::fill_n(totals[j], C, 0.0);
  for (int64_t k = 0; k < chunks; ++k) {
    for (int j = 0; j < 3; ++j) {
      double* const t = totals[j];
      const double* const p = partial + (k * 3 + j) * C;
      for (int64_t c = 0; c < C; ++c) t[c] += p[c];
    }
  }
}

template <typename T>
void grad_sums_channels_last(const T* dy, const T* x, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& out) {
  const int64_t C = sh.C, chunks = num_chunks(sh);
  UninitVector<double> partial(sh.N * chunks * 3 * C);  // (each chunk writes its 3 x C)
  for_each_chunk(sh, [&](int64_t n, int64_t kk, int64_t r0, int64_t r1) {
    std::vector<at::opmath_type<T>> buf;
    chunk_grad_sums(dy, x, sh, k, ep, n, r0, r1, &partial[(n * chunks + kk) * 3 * C], buf);
  });
  for (int64_t n = 0; n < sh.N; ++n) sample_grad_totals(&partial[n * chunks * 3 * C], sh, n, out);
}

// The ChannelsLast counterpart of backward_groups_channels_first, sample by sample (a group
// spans its sample's rows): a sample's dp (S * C values, at most kMaxSampleDpBytes) is kept
// between the sums and dx. Same chunks and summation order as the two-pass path.
constexpr int64_t kMaxSampleDpBytes = 4 << 20;

template <typename T>
void backward_samples_channels_last(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const std::vector<at::opmath_type<T>>& w_eff, const at::opmath_type<T>* rstd,
    GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep, GradSums& sums) {
  using acc_t = at::opmath_type<T>;
  const int64_t C = sh.C;
  at::parallel_for(0, sh.N, grain_for(sh.S * C), [&](int64_t begin, int64_t end) {
    UninitVector<acc_t> sample_dp(sh.S * C);  // (written by the sums before dx reads it)
    std::vector<acc_t> buf;
    UninitVector<double> partial(num_chunks(sh) * 3 * C);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t origin = n * sh.S * C;
      for_sample_chunks(sh, [&](int64_t kk, int64_t r0, int64_t r1) {
        chunk_grad_sums(dy, x, sh, k, ep, n, r0, r1, &partial[kk * 3 * C], buf, sample_dp.data(), origin);
      });
      sample_grad_totals(partial.data(), sh, n, sums);
      for (int64_t ng = n * sh.G; ng < (n + 1) * sh.G; ++ng) finish_group(sh, ng, w_eff, rstd, sums, &k);
      for_sample_chunks(sh, [&](int64_t, int64_t r0, int64_t r1) {
        chunk_grad_input(dy, x, dx, sh, k, ep, n, r0, r1, buf, sample_dp.data(), origin);
      });
    }
  });
}

template <typename T>
void grad_input_channels_first(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sh.S, 1));
  at::parallel_for(0, sh.N * sh.C, grain, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) channel_grad_input(dy, x, dx, sh, k, ep, nc);
  });
}

template <typename T>
void grad_input_channels_last(const T* dy, const T* x, T* dx, const GroupNormShape& sh,
    const GradInputCoeffs<at::opmath_type<T>>& k, const ElementwiseOperands<T>& ep) {
  for_each_chunk(sh, [&](int64_t n, int64_t, int64_t r0, int64_t r1) {
    std::vector<at::opmath_type<T>> buf;
    chunk_grad_input(dy, x, dx, sh, k, ep, n, r0, r1, buf);
  });
}

}  // namespace

FusedGrads fused_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const GroupNormShape& sh, Layout layout,
    const Epilogue& epilogue, const FusedGradMask& mask, bool sum_residual_multiplier_grads) {
  const at::Tensor dy = to_layout(grad_out, layout);
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  FusedGrads grads = empty_fused_grads(x, sh, layout, mask, weight, bias, epilogue, sum_residual_multiplier_grads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "group_norm_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* mp = mean_c.data_ptr<acc_t>();
    const acc_t* rp = rstd_c.data_ptr<acc_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const auto w = param_or<acc_t>(weight, sh.C, acc_t(1));
    const auto b = param_or<acc_t>(bias, sh.C, acc_t(0));
    const Modulation<acc_t> mod(epilogue);
    ElementwiseOperands<scalar_t> ep(epilogue, mask[6]);
    if (mask[5]) ep.grad_residual = grads.residual.data_ptr<scalar_t>();
    if (mask[6]) ep.grad_multiplier = grads.multiplier.data_ptr<scalar_t>();
    if (sh.S == 1) {
      // No per-channel coefficient: no weight, bias, scale or shift.
      const bool uniform = !(weight && weight->defined()) && !(bias && bias->defined()) && mod.gain.empty() &&
          mod.shift.empty();
      backward_one_element_per_channel(dyp, xp, sh, w, b, mod, uniform, mp, rp, ep,
          mask[0] ? grads.input.data_ptr<scalar_t>() : nullptr, grads);
      return;
    }

    GradSums sums(sh.N * sh.C);
    std::vector<acc_t> w_eff;
    GradInputCoeffs<acc_t> k = pre_activation_coeffs<acc_t>(sh, w, b, mod, mp, rp, w_eff);
    const int64_t group_elems = sh.D * sh.S;
    const bool group_by_group = ep.active()
        ? group_elems * static_cast<int64_t>(sizeof(acc_t)) <= kMaxGroupDpBytes
        : 2 * group_elems * static_cast<int64_t>(sizeof(scalar_t)) <= kMaxPlainGroupBytes &&
            sh.N * sh.G >= kMinPlainGroupsPerThread * at::get_num_threads();
    if (layout == Layout::ChannelsFirst && mask[0] && group_by_group) {
      backward_groups_channels_first(dyp, xp, grads.input.data_ptr<scalar_t>(), sh, w_eff, rp, k, ep, sums);
      param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
      return;
    }
    // (Parallel over samples: only with a sample for every thread. Either path gives the same bits.)
    if (layout == Layout::ChannelsLast && ep.active() && mask[0] && sh.N >= at::get_num_threads() &&
        sh.S * sh.C * static_cast<int64_t>(sizeof(acc_t)) <= kMaxSampleDpBytes) {
      backward_samples_channels_last(dyp, xp, grads.input.data_ptr<scalar_t>(), sh, w_eff, rp, k, ep, sums);
      param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
      return;
    }
    if (layout == Layout::ChannelsFirst) {
      grad_sums_channels_first(dyp, xp, sh, k, ep, sums);
    } else {
      grad_sums_channels_last(dyp, xp, sh, k, ep, sums);
    }
    finish_groups<acc_t>(sh, w_eff, rp, sums, mask[0] ? &k : nullptr);
    if (mask[0]) {
      scalar_t* dxp = grads.input.data_ptr<scalar_t>();
      if (layout == Layout::ChannelsFirst) {
        grad_input_channels_first(dyp, xp, dxp, sh, k, ep);
      } else {
        grad_input_channels_last(dyp, xp, dxp, sh, k, ep);
      }
    }
    param_grads<acc_t>(sh, sums, rp, w, b, mod, grads);
  });
  return grads;
}

}  // namespace fusednorm::cpu::CPU_CAPABILITY
