// The kernel planner (plan.h): every rule that picks a CUDA path or sizes its launch.
//
// The constants below are the measured thresholds; each comment says why and cites the
// docs/design.md section that holds the measurements.
#include "plan.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>

namespace fusednorm {
namespace plan {
namespace {

int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Thresholds.

constexpr int kWarp = 32;
constexpr int kLogThreads = 8;  // log2(kSplitThreads)

// One-pass forward (docs/design.md, "One-pass forward", "Clusters"). Groups of x and its
// tensor-sized operands up to kOnePassMaxBytes take it, the CTAs of a cluster sharing a group,
// each holding at most kOnePassCtaBytes: three CTAs of 64 KB fit on an SM, while with 128 KB a CTA,
// one an SM, an SM's loads stop while its CTA computes (the 1 MB groups of the InstanceNorm
// problem ran at half the copy bandwidth). While the CTAs would not fill the GPU, clusters grow
// further, down to kClusterMinCtaBytes a CTA. Clusters exist from sm_90 on, of up to 8 CTAs, or 16
// where the device schedules them (H100: the InstanceNorm problem's forward took 6.8 ms with 16
// CTAs of 64 KB against 7.7 ms split). Without clusters a CTA works through a large group alone:
// unless there are groups for every SM, a group over the default 48 KB takes the split passes,
// which spread it over many CTAs (H100: 64 groups of 80 KB, 38 us in one pass against 33 split).
// The one-CTA backward and devices without clusters take up to the opt-in shared memory.
constexpr int64_t kOnePassMaxBytes = 1 << 20;
constexpr int64_t kOnePassCtaBytes = 64 * 1024;
constexpr int64_t kDefaultSmemBytes = 48 * 1024;
constexpr int64_t kClusterMinCtaBytes = 16 * 1024;

// Register kernel (docs/design.md, "Register kernel"): CTAs of kRegisterThreads, R packs a thread
// with E extra streams, R * (1 + E) <= 8 16-byte packs (32 registers) under the kernel's cap of 64
// (two CTAs an SM). bfloat16 takes more registers than float16 for the same packs (its kernels
// with 2 packs and two extra streams, or 4 packs and one, spilled under the cap): one stream fewer
// there. Channels-last groups take R <= 4 rows a thread, each thread also holding its channels'
// two coefficients (float16 / float32: 44-64 registers, no spills); bfloat16 spilled (6 / 12-24
// bytes) with more than 2 rows or an extra stream. Only the common activations (none, SiLU, ReLU)
// are instantiated; the others keep the shared-memory kernel.
constexpr int kRegisterThreads = 512;

// Channels-last one-pass forward (docs/design.md, "Channels-last one-pass"). A CTA takes the
// fewest groups (up to kMaxColsSpan, dividing G) whose rows together fill a 32-byte sector:
// measured on an H100, one group a CTA -> two took ResNet's GN+residual+ReLU 0.0732 -> 0.0563 ms
// and (8,320,64,64) float16 GN+SiLU 0.0664 -> 0.0486 (160 KB slabs, one CTA an SM, against 80 KB
// groups double-buffered). Unless forced: slabs over 48 KB only with a slab for 7/8 of the SMs,
// and one group a CTA at most kColsOnePassMaxBytes (two CTAs an SM). Without a residual or
// multiplier, where the slabs outnumber the CTAs resident at once, two buffers a CTA and a grid
// of the resident CTAs: (8,320,64,64) float16 GN+SiLU 0.072 -> 0.065 ms with one group a CTA,
// while ResNet's GN+residual+ReLU went 0.068 -> 0.078 (half the CTAs an SM then wait on the
// residual's loads), hence none with operands.
constexpr int kOnePassThreads = 256;
constexpr int kMaxColsSpan = 4;
// Channels-last cluster slabs with narrower rows take two groups a slab where they can
// (cols_cluster).
constexpr int64_t kWideColsRowBytes = 64;
constexpr int64_t kColsOnePassMaxBytes = 100 * 1024;
constexpr int64_t kSectorBytes = 32;
constexpr int64_t kSmemReserveBytes = 1024;  // static shared memory and the driver's reserve a CTA

// Team path (docs/design.md, "Team path"): two CTAs of 512 threads an SM (while one computes or
// waits at its barrier, the other's copies keep the SM's DRAM traffic going), each holding at
// most kTeamCtaBytes of the group (two in the 227 KB of an SM). By default the team forward takes
// the ChannelsFirst groups over kOnePassMaxBytes with their operands, and, of the groups the
// one-pass clusters hold, only those of kTeamFewGroupsMinBytes of x and more in fewer groups than
// half the SMs. Measured on an H200 (docs/design.md, "Team or one-pass"): since the clusters'
// shared memory starts on a 128-byte line, as the team's, the clusters beat or match the team on
// every group of 256 KB - 1 MB in 128 groups and more (the InstanceNorm problem 3.81 against
// 3.92 ms, (8,512,128,128) bfloat16 GN+SiLU 0.089 against 0.101, (16,256,128,128) float16 0.076
// against 0.093) and on 1 MB groups at 32 - 64 ((8,256,256,256) float16 GN+SiLU 0.175 both); the
// team keeps the VAE's 512 KB - 1 MB groups, 32 of them ((1,512,128,128) bfloat16). Without
// clusters (before sm_90) a one-pass group has one CTA, and the team path keeps groups from
// kTeamMinBytesNoClusters (set on an H100: same section).
constexpr int kTeamThreads = 512;
constexpr int kTeamBlocksPerSM = 2;
constexpr int64_t kTeamCtaBytes = 108 * 1024;
constexpr int64_t kTeamFewGroupsMinBytes = 512 * 1024;
constexpr int64_t kTeamMinBytesNoClusters = 36 * 1024;
constexpr int64_t kTeamSmemReserveBytes = 2048;
// Sweep path (docs/design.md, "Sweep path"): tiles of kSweepTileBytes of a group, a CTA each. By
// default it takes the ChannelsFirst float16 / bfloat16 groups of kSweepOperandsMinBytes and more
// where a residual or multiplier rides along (three streams: the sweep's operand kernel is the
// faster), before the team; and of x alone, after the team, the groups of kSweepMinBytes and more
// that no team holds (plan_forward). Measured on an H200 against the team path (kernel time,
// GN+SiLU unless said): on 2026-12-02, since the team's chunks start on 128-byte lines, the team
// ahead on every group it holds, the video VAEs' (1,128,20,256,256) bfloat16 0.250 against the
// sweep's 0.259 ms, float16 0.248 against 0.256, (1,256,9,240,320) float16 0.263 against 0.282,
// (2,128,1024,1024) bfloat16 (16 MB) 0.364 against 0.400, level on (1,128,9,480,640) (22 MB, one
// team of 264 CTAs) 0.526 against 0.529; before it, the sweep was ahead from 10 MB (0.261 against
// 0.296 on the first row). With an operand, since the alignment (2026-12-02, evening):
// (1,128,1024,1024) float16 GELU times a multiplier 0.278 against the team's 0.316, SiLU after a
// residual level (0.264 against 0.263), (1,128,20,256,256) bfloat16 SiLU after a residual 0.330
// against 0.340, (2,128,1024,1024) bfloat16 (h + y) * y 0.513 against 0.509 (within the noise);
// 4-8 MB groups with an operand not measured: they keep the 4 MB threshold every group had
// before. float32 8 MB groups lost 1-8% (the GroupNorm problem 5.30 against 5.25 ms,
// InstanceNorm3d 0.399 against 0.369; 2026-11-29): its kernels are the 16-bit types' alone.
constexpr int64_t kSweepTileBytes = 256 * 1024;
// Strided rows (Problem::strided_rows) take the sweep from rows of this many packs: a segment of
// the moments sweep is one row, and shorter ones would leave most of a CTA's 512 threads idle.
constexpr int64_t kSweepStridedMinRowPacks = 512;
constexpr int64_t kSweepMinBytes = 9 << 20;
constexpr int64_t kSweepOperandsMinBytes = 4 << 20;
// Channels-last sweep (docs/design.md, "Channels-last sweep"): by default for inputs of
// kColsSweepMinBytes and more, the moments and the output kernels' tiles in this many waves of
// their resident CTAs, each thread taking at least kColsSweepUnroll rows (plan.h). Measured on an
// H200 (fp16 GN+SiLU, kernel time): below 32 MB the split passes were as fast or faster
// ((2,320,64,64) 0.0197 against 0.0207-0.0250 ms, (1,512,128,128) 0.0332 against 0.0348), from
// 32 MB on the sweep ((1,256,256,256) 0.054 against 0.063, (1,128,512,512) 0.077 against 0.097,
// the video VAE's (1,128,20,256,256) 0.273 against 0.355). One wave of moments tiles against two
// and four: 0.897, 0.949 and 0.994 of the split passes' time (geometric mean of ten rows). Output
// tiles in two waves since its loads go through a ring (common/pack_ring.cuh; H200, fp16 GN+SiLU,
// kernel time, 4 waves / 2 / 8): (1,256,256,256) 0.0507 / 0.0428 / 0.0567 ms, (1,128,512,512)
// 0.0712 / 0.0686 / 0.0860, (1,128,1024,1024) 0.2176 / 0.2187 / 0.2139; two waves of moments tiles
// lost 3-14%.
constexpr int64_t kColsSweepMinBytes = 32 << 20;
constexpr int64_t kColsSweepWaves = 1;
constexpr int64_t kColsSweepOutputWaves = 2;
// docs/design.md, "Team prefetch": before it waits at a round's barrier, a CTA brings k / 8 of its
// next chunk into L2, so that the DRAM has work while the team synchronises. On an H100, with
// three teams of 88 CTAs (the GroupNorm problem) the barrier's wait cost 1.3 ms of 6.9; 3/8 gave
// 6.6-6.8 -> 5.95 ms, InstanceNorm3d 0.485 -> 0.437, the VAE's float16 0.252 -> 0.237, while 4/8
// and more lost to L2 evictions (8/8: back at 6.79 ms) and teams of 10 (the InstanceNorm
// problem's, whose waits the other teams' traffic covers) lost 5%: only teams of
// kTeamPrefetchMinCtas and more. On the H200 (one call, 3/8 against 6/8, triton.testing.do_bench)
// teams of kTeamLargeMinCtas CTAs and more, whose waits no other team's traffic covers, gain from
// 6/8 (three teams of 88: the GroupNorm problem 5.50 -> 5.43 ms, InstanceNorm3d (2,32,128,128,128)
// 0.381 -> 0.367) while teams of 24 lose (the VAE's (1,128,512,512) bfloat16 0.069 -> 0.071).
// The backward prefetches each stream it holds, best at 4/8 (H100): the InstanceNorm problem's
// backward 8.83 -> 8.36 ms, the GroupNorm problem's one team of 264 CTAs 13.0 -> 11.3 (then faster
// than its split passes' 12.5).
constexpr int kTeamPrefetchEighths = 3;
constexpr int kTeamLargePrefetchEighths = 6;
constexpr int kTeamLargeMinCtas = 64;
constexpr int kTeamBackwardPrefetchEighths = 4;
constexpr int kTeamPrefetchMinCtas = 16;
// docs/design.md, "Team replicas": every CTA of a team reads every rank's partials after the
// barrier; with one copy those reads fall on the few L2 lines that hold them (the GroupNorm
// problem's backward spent 0.93 ms of 11.5 in that fold). A backward CTA publishes a copy a rank,
// at most 16: on an H100 with 1, 4, 8 and 16 copies that backward took 11.35, 11.08, 10.95, 10.88
// ms, InstanceNorm3d's 0.83 -> 0.79. A forward CTA's thread 0 writes 4 copies (no CTA barrier,
// which cost the forward 4-5%): on an H200 the GroupNorm problem's teams of 88 CTAs 5.49 -> 5.21
// ms with 4 copies (5.21 with 8); InstanceNorm3d's (22 rounds) and teams of 24 CTAs level.
constexpr int kTeamMaxReplicas = 16;
constexpr int kTeamForwardReplicas = 4;
// docs/design.md, "Team path": a CTA's chunk is a whole number of 128-byte lines (8 packs of 16
// bytes), so that every chunk of a 128-byte aligned group starts on a line, as its shared-memory
// buffer does: chunks of 4965 packs (the video VAE's) put most CTAs' cp.async copies across lines,
// 1.5x the L2 sectors and 2.9x the shared-memory wavefronts of aligned ones (Nsight Compute). H200:
// team forwards and backwards 1-4.5% faster.
constexpr int64_t kTeamChunkAlign = 8;

// One-CTA backward (docs/design.md, "One-CTA backward"): CTAs of 512 threads from 1024 packs a
// group on (256 below), groups up to the opt-in shared memory less kSmemReserveBytes; over 48 KB
// only with a group for every SM, as the forward.
constexpr int kBackwardThreads = 512;

// Parameter gradients (docs/design.md, "Parameter gradients"): a channel block's finalize spreads
// over a cluster of up to kMaxParamGradParts CTAs (the portable cluster size) of
// kParamGradThreads, about two entries a warp, and only as large as lets every block's cluster
// run at once: a CTA takes a whole SM and a cluster's CTAs one GPC, so fewer clusters fit than
// SMs / parts. On an H200, clusters of 3 for 40 blocks and of 6 for 20 made the finalize
// 1.04-1.4x slower than one CTA a block, where clusters that fit made it up to 1.9x faster.
constexpr int kParamGradThreads = 1024;
constexpr int kMaxParamGradParts = 8;

int pack_width(int elem_bytes) { return elem_bytes >= 8 ? 1 : 16 / elem_bytes; }

bool set(int64_t v) { return v != kUnset; }

// ---------------------------------------------------------------------------------------------
// Overrides.

int64_t read_int(const char* name, bool wide = false) {
  const char* env = std::getenv(name);
  if (env == nullptr) return kUnset;
  return wide ? static_cast<int64_t>(std::atoll(env)) : static_cast<int64_t>(std::atoi(env));
}

// An override whose value is kUnset (e.g. FUSEDNORM_TEAM_FORWARD=-1) means the default, as it
// always did.
Overrides read_overrides() {
  Overrides o;
  o.one_pass_max_bytes = read_int("FUSEDNORM_ONE_PASS_MAX_BYTES", /*wide=*/true);
  // A set FUSEDNORM_ONE_PASS_MAX_BYTES forces the path even at -1: keep "set" apart from the value.
  if (std::getenv("FUSEDNORM_ONE_PASS_MAX_BYTES") != nullptr && o.one_pass_max_bytes == kUnset) {
    o.one_pass_max_bytes = kUnset - 1;  // any negative limit: no group fits
  }
  o.one_pass_registers = read_int("FUSEDNORM_ONE_PASS_REGISTERS");
  o.registers_late = read_int("FUSEDNORM_REGISTERS_LATE");
  o.team_forward = read_int("FUSEDNORM_TEAM_FORWARD");
  o.team_backward = read_int("FUSEDNORM_TEAM_BACKWARD");
  o.sweep_forward = read_int("FUSEDNORM_SWEEP_FORWARD");
  o.team_prefetch = read_int("FUSEDNORM_TEAM_PREFETCH");
  o.team_replicas = read_int("FUSEDNORM_TEAM_REPLICAS");
  o.param_grad_parts = read_int("FUSEDNORM_PARAM_GRAD_PARTS");
  o.cols_pipeline = read_int("FUSEDNORM_COLS_PIPELINE");
  o.cols_span = read_int("FUSEDNORM_COLS_SPAN");
  o.cols_sweep = read_int("FUSEDNORM_COLS_SWEEP");
#ifdef FUSEDNORM_TUNING_KNOBS
  o.one_pass_max_cluster = read_int("FUSEDNORM_ONE_PASS_MAX_CLUSTER");
  o.team_cta_kb = read_int("FUSEDNORM_TEAM_CTA_KB", /*wide=*/true);
  o.team_count = read_int("FUSEDNORM_TEAM_COUNT", /*wide=*/true);
  o.cols_act_kernel = read_int("FUSEDNORM_COLS_ACT_KERNEL");
  o.backward_threads = read_int("FUSEDNORM_BACKWARD_THREADS");
  o.cols_sweep_waves = read_int("FUSEDNORM_COLS_SWEEP_WAVES");
  o.cols_sweep_output_waves = read_int("FUSEDNORM_COLS_SWEEP_OUTPUT_WAVES");
#endif
  return o;
}

std::mutex overrides_mutex;
Overrides* current_overrides = nullptr;

// Knobs whose value "0" turns a feature off (atoi of a non-number is 0, as before).
bool off(int64_t v) { return set(v) && v == 0; }

// ---------------------------------------------------------------------------------------------
// The paths' rules.

// The split passes' channels-last (or S == 1) apply pass of an epilogue with neither residual nor
// multiplier and a common activation has a kernel of its own, and in the backward so has the
// reduce pass (docs/design.md, "Split passes").
bool cols_act_kernel(const Problem& p, const Overrides& o) {
  const bool epilogue = p.act != Act::None || p.scale || p.shift;  // and neither operand
  return epilogue && !p.residual && !p.multiplier && (p.channels_last || p.S == 1) && !off(o.cols_act_kernel) &&
      common_activation(p.act);
}

struct Ctx {
  const Problem& p;
  const DeviceInfo& dev;
  const Residency& res;
  const Overrides& o;
  int V;
  int64_t D, len, items;
  bool forced;          // FUSEDNORM_ONE_PASS_MAX_BYTES set
  int64_t max_bytes;    // the one-pass limit

