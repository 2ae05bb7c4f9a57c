// Every path's kernels of double (paths.h), in one translation unit whatever the machine: the split
// passes are its only kernels (docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"
#include "cuda/group_norm_team.cuh"
#include "cuda/one_cta_backward.cuh"
#include "cuda/split_path.cuh"

// double has no one-pass, one-CTA or team kernels (no 16-byte packs of it): those entries only
// assert, and the planner never picks them for double.
FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(double);
FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(double);
FUSEDNORM_INSTANTIATE_TEAM(double);
FUSEDNORM_INSTANTIATE_SPLIT(double);
