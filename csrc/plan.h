// The kernel planner: which CUDA path a call takes, and that path's launch parameters.
//
// One function per direction maps (sizes, layout, dtype, epilogue, device properties, overrides)
// to a Plan; the CUDA launchers only carry a plan out. Every threshold that chooses a path lives
// in plan.cpp, with its reason (docs/design.md, "The planner"). The planner is pure host C++: it
// needs neither nvcc nor a GPU, is compiled into every build (CPU-only ones too), and is exposed
// as the private op fusednorm::_plan so that CPU tests pin the plan of every benchmark shape.
//
// What the planner cannot compute from sizes alone, how many CTAs of a given kernel the device
// keeps resident, it asks through the Residency callbacks: the CUDA side answers them with
// occupancy queries on the very kernel the plan would launch, the _plan op with a model of the
// device (plan.cpp, modeled_residency).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

namespace fusednorm {
namespace plan {

// ---------------------------------------------------------------------------------------------
// Kernel-path overrides (the FUSEDNORM_* environment variables, docs/design.md, "Kernel
// overrides"). Read once into one struct; reload_overrides() reads them again (the tests switch
// paths at run time through fusednorm.kernel_paths, which calls the _reload_kernel_overrides op).
// A field left at kUnset keeps the planner's default. The tuning-only knobs (timing experiments,
// no test needs them) are read only in a build with -DFUSEDNORM_TUNING_KNOBS.
constexpr int64_t kUnset = -1;

struct Overrides {
  // Forcing a path (the tests' TEST_PATHS) and the variants the tests cover.
  int64_t one_pass_max_bytes = kUnset;  // largest one-pass group; set: forced (0: off)
  int64_t one_pass_registers = kUnset;  // 0: no register forward
  int64_t registers_late = kUnset;      // 0: the register forward without parameters loads operands early
  int64_t team_forward = kUnset;        // 0: off, 1: every group the team kernel can take
  int64_t team_backward = kUnset;       // the same for the backward
  int64_t sweep_forward = kUnset;       // 0: off, 1: every group the sweep kernels can take
  int64_t team_prefetch = kUnset;       // k / 8 of the next chunk prefetched into L2 (0..8)
  int64_t team_replicas = kUnset;       // team kernels: copies of each CTA's partials (1..16)
  int64_t param_grad_parts = kUnset;    // CTAs of the parameter-gradient cluster (1..8)
  int64_t cols_pipeline = kUnset;       // channels-last shared forward: 0 one buffer, 1 two with operands too
  int64_t cols_span = kUnset;           // channels-last shared forward: at most this many groups a CTA
  int64_t cols_sweep = kUnset;          // 0: off, 1: every channels-last group the channels-last sweep can take
  // Tuning only (FUSEDNORM_TUNING_KNOBS builds).
  int64_t one_pass_max_cluster = kUnset;  // most CTAs of a one-pass cluster
  int64_t team_cta_kb = kUnset;           // shared memory a team CTA holds, in KB
  int64_t team_count = kUnset;            // teams of the team grid (at most those the grid holds)
  int64_t cols_act_kernel = kUnset;       // 0: channels-last activation-only split passes in the shared EPI kernels
  int64_t backward_threads = kUnset;      // one-CTA backward: threads a CTA (256 or 512)
  int64_t cols_sweep_waves = kUnset;         // channels-last sweep: moments tiles in waves of resident CTAs
  int64_t cols_sweep_output_waves = kUnset;  // the same for its output tiles

  std::string to_string() const;
};

// Whether this build reads the tuning-only knobs.
bool tuning_knobs_compiled();

// The overrides as last read (read on first use).
const Overrides& overrides();

// Reads the environment again; returns the new overrides.
const Overrides& reload_overrides();

// ---------------------------------------------------------------------------------------------
// Inputs.

// What the planner needs of the device (cudaDeviceProp's fields of the same meaning).
struct DeviceInfo {
  int sms = 132;
  int major = 9, minor = 0;
  int64_t smem_optin = 227 * 1024;       // sharedMemPerBlockOptin
  int64_t smem_per_sm = 228 * 1024;      // sharedMemPerMultiprocessor
  int64_t l2_bytes = 60 * 1024 * 1024;   // l2CacheSize
  bool cooperative_launch = true;
  bool clusters_of_16 = true;  // the device schedules clusters of 16 CTAs of 64 KB (non-portable size)