  Ctx(const Problem& p_, const DeviceInfo& d, const Residency& r, const Overrides& o_)
      : p(p_), dev(d), res(r), o(o_), V(pack_width(p_.elem_bytes)), D(p_.D()), len(p_.D() * p_.S),
        items(p_.N * p_.G), forced(set(o_.one_pass_max_bytes) || o_.one_pass_max_bytes < kUnset),
        max_bytes(forced ? o_.one_pass_max_bytes : kOnePassMaxBytes) {}

  bool uniform_channels() const { return !p.weight && !p.bias && !p.scale && !p.shift; }
  // x and its distinct tensor-sized operands, forward.
  int forward_streams() const { return 1 + p.residual + (p.multiplier && !p.multiplier_is_residual); }
  // x, dz and the operands p needs, backward (the residual only for act'(p) or grad_multiplier).
  bool backward_residual() const { return p.residual && (p.act != Act::None || p.mask[6]); }
  int backward_streams() const {
    return 2 + backward_residual() + (p.multiplier && !(backward_residual() && p.multiplier_is_residual));
  }
};

// Teams for `groups` groups, at most `max_teams`: the fewest rounds, in the fewest teams that take
// the groups in that many (each CTA then holds less). A round costs a fixed part (the barrier, the
// fold, the copies' fill and drain) beside its chunk, so fewer rounds of larger chunks win even
// with idle teams in the last one (docs/design.md, "Team count": H200, the VAE's 32 groups of 4.7
// MB in 6 teams against 4, 0.128 -> 0.114 ms), and the same rounds in fewer teams win by smaller
// chunks (32 groups of 1 MB: two rounds of 16 teams against two of 26, 0.045 -> 0.034 ms).
int64_t team_count(int64_t groups, int64_t max_teams) {
  return ceil_div(groups, ceil_div(groups, max_teams));
}

// Sizes the team grid for groups of `lenv` packs of `pack_bytes` each (the pack times the
// streams held): the fewest CTAs that hold a group, the teams, each spread over all the CTAs it
// can have, the packs prefetched and the partials' copies. False where the device has no
// cooperative launch or a group does not fit the resident grid.
bool plan_team(const Ctx& c, int64_t lenv, int64_t pack_bytes, bool backward, Plan& pl) {
  if (!c.dev.cooperative_launch || !c.res.team_ctas_per_sm) return false;
  const int64_t cta_bytes = set(c.o.team_cta_kb) ? imax(1, c.o.team_cta_kb) * 1024 : kTeamCtaBytes;
  const int64_t max_chunk =
      imin(cta_bytes, c.dev.smem_optin - kTeamSmemReserveBytes) / pack_bytes / kTeamChunkAlign * kTeamChunkAlign;
  if (max_chunk <= 0) return false;
  const int per_sm = c.res.team_ctas_per_sm(max_chunk * pack_bytes);
  const int64_t resident = static_cast<int64_t>(per_sm) * c.dev.sms;
  const int64_t min_team = ceil_div(lenv, max_chunk);
  if (resident == 0 || min_team > resident) return false;
  const int64_t groups = c.items;
  const int64_t max_teams = imin(resident / min_team, groups);
  const int64_t teams =
      set(c.o.team_count) ? std::clamp<int64_t>(c.o.team_count, 1, max_teams) : team_count(groups, max_teams);
  const int64_t chunk = ceil_div(ceil_div(lenv, imin(resident / teams, lenv)), kTeamChunkAlign) * kTeamChunkAlign;
  const int64_t team_size = ceil_div(lenv, chunk);
  // The barrier counters reach rounds * team_size.
  if (ceil_div(groups, teams) * team_size > std::numeric_limits<unsigned>::max()) return false;
  pl.teams = static_cast<int>(teams);
  pl.team_size = static_cast<int>(team_size);
  pl.chunk = chunk;
  pl.smem = chunk * pack_bytes;
  pl.replicas = set(c.o.team_replicas) ? static_cast<int>(std::clamp<int64_t>(c.o.team_replicas, 1, kTeamMaxReplicas))
      : std::min(pl.team_size, backward ? kTeamMaxReplicas : kTeamForwardReplicas);
  const int64_t eighths = set(c.o.team_prefetch) ? std::clamp<int64_t>(c.o.team_prefetch, 0, 8)
      : pl.team_size < kTeamPrefetchMinCtas ? 0
      : backward ? kTeamBackwardPrefetchEighths
      : pl.team_size >= kTeamLargeMinCtas ? kTeamLargePrefetchEighths : kTeamPrefetchEighths;
  pl.prefetch = chunk * eighths / 8;
  pl.grid = teams * team_size;
  return true;
}

// The sweep forward (docs/design.md, "Sweep path"): 16-bit ChannelsFirst groups of kSweepMinBytes
// and more (kSweepOperandsMinBytes with a residual or multiplier); plan_forward asks it after the
// team for x alone. Its kernels exist for the 16-bit types alone, forced or not.
bool sweep_forward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  const int64_t mode = c.o.sweep_forward;
  if (p.elem_bytes != 2 || mode == 0 || p.channels_last || c.items == 0 || c.len == 0) return false;
  if (c.len % c.V != 0 || !p.aligned) return false;
  // A pack's elements share their coefficients (the output loop's channel segments), and offsets
  // within a group are 32-bit.
  if (!(p.S % c.V == 0 || c.uniform_channels()) || c.len / c.V >= (int64_t(1) << 31)) return false;
  // A forced one-pass limit (FUSEDNORM_ONE_PASS_MAX_BYTES) keeps the one-pass, team and split
  // paths it selects for the tests.
  const int64_t bytes = c.len * p.elem_bytes;
  const int64_t min_bytes = c.forward_streams() > 1 ? kSweepOperandsMinBytes : kSweepMinBytes;
  // Strided rows at any size: the alternative is a copy of x and another path (docs/design.md,
  // "Sweep path"), if the rows are whole packs long enough.
  if (p.strided_rows && !sweep_reads_strided_rows(p.S, c.V)) return false;
  if (mode != 1 && !p.strided_rows && (c.forced || bytes < min_bytes)) return false;
  const int64_t lenv = c.len / c.V;
  Tiling t;
  t.split = ceil_div(lenv, kSweepTileBytes / (c.V * p.elem_bytes));
  t.chunk = ceil_div(lenv, t.split);
  t.split = ceil_div(lenv, t.chunk);
  t.tiles = c.items * t.split;
  if (t.tiles > std::numeric_limits<int32_t>::max()) return false;
  pl.path = Path::Sweep;
  pl.reduce = t;
  return true;
}

// The channels-last sweep's tiles of rows: about `target` over N samples of S rows, a CTA reading
// `rows` rows at once, each thread at least kColsSweepUnroll of them, at most kMaxEntries a sample
// (the finalize's limit).
Tiling cols_sweep_tiling(int64_t N, int64_t S, int64_t rows, int64_t target) {
  int64_t split = ceil_div(target, N);
  split = imin(split, imax(1, S / (rows * kColsSweepUnroll)));
  split = imax(1, imin(split, kMaxEntries));
  Tiling t;
  t.chunk = ceil_div(S, split);
  t.split = ceil_div(S, t.chunk);
  t.tiles = N * t.split;
  return t;
}

// The channels-last sweep (docs/design.md, "Channels-last sweep"): the channels-last groups the
// one-pass kernels do not hold, in inputs of kColsSweepMinBytes and more, in 2- and 4-byte types
// whose rows are whole 16-byte packs, at most kColsSweepOutputThreads packs a row (a moments CTA
// then reads two rows at once or more).
bool cols_sweep_forward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  const int64_t mode = c.o.cols_sweep;
  if (mode == 0 || !p.channels_last || p.elem_bytes > 4 || c.V == 1 || c.items == 0 || c.len == 0) return false;
  if (p.C % c.V != 0 || !p.aligned) return false;
  const int64_t cpr = p.C / c.V;
  if (cpr > kColsSweepOutputThreads) return false;
  // A forced one-pass limit (FUSEDNORM_ONE_PASS_MAX_BYTES) keeps the paths it selects for the tests.
  if (mode != 1 && (c.forced || p.N * p.C * p.S * p.elem_bytes < kColsSweepMinBytes)) return false;
  const auto waves = [](int64_t knob, int64_t fallback) { return set(knob) ? imax(1, knob) : fallback; };
  const int64_t sms = c.dev.sms;
  const Tiling moments = cols_sweep_tiling(p.N, p.S, kColsSweepThreads / cpr,
      sms * kColsSweepBlocksPerSM * waves(c.o.cols_sweep_waves, kColsSweepWaves));
  const Tiling output = cols_sweep_tiling(p.N, p.S, kColsSweepOutputThreads / cpr,
      sms * kColsSweepOutputBlocksPerSM * waves(c.o.cols_sweep_output_waves, kColsSweepOutputWaves));
  if (imax(moments.tiles, output.tiles) > std::numeric_limits<int32_t>::max()) return false;
  pl.path = Path::ColsSweep;
  pl.reduce = moments;
  pl.output = output;
  pl.threads = cols_sweep_threads(kColsSweepThreads, cpr);
  return true;
}

bool team_forward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  const int64_t mode = c.o.team_forward;
  if (c.V == 1 || p.team_refused || mode == 0 || p.channels_last || c.items == 0 || c.len == 0) return false;
  if (c.len % c.V != 0 || !p.aligned) return false;
  if (mode != 1) {
    const int64_t x_bytes = c.len * p.elem_bytes;
    const int64_t bytes = c.forward_streams() * x_bytes;
    if (c.forced) {
      if (bytes <= c.max_bytes) return false;
    } else if (bytes <= kOnePassMaxBytes) {
      const bool few_groups = 2 * c.items < c.dev.sms;
      if (c.dev.major < 9 ? x_bytes < kTeamMinBytesNoClusters
                          : !few_groups || x_bytes < kTeamFewGroupsMinBytes) {
        return false;
      }
    }
  }
  if (!plan_team(c, c.len / c.V, static_cast<int64_t>(c.V) * p.elem_bytes, /*backward=*/false, pl)) return false;
  pl.path = Path::Team;
  return true;
}

// The register kernel's launch for R packs (rows) a thread and E extra streams.
void registers(const Ctx& c, int R, int E, bool cols, Plan& pl) {
  const int64_t wanted = cols ? (c.D / c.V) * ceil_div(c.p.S, R) : ceil_div(c.len / c.V, R);
  pl.path = Path::Registers;
  pl.reg_packs = R;
  pl.reg_streams = E;
  pl.threads = static_cast<int>(imin(kRegisterThreads, ceil_div(wanted, kWarp) * kWarp));
  // The late variant is ChannelsFirst's, and not bfloat16's (its late kernels spilled).
  pl.late = !cols && !c.p.bfloat16 && c.uniform_channels() && !off(c.o.registers_late);
  pl.grid = c.items;
}

bool cols_registers(const Ctx& c, Plan& pl) {
  const bool small = c.p.bfloat16;
  const int streams = c.forward_streams();
  const int64_t lanes = c.D / c.V;
  if (lanes > kRegisterThreads || streams > (small ? 1 : 2)) return false;
  const int64_t rows_at_once = kRegisterThreads / lanes;
  if (c.p.S <= 2 * rows_at_once) {
    registers(c, 2, streams == 1 ? 0 : 1, true, pl);
    return true;
  }
  if (!small && c.p.S <= 4 * rows_at_once && streams == 1) {
    registers(c, 4, 0, true, pl);
    return true;
  }
  return false;
}