  std::string to_string() const;
};

// An H200's properties (the default of the _plan op without a GPU).
DeviceInfo h200();

// Resident CTAs / clusters of the kernel a plan would launch; 0: the device cannot say.
struct Residency {
  // Team kernel of the planned direction, CTAs an SM with `smem` bytes of shared memory each.
  std::function<int(int64_t smem)> team_ctas_per_sm;
  // Channels-last shared-memory forward kernel of `pack_bytes` packs, CTAs an SM with `smem`
  // bytes each.
  std::function<int(int pack_bytes, int64_t smem)> cols_ctas_per_sm;
  // Parameter-gradient finalize (per_sample: its per-sample instantiation), clusters of `parts`
  // CTAs the device runs at once.
  std::function<int(bool per_sample, int parts)> param_grad_clusters;
};

// The residency of the kernels on `dev` as modeled from its properties (the _plan op's, where no
// driver answers): register-limited CTAs from the kernels' launch bounds, shared memory as the
// hardware allocates it, clusters within graphics processing clusters of equal SMs.
Residency modeled_residency(const DeviceInfo& dev);

// Activations as epilogue.h numbers them.
enum class Act : int { None = 0, SiLU, GELU, GELUTanh, ReLU, LeakyReLU, Mish };

// The activations the specialised kernels are instantiated for (none, SiLU, ReLU: the register,
// channels-last one-pass, channels-last activation kernels and the team forward with input_bias;
// dispatch_common_activation launches them); the others take a more general path.
inline bool common_activation(Act a) { return a == Act::None || a == Act::SiLU || a == Act::ReLU; }

// One call's problem: the input viewed as (N, C, S) with G groups (group_norm.h).
struct Problem {
  int64_t N = 1, C = 1, S = 1, G = 1;
  int elem_bytes = 4;  // 2 (float16, bfloat16), 4 (float32), 8 (float64)
  bool bfloat16 = false;
  bool channels_last = false;
  Act act = Act::None;
  // The epilogue's operands and the affine parameters present.
  bool weight = false, bias = false, scale = false, shift = false;
  bool residual = false, multiplier = false;
  bool multiplier_is_residual = false;  // one tensor for both (read once)
  // Every tensor-sized pointer the one-pass and team kernels would take is 16-byte aligned.
  bool aligned = true;
  // The same for the split passes' reduction (its own operand set).
  bool split_aligned = true;
  bool backward = false;
  // Backward: the gradients wanted (input, weight, bias, scale, shift, residual, multiplier).
  std::array<bool, 7> mask{{true, true, true, false, false, false, false}};
  // The team grid was refused at launch (another context holds part of the device): plan anew
  // without it.
  bool team_refused = false;
  // Forward, ChannelsFirst: x's rows (n, c) are contiguous, but not back to back (the frames of
  // an NCDHW video viewed per frame; docs/design.md, "Sweep path"). Only the sweep reads them
  // where they lie; plan_forward then plans it or nothing (Path::None), and the caller copies x
  // dense and plans again.
  bool strided_rows = false;

  int64_t D() const { return C / G; }
};

// ---------------------------------------------------------------------------------------------
// Outputs.

enum class Path {
  Split,          // reduce / finalize / apply passes (docs/design.md, "Split passes")
  Registers,      // forward, one CTA a group held in registers ("Register kernel")
  Shared,         // forward, one CTA a group in shared memory ("One-pass forward")
  Cluster,        // forward, a cluster of CTAs shares a group ("Clusters")
  ColsShared,     // forward, channels-last groups in shared memory ("Channels-last one-pass")
  Team,           // either direction, a team of persistent CTAs shares a group ("Team path")
  OneCta,         // backward, one CTA a group in shared memory ("One-CTA backward")
  Sweep,          // forward, two streaming launches over tiles of a group ("Sweep path")
  ColsSweep,      // forward, channels-last: streaming launches over tiles of rows ("Channels-last sweep")
  None,           // forward of strided rows the sweep does not take (Problem::strided_rows)
};

const char* path_name(Path p);

// Whether the sweep reads strided rows (Problem::strided_rows) of S elements, V elements a pack:
// rows of whole packs, long enough to keep a CTA busy (plan.cpp, kSweepStridedMinRowPacks). The
// dispatcher asks before it leaves an input strided; plan_forward again.
bool sweep_reads_strided_rows(int64_t S, int V);

// Rows (or columns) of the split passes cut into tiles (docs/design.md, "Split passes").
struct Tiling {
  int log_tx = 0;
  int64_t split = 1, chunk = 1, ncb = 1, tiles = 1;
};

struct Plan {
  Path path = Path::Split;
  // Registers: R packs a thread, E extra operand streams held, `threads` a CTA, the late
  // variant (operands loaded after the moments). ColsSweep: `threads` a CTA.
  int reg_packs = 0, reg_streams = 0, threads = 0;
  bool late = false;
  // Shared / Cluster: CTAs a group, packs a CTA, dynamic shared memory a CTA.
  int cluster = 1;
  int64_t chunk = 0;
  int64_t smem = 0;
  // ColsShared: groups a CTA, bytes a pack, the grid, packs a buffer (0: one buffer, no pipeline).
  int span = 1, pack_bytes = 0;
  int64_t grid = 0, buffer_packs = 0;
  // Team: teams, CTAs a team, packs a CTA (`chunk`), copies of the partials, packs prefetched.
  int teams = 0, team_size = 0, replicas = 1;
  int64_t prefetch = 0;
  // Team / OneCta backward: log2 threads a channel segment; team: chunks a channel overlaps.
  int log_seg = 0;
  int64_t channel_split = 1;
  // Split passes, channels-last (or S == 1) with an activation alone: the apply pass's kernel of
  // that activation, and in the backward the reduce pass's too.
  bool cols_act_kernel = false;
  // Backward: the split passes' reduce tiling (path Split), and CTAs summing each block of 32
  // channels' parameter gradients (0: no parameter gradient wanted). Sweep: the tiles. ColsSweep:
  // the moments kernel's tiles (`reduce`) and the output kernel's (`output`).
  Tiling reduce, output;
  int param_grad_parts = 0;