bool registers_fit(const Ctx& c, Plan& pl) {
  if (off(c.o.one_pass_registers)) return false;
  if (!common_activation(c.p.act)) return false;  // instantiated for those only
  if (c.p.channels_last) return c.D % c.V == 0 && cols_registers(c, pl);
  if (!(c.p.S % c.V == 0 || c.uniform_channels())) return false;  // a pack's elements share coefficients
  const int extra = c.forward_streams() - 1;
  const int max_extra = c.p.bfloat16 ? 1 : 2;
  const int64_t lenv = c.len / c.V;
  if (lenv <= 2 * kRegisterThreads && extra <= max_extra) {
    registers(c, 2, extra, false, pl);
    return true;
  }
  if (lenv <= 4 * kRegisterThreads && extra <= max_extra - 1) {
    registers(c, 4, extra, false, pl);
    return true;
  }
  return false;
}

// The largest cluster the one-pass kernels may take on this device (the knob caps it).
int max_one_pass_cluster(const Ctx& c) {
  int max_cluster = c.dev.major < 9 ? 1 : c.dev.clusters_of_16 ? 16 : 8;
  if (set(c.o.one_pass_max_cluster)) {
    max_cluster = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_cluster, c.o.one_pass_max_cluster)));
  }
  return max_cluster;
}

// Channels-last slabs (`span` groups of S rows) no CTA takes alone, or too few to fill the GPU one
// a CTA: a cluster a slab (sm_90), its CTAs on equal ranges of the rows, sized as the ChannelsFirst
// clusters (one_pass_cluster): at most kOnePassCtaBytes a CTA, grown while the CTAs would not fill
// the GPU and keep kClusterMinCtaBytes. Measured on an H200 (docs/design.md, "Channels-last
// one-pass"): fp16 GN+SiLU 1.2-1.4x the split passes' speed on the SD VAE's (1,512,64,64) and
// (1,512,128,128) and the UNet's (2,320,64,64) to (2,960,64,64), which they took in three launches.
// `cluster` > 0: that many CTAs a slab instead of the rule's.
bool cols_cluster_plan(const Ctx& c, int span, int pack_bytes, Plan& pl, int cluster) {
  const Problem& p = c.p;
  const int64_t slabs = c.items / span;
  const int64_t row_bytes = span * c.D * p.elem_bytes;  // a slab's row
  const int64_t slab = p.S * row_bytes;
  // The portable cluster size at most (clusters_of_16 probed the ChannelsFirst kernel); 16 only
  // as `cluster`, for cols_cluster's wider rows.
  const int max_cluster = std::min(8, max_one_pass_cluster(c));
  const auto cta_bytes = [&](int k) { return ceil_div(p.S, k) * row_bytes; };
  // 16-bit types without a residual or multiplier only: float32 and the operands' loads in the
  // output loop of a few rows a CTA were slower than the split passes (design.md).
  if (p.elem_bytes != 2 || c.forward_streams() != 1) return false;
  if (p.G % span != 0 || row_bytes / pack_bytes > kOnePassThreads || !common_activation(p.act)) return false;
  int k = 1;
  while (k < max_cluster && cta_bytes(k) > kOnePassCtaBytes) k *= 2;
  while (k < max_cluster && slabs * k < c.dev.sms && slab / (2 * k) >= kClusterMinCtaBytes) k *= 2;
  if (cluster > 0) k = cluster;
  // One wave of two CTAs an SM at most: more waves of clusters are unmeasured (the split passes).
  if (k == 1 || cta_bytes(k) > kOnePassCtaBytes || slabs * k > 2 * c.dev.sms) return false;
  pl.path = Path::ColsShared;
  pl.span = span;
  pl.pack_bytes = pack_bytes;
  pl.cluster = k;
  pl.grid = slabs * k;
  pl.buffer_packs = 0;
  pl.smem = cta_bytes(k);
  return true;
}

// The clusters' slabs: cols_cluster_plan's, except that a slab of one group's rows under
// kWideColsRowBytes in clusters of 8, where the device schedules clusters of 16 (the SD VAE's 16
// half channels a group: 32-byte rows), takes two groups in clusters of 16: the same bytes a CTA
// and the same grid, in half the rows of twice the width (a row's copy and store cost
// instructions in phases every warp runs at once). H200, fp16 GN+SiLU, kernel time with x just
// written: (1,512,128,128) 22.2 -> 20.6 us, (1,512,64,64) 9.35 -> 9.2 (docs/design.md,
// "Channels-last one-pass").
bool cols_cluster(const Ctx& c, int span, int pack_bytes, Plan& pl) {
  if (!cols_cluster_plan(c, span, pack_bytes, pl, 0)) return false;
  const bool narrow = pl.cluster == 8 && span * c.D * c.p.elem_bytes < kWideColsRowBytes;
  Plan wide = pl;
  if (narrow && max_one_pass_cluster(c) >= 16 && 2 * span <= kMaxColsSpan && 2 * span * 16 <= kWarp &&
      c.p.G % (2 * span) == 0 && cols_cluster_plan(c, 2 * span, pack_bytes, wide, 16) && wide.grid == pl.grid &&
      wide.smem == pl.smem) {
    pl = wide;
  }
  return true;
}

bool cols_shared(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  const int64_t groups = c.items;
  const int64_t row_bytes = c.D * p.elem_bytes;
  const int pack_bytes = row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : 4;
  const int64_t lanes = row_bytes / pack_bytes;
  const int64_t bytes = p.S * row_bytes;
  const int64_t smem_limit = c.dev.smem_optin - kSmemReserveBytes;
  int max_span = kMaxColsSpan;
  if (set(c.o.cols_span)) max_span = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_span, c.o.cols_span)));
  int span = 1;
  while (2 * span <= max_span && span * row_bytes < kSectorBytes && p.G % (2 * span) == 0) span *= 2;
  const auto fits = [&](int k) {
    const int64_t slab = k * bytes;
    if (k * lanes > kOnePassThreads || slab > smem_limit) return false;
    return c.forced ||
        (slab <= (k > 1 ? smem_limit : kColsOnePassMaxBytes) &&
            (slab <= kDefaultSmemBytes || 8 * (groups / k) >= 7 * c.dev.sms));
  };
  const int sector_span = span;
  while (span > 1 && !fits(span)) span /= 2;
  if (!fits(span)) return cols_cluster(c, sector_span, pack_bytes, pl);
  if (!common_activation(p.act)) return false;  // the others take the split passes
  const int64_t items = groups / span;
  const int64_t slab_bytes = span * bytes;
  const int64_t knob = c.o.cols_pipeline;
  const bool pipeline = (knob == 1 || (knob == kUnset && c.forward_streams() == 1)) && items > c.dev.sms &&
      2 * slab_bytes <= smem_limit;
  pl.path = Path::ColsShared;
  pl.span = span;
  pl.pack_bytes = pack_bytes;
  pl.grid = items;
  pl.buffer_packs = 0;
  pl.smem = slab_bytes;
  if (pipeline) {
    // Two buffers a CTA and a grid of the CTAs resident at once, where the slabs outnumber them.
    const int per_sm = c.res.cols_ctas_per_sm ? c.res.cols_ctas_per_sm(pack_bytes, 2 * slab_bytes) : 0;
    if (per_sm > 0 && items > static_cast<int64_t>(per_sm) * c.dev.sms) {
      pl.grid = static_cast<int64_t>(per_sm) * c.dev.sms;
      pl.buffer_packs = slab_bytes / pack_bytes;
      pl.smem = 2 * slab_bytes;
    }
  }
  return true;
}