  std::string to_string() const;
};

Plan plan_forward(const Problem& p, const DeviceInfo& dev, const Residency& res, const Overrides& o);
Plan plan_backward(const Problem& p, const DeviceInfo& dev, const Residency& res, const Overrides& o);
inline Plan plan_call(const Problem& p, const DeviceInfo& dev, const Residency& res, const Overrides& o) {
  return p.backward ? plan_backward(p, dev, res, o) : plan_forward(p, dev, res, o);
}

// ---------------------------------------------------------------------------------------------
// Pieces the launchers share with the planner (docs/design.md, "Split passes").

constexpr int kSplitThreads = 256;  // the split kernels' CTA (group_norm_kernel.cu's kThreads)
constexpr int kSplitUnroll = 4;     // packs a thread loads before using any
constexpr int kSplitBlocksPerSM = 2048 / kSplitThreads;
constexpr int kSplitMinBlocks = 2;  // CTAs an SM the kernels' register cap guarantees (kMinBlocks)
constexpr int kApplyRowsPlainThreads = 128;  // the plain apply-rows kernels' CTA (tile_apply_rows)
constexpr int64_t kMaxEntries = 4096;      // partials one finalize item merges
// The channels-last sweep's CTAs (at most; whole rows of C / V packs) and the CTAs an SM their
// register caps guarantee (cols_sweep_path.cuh's launch bounds), for the moments and the output
// kernels, and the fewest rows the planner gives a thread. The output kernel keeps four
// coefficients a channel: in CTAs of 512 threads (64 registers) ptxas spilled them.
constexpr int kColsSweepThreads = 512;
constexpr int kColsSweepBlocksPerSM = 2;
constexpr int kColsSweepOutputThreads = 256;
constexpr int kColsSweepOutputBlocksPerSM = 3;
constexpr int kColsSweepUnroll = 4;
// Threads of a channels-last sweep CTA of at most `max_threads` over rows of `cpr` packs.
constexpr int cols_sweep_threads(int max_threads, int64_t cpr) {
  return static_cast<int>((max_threads / cpr) * cpr);
}
constexpr int64_t kMaxParamEntries = 512;  // the same for the per-channel parameter gradients

int ceil_log2(int64_t v);
// Tiles wanted per split pass / CTAs launched for `tiles` tiles.
int64_t target_tiles(int sms);
int grid_for(int64_t tiles, int sms);
Tiling tile_rows(int64_t rows, int64_t lenv, int64_t max_split, int sms);
// The ChannelsFirst apply pass: short tiles of a row, a CTA a tile (grid_of_every_tile);
// `epilogue`: the EPI kernels', `sixteen_bit`: of 2-byte elements (plan.cpp; docs/design.md,
// "Split passes").
Tiling tile_apply_rows(int64_t rows, int64_t lenv, bool backward, bool epilogue, bool sixteen_bit);
int grid_of_every_tile(int64_t tiles);
// ChannelsLast tiling; `forward`: the forward's passes, whose tiles are counted in resident CTAs
// (plan.cpp, cols_target_tiles).
Tiling tile_cols(int64_t N, int64_t S, int64_t cvn, int64_t max_split, int sms, bool forward);
Tiling tile_apply_cols(int64_t rows, int64_t cvn, int sms, bool forward);
int log_piece(int64_t D, int log_tx, int V);

// The split passes' reduction tiling for problem `p` (pieces a group in `entries`).
struct ReduceTiling {
  Tiling t;
  int V = 1, log_q = 0;
  int64_t entries = 0;
};
ReduceTiling plan_reduce(const Problem& p, bool grads, int sms);

}  // namespace plan
}  // namespace fusednorm