// CTAs a group of `bytes` for the one-pass forward; 0 where none fits.
int one_pass_cluster(const Ctx& c, int64_t bytes) {
  const int max_cluster = max_one_pass_cluster(c);
  int k = 1;
  while (k < max_cluster && ceil_div(bytes, k) > kOnePassCtaBytes) k *= 2;
  while (k < max_cluster && c.items * k < c.dev.sms && bytes / (2 * k) >= kClusterMinCtaBytes) k *= 2;
  return ceil_div(bytes, k) <= kOnePassCtaBytes || (k == 1 && bytes <= c.dev.smem_optin - kSmemReserveBytes) ? k : 0;
}

bool one_pass_forward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  if (c.V == 1) return false;  // double: the split path
  if (p.channels_last ? (c.D * p.elem_bytes) % 4 != 0 : c.len % c.V != 0) return false;
  if (!p.aligned) return false;
  const int64_t streams = c.forward_streams();
  const int64_t bytes = streams * c.len * p.elem_bytes;
  if (bytes > c.max_bytes) return false;
  if (p.channels_last) {
    if (c.items > std::numeric_limits<int>::max()) return false;
    return registers_fit(c, pl) || cols_shared(c, pl);
  }
  const int cluster = one_pass_cluster(c, bytes);
  if (cluster == 0 || c.items * cluster > std::numeric_limits<int>::max()) return false;
  if (!c.forced && cluster == 1 && bytes > kDefaultSmemBytes && c.items < c.dev.sms) return false;
  pl.cluster = cluster;
  pl.chunk = ceil_div(c.len / c.V, cluster);
  if (cluster == 1 && registers_fit(c, pl)) {
    pl.cluster = 1;
    pl.chunk = 0;
    return true;
  }
  pl.path = cluster > 1 ? Path::Cluster : Path::Shared;
  pl.smem = streams * pl.chunk * c.V * p.elem_bytes;
  pl.grid = c.items * cluster;
  pl.threads = kOnePassThreads;
  return true;
}

// The arguments both one-pass-style backwards need: ChannelsFirst, 16-byte packs of whole
// channels (S 1 or a multiple of the pack width), aligned tensors.
bool backward_packs_fit(const Ctx& c) {
  const Problem& p = c.p;
  return !p.channels_last && c.len % c.V == 0 && (p.S == 1 || p.S % c.V == 0) && p.aligned;
}

bool team_backward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  const int64_t mode = c.o.team_backward;
  if (c.V == 1 || p.team_refused) return false;
  if (mode == 0 || !p.mask[0] || c.items == 0 || c.len == 0 || p.S % c.V != 0) return false;
  if (!backward_packs_fit(c)) return false;
  Plan t = pl;
  const int64_t pack_bytes = static_cast<int64_t>(c.backward_streams()) * c.V * p.elem_bytes;
  if (!plan_team(c, c.len / c.V, pack_bytes, /*backward=*/true, t)) return false;
  // One team on the whole grid, every CTA waiting at every round's barrier: the split passes are
  // faster on the plain backward, unlike with an activation, whose split backward costs more
  // (docs/design.md, "Team or split backward").
  if (mode != 1 && t.teams == 1 && p.act == Act::None && !p.multiplier && !p.scale) return false;
  const int64_t chunk = t.chunk;
  const int64_t spv = p.S / c.V;
  t.channel_split = ceil_div(spv - 1, chunk) + 1;  // chunks a channel's packs overlap
  // Segments as wide as a chunk's share of a channel, narrow enough that the most channels a
  // chunk spans take one sweep (each sweep costs a segment reduction and the coefficients' loads:
  // six sweeps a round made the attention block's backward slower than the split passes).
  const int64_t max_channels = std::min<int64_t>(c.D, ceil_div(chunk - 1, spv) + 1);
  int log_fit = 0;
  while ((int64_t(2) << log_fit) * max_channels <= kTeamThreads) ++log_fit;
  t.log_seg = std::min(log_fit, ceil_log2(std::min(spv, chunk)));
  t.path = Path::Team;
  pl = t;
  return true;
}

bool one_cta_backward(const Ctx& c, Plan& pl) {
  const Problem& p = c.p;
  if (c.V == 1 || c.items > std::numeric_limits<int>::max() || !backward_packs_fit(c)) return false;
  const int64_t smem = c.backward_streams() * c.len * p.elem_bytes;
  if (smem > std::min<int64_t>(c.max_bytes, c.dev.smem_optin - kSmemReserveBytes)) return false;
  if (!c.forced && smem > kDefaultSmemBytes && c.items < c.dev.sms) return false;
  const int64_t lenv = c.len / c.V;
  pl.path = Path::OneCta;
  pl.smem = smem;
  pl.grid = c.items;
  pl.threads = set(c.o.backward_threads) ? (c.o.backward_threads == kBackwardThreads ? kBackwardThreads : kOnePassThreads)
      : lenv >= 2 * kBackwardThreads ? kBackwardThreads : kOnePassThreads;
  pl.log_seg = p.S == 1 ? 0 : static_cast<int>(std::min<int64_t>(kLogThreads, ceil_log2(p.S / c.V)));
  return true;
}

int param_grad_parts(const Ctx& c, bool per_sample, int64_t work, int64_t blocks) {
  if (c.dev.major < 9) return 1;
  if (set(c.o.param_grad_parts)) return static_cast<int>(imax(1, imin(c.o.param_grad_parts, kMaxParamGradParts)));
  if (!c.res.param_grad_clusters) return 1;
  constexpr int64_t kWarps = kParamGradThreads / kWarp;
  int parts = static_cast<int>(imin(ceil_div(work, 2 * kWarps), kMaxParamGradParts));
  for (; parts > 1; --parts) {
    if (c.res.param_grad_clusters(per_sample, parts) >= blocks) break;
  }
  return static_cast<int>(imax(1, parts));
}

}  // namespace

// ---------------------------------------------------------------------------------------------

bool tuning_knobs_compiled() {
#ifdef FUSEDNORM_TUNING_KNOBS
  return true;
#else
  return false;
#endif
}

const Overrides& overrides() {
  std::lock_guard<std::mutex> lock(overrides_mutex);
  if (current_overrides == nullptr) current_overrides = new Overrides(read_overrides());
  return *current_overrides;
}

const Overrides& reload_overrides() {
  std::lock_guard<std::mutex> lock(overrides_mutex);
  // The old struct is leaked, not freed: a call on another thread may still read it.
  current_overrides = new Overrides(read_overrides());
  return *current_overrides;
}

std::string Overrides::to_string() const {
  std::ostringstream s;
  const auto field = [&](const char* name, int64_t v) {
    if (set(v) || v < kUnset) s << (s.tellp() > 0 ? " " : "") << name << "=" << v;
  };
  field("one_pass_max_bytes", one_pass_max_bytes);
  field("one_pass_registers", one_pass_registers);
  field("registers_late", registers_late);
  field("team_forward", team_forward);
  field("team_backward", team_backward);
  field("sweep_forward", sweep_forward);
  field("team_prefetch", team_prefetch);
  field("team_replicas", team_replicas);
  field("param_grad_parts", param_grad_parts);
  field("cols_pipeline", cols_pipeline);
  field("cols_span", cols_span);
  field("cols_sweep", cols_sweep);
  field("one_pass_max_cluster", one_pass_max_cluster);
  field("team_cta_kb", team_cta_kb);
  field("team_count", team_count);
  field("cols_act_kernel", cols_act_kernel);
  field("backward_threads", backward_threads);
  field("cols_sweep_waves", cols_sweep_waves);
  field("cols_sweep_output_waves", cols_sweep_output_waves);
  return s.str();
}

DeviceInfo h200() { return DeviceInfo{}; }

std::string DeviceInfo::to_string() const {
  std::ostringstream s;
  s << "sms=" << sms << " cc=" << major << "." << minor << " smem_optin=" << smem_optin
    << " smem_per_sm=" << smem_per_sm << " l2=" << l2_bytes << " cooperative=" << cooperative_launch
    << " clusters_of_16=" << clusters_of_16;
  return s.str();
}

Residency modeled_residency(const DeviceInfo& dev) {
  Residency r;
  const int64_t per_sm_smem = dev.smem_per_sm;
  // __launch_bounds__(512, 2): registers allow two CTAs; shared memory may allow fewer.
  r.team_ctas_per_sm = [per_sm_smem](int64_t smem) {
    return static_cast<int>(imin(kTeamBlocksPerSM, per_sm_smem / (smem + kSmemReserveBytes)));
  };
  // __launch_bounds__(256, 2): modeled as limited by threads (8 CTAs) and shared memory only.
  r.cols_ctas_per_sm = [per_sm_smem](int, int64_t smem) {
    return static_cast<int>(imin(2048 / kOnePassThreads, per_sm_smem / (smem + kSmemReserveBytes)));
  };
  // A CTA of 1024 threads takes an SM; a cluster's CTAs share one graphics processing cluster,
  // modeled as 18 SMs at most, the SMs spread evenly over them (an H100 / H200: 8 of 16-17).
  const int sms = dev.sms;
  const bool clusters = dev.major >= 9;
  r.param_grad_clusters = [sms, clusters](bool, int parts) {
    if (!clusters) return 0;
    const int gpcs = (sms + 17) / 18;
    int total = 0;
    for (int g = 0; g < gpcs; ++g) total += (sms / gpcs + (g < sms % gpcs ? 1 : 0)) / parts;
    return total;
  };
  return r;
}

const char* path_name(Path p) {
  switch (p) {
    case Path::Split: return "split";
    case Path::Registers: return "registers";
    case Path::Shared: return "shared";
    case Path::Cluster: return "cluster";
    case Path::ColsShared: return "cols_shared";
    case Path::Team: return "team";
    case Path::OneCta: return "one_cta";
    case Path::Sweep: return "sweep";
    case Path::None: return "none";
    case Path::ColsSweep: return "cols_sweep";
  }
  return "?";
}

bool sweep_reads_strided_rows(int64_t S, int V) {
  return S % V == 0 && S / V >= kSweepStridedMinRowPacks;
}

std::string Plan::to_string() const {
  std::ostringstream s;
  s << "path=" << path_name(path);
  switch (path) {
    case Path::Registers:
      s << " packs=" << reg_packs << " extra_streams=" << reg_streams << " threads=" << threads
        << " late=" << late << " ctas=" << grid;
      break;
    case Path::Shared:
    case Path::Cluster:
      s << " cluster=" << cluster << " chunk=" << chunk << " smem=" << smem << " ctas=" << grid;
      break;
    case Path::ColsShared:
      s << " span=" << span << " pack_bytes=" << pack_bytes << " smem=" << smem << " ctas=" << grid
        << " buffer_packs=" << buffer_packs;
      if (cluster > 1) s << " cluster=" << cluster;
      break;
    case Path::Team:
      s << " teams=" << teams << " team_size=" << team_size << " chunk=" << chunk << " smem=" << smem
        << " prefetch=" << prefetch << " replicas=" << replicas << " ctas=" << grid;
      break;
    case Path::OneCta:
      s << " threads=" << threads << " smem=" << smem << " ctas=" << grid << " log_seg=" << log_seg;
      break;
    case Path::Sweep:
      s << " split=" << reduce.split << " tiles=" << reduce.tiles;
      break;
    case Path::ColsSweep:
      s << " threads=" << threads << " split=" << reduce.split << " tiles=" << reduce.tiles
        << " output_tiles=" << output.tiles;
      break;
    case Path::Split:
      if (reduce.tiles > 1 || reduce.split > 1) s << " split=" << reduce.split << " tiles=" << reduce.tiles;
      if (cols_act_kernel) s << " cols_act_kernel=1";
      break;
  }
  if (param_grad_parts > 0) s << " param_grad_parts=" << param_grad_parts;
  return s.str();
}

Plan plan_forward(const Problem& p, const DeviceInfo& dev, const Residency& res, const Overrides& o) {
  const Ctx c(p, dev, res, o);
  Plan pl;
  if (p.strided_rows) {
    if (!sweep_forward(c, pl)) pl.path = Path::None;
    return pl;
  }
  const bool cols_sweep_first = o.cols_sweep == 1;
  // The sweep before the team where a residual or multiplier rides along (or forced); after it,
  // for the groups no team holds, where x alone is read (kSweepMinBytes).
  const bool sweep_first = o.sweep_forward == 1 || c.forward_streams() > 1;
  if ((sweep_first && sweep_forward(c, pl)) || (cols_sweep_first && cols_sweep_forward(c, pl)) || team_forward(c, pl) ||
      (!sweep_first && sweep_forward(c, pl)) || one_pass_forward(c, pl)) {
    return pl;
  }
  pl = Plan{};
  if (!cols_sweep_first && cols_sweep_forward(c, pl)) return pl;
  pl.reduce = plan_reduce(p, /*grads=*/false, dev.sms).t;
  pl.cols_act_kernel = cols_act_kernel(p, o);
  return pl;
}

Plan plan_backward(const Problem& p, const DeviceInfo& dev, const Residency& res, const Overrides& o) {
  const Ctx c(p, dev, res, o);
  const bool want_params = p.mask[1] || p.mask[2] || p.mask[3] || p.mask[4];
  // Groups in one CTA's shared memory, else spread over a team's (the team first where forced).
  const bool team_first = o.team_backward == 1;
  Plan pl;
  int64_t split = 1;
  bool fused = team_first && team_backward(c, pl);
  if (!fused && one_cta_backward(c, pl)) {
    fused = true;
    // A group whose shared memory leaves its SM no second CTA goes to the team kernel where it
    // can take it: its CTAs, two an SM, hide more latency (docs/design.md, "One-CTA backward").
    Plan t;
    if (!team_first && !c.forced && 2 * pl.smem > dev.smem_per_sm && team_backward(c, t)) pl = t;
  }
  fused = fused || (!team_first && team_backward(c, pl));
  if (!fused) {
    pl = Plan{};
    if (p.mask[0] || want_params) {
      const ReduceTiling r = plan_reduce(p, /*grads=*/true, dev.sms);
      pl.reduce = r.t;
      split = r.t.split;
    }
  }
  pl.cols_act_kernel = !fused && cols_act_kernel(p, o);
  if (want_params) {
    const bool per_sample = p.scale || p.mask[3] || p.mask[4];
    const int64_t blocks = ceil_div(p.C, kWarp);
    pl.param_grad_parts = param_grad_parts(c, per_sample, per_sample ? p.N : p.N * split, blocks);
  }
  return pl;
}

// ---------------------------------------------------------------------------------------------
// Split-pass tiling.

int ceil_log2(int64_t v) {
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

// Two waves of full-occupancy CTAs, so that even N * G = 8 fills the GPU.
int64_t target_tiles(int sms) { return static_cast<int64_t>(sms) * kSplitBlocksPerSM * 2; }

// Tiles wanted per channels-last split pass. The forward's reduce and apply kernels keep two CTAs
// an SM resident (their registers: 86-108 a thread on sm_90), not eight, so target_tiles() made
// eight waves of short tiles, each paying its fixed cost (the group shifts or coefficients, the
// tree over its rows, the partials) on few rows: four waves of the CTAs that are resident instead
// (docs/design.md, "Split passes"). The backward keeps target_tiles().
int64_t cols_target_tiles(int sms, bool forward) {
  return forward ? static_cast<int64_t>(sms) * kSplitMinBlocks * 4 : target_tiles(sms);
}

int grid_for(int64_t tiles, int sms) {
  return static_cast<int>(imax(1, imin(tiles, static_cast<int64_t>(sms) * kSplitBlocksPerSM * 4)));
}

// Rows of `lenv` packs: 2^log_tx threads a row (the smallest power of two covering a row, up to
// kSplitThreads), and each row cut into `split` chunks so that there are about target_tiles()
// tiles, each thread keeping at least two batches of packs.
Tiling tile_rows(int64_t rows, int64_t lenv, int64_t max_split, int sms) {
  Tiling t;
  t.log_tx = ceil_log2(imin(lenv, kSplitThreads));
  const int64_t tx = int64_t(1) << t.log_tx;
  const int64_t row_blocks = ceil_div(rows, kSplitThreads / tx);
  int64_t split = ceil_div(target_tiles(sms), row_blocks);
  split = imin(split, imax(1, lenv / (tx * kSplitUnroll * 2)));
  split = imax(1, imin(split, max_split));
  t.chunk = ceil_div(lenv, split);
  t.split = ceil_div(lenv, t.chunk);
  t.tiles = row_blocks * t.split;
  return t;
}

// The apply pass over rows: short tiles, one CTA a tile, the hardware's block scheduler handing
// them out as it does PyTorch's and Inductor's elementwise kernels. A persistent grid over
// tile_rows' tiles (whole 1 MB rows in the GroupNorm problem's backward) ran this pass at 81% of
// the DRAM peak. The tile sizes are measured ones (docs/design.md, "Split passes"): the plain
// kernels in CTAs of 128 threads (kApplyRowsPlainThreads), packs a thread to read of each stream
// (x, or x and dy) by direction and element size; the EPI kernels, whose 16-bit packs a thread
// keeps two in flight and whose tiles start with the epilogue's coefficients, in CTAs of
// kSplitThreads with 16 packs of each stream.
constexpr int64_t kApplyRowsPlainPacksForward32 = 4;
constexpr int64_t kApplyRowsPlainPacksForward16 = 16;
constexpr int64_t kApplyRowsPlainPacksBackward32 = 4;
constexpr int64_t kApplyRowsPlainPacksBackward16 = 8;
constexpr int64_t kApplyRowsEpiPacks = 16;

Tiling tile_apply_rows(int64_t rows, int64_t lenv, bool backward, bool epilogue, bool sixteen_bit) {
  Tiling t;
  const int64_t threads = epilogue ? kSplitThreads : kApplyRowsPlainThreads;
  const int64_t packs = epilogue   ? kApplyRowsEpiPacks
                        : backward ? (sixteen_bit ? kApplyRowsPlainPacksBackward16 : kApplyRowsPlainPacksBackward32)
                                   : (sixteen_bit ? kApplyRowsPlainPacksForward16 : kApplyRowsPlainPacksForward32);
  t.log_tx = ceil_log2(imin(lenv, threads));
  const int64_t tx = int64_t(1) << t.log_tx;
  const int64_t row_blocks = ceil_div(rows, threads / tx);
  t.chunk = tx * packs;
  t.split = ceil_div(lenv, t.chunk);
  t.tiles = row_blocks * t.split;
  return t;
}

// The kernels loop over tiles by gridDim.x, so a grid capped at the largest x dimension still
// covers them.
int grid_of_every_tile(int64_t tiles) {
  return static_cast<int>(imax(1, imin(tiles, static_cast<int64_t>(std::numeric_limits<int>::max()))));
}

// ChannelsLast reduction over N samples of S rows of `cvn` packs: tiles (n, chunk of rows, block
// of 2^log_tx packs), rows chunked as in tile_rows.
Tiling tile_cols(int64_t N, int64_t S, int64_t cvn, int64_t max_split, int sms, bool forward) {
  Tiling t;
  t.log_tx = ceil_log2(imin(cvn, kSplitThreads));
  const int64_t ty = kSplitThreads >> t.log_tx;
  t.ncb = ceil_div(cvn, int64_t(1) << t.log_tx);
  const int64_t target = cols_target_tiles(sms, forward);
  int64_t split = ceil_div(target, N * t.ncb);
  split = imin(split, imax(1, S / (ty * kSplitUnroll * 2)));
  split = imax(1, imin(split, max_split));
  t.chunk = ceil_div(S, split);
  t.split = ceil_div(S, t.chunk);
  t.tiles = N * t.ncb * t.split;
  return t;
}

// ChannelsLast elementwise pass over `rows` rows of `cvn` packs: tiles of `chunk` rows x one block
// of 2^log_tx packs.
Tiling tile_apply_cols(int64_t rows, int64_t cvn, int sms, bool forward) {
  Tiling t;
  t.log_tx = ceil_log2(imin(cvn, kSplitThreads));
  const int64_t ty = kSplitThreads >> t.log_tx;
  t.ncb = ceil_div(cvn, int64_t(1) << t.log_tx);
  const int64_t target = cols_target_tiles(sms, forward);
  t.chunk = imax(ty * kSplitUnroll * 2, ceil_div(rows, ceil_div(target, t.ncb)));
  t.split = ceil_div(rows, t.chunk);
  t.tiles = t.split * t.ncb;
  return t;
}

// Pieces of the ChannelsLast reduction: the largest power of two dividing D, capped at the
// channel block width, so that pieces tile both groups and blocks.
int log_piece(int64_t D, int log_tx, int V) {
  const int64_t q = imin(D & -D, (int64_t(1) << log_tx) * V);
  return ceil_log2(q);
}

ReduceTiling plan_reduce(const Problem& p, bool grads, int sms) {
  ReduceTiling r;
  const int VW = pack_width(p.elem_bytes);
  const int64_t D = p.D();
  if (!p.channels_last) {
    // Forward: one row a group. Backward: one row a (n, c), pieces are channels.
    const int64_t rows = grads ? p.N * p.C : p.N * p.G;
    const int64_t len = grads ? p.S : D * p.S;
    r.V = VW > 1 && p.split_aligned && len % VW == 0 ? VW : 1;
    const int64_t max_split = grads ? imax(1, imin(kMaxEntries / D, kMaxParamEntries / p.N)) : kMaxEntries;
    r.t = tile_rows(rows, len / r.V, max_split, sms);
    r.entries = grads ? D * r.t.split : r.t.split;
  } else {
    r.V = VW > 1 && p.split_aligned && p.C % VW == 0 ? VW : 1;
    const int64_t cvn = p.C / r.V;
    const int log_tx = ceil_log2(imin(cvn, kSplitThreads));
    r.log_q = log_piece(D, log_tx, r.V);
    const int64_t pieces = D >> r.log_q;
    const int64_t max_split = grads ? imax(1, imin(kMaxEntries / pieces, kMaxParamEntries / p.N))
                                    : imax(1, kMaxEntries / pieces);
    r.t = tile_cols(p.N, p.S, cvn, max_split, sms, /*forward=*/!grads);
    r.entries = pieces * r.t.split;
  }
  return r;
}

}  // namespace plan
}  // namespace fusednorm
