// Every path's kernels of at::Half, as planned (paths.h): one translation unit per dtype, so that the
// build compiles the dtypes in parallel while each TU's fixed cost (the ATen headers, about half
// a minute) is paid only a few times (docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"
#include "cuda/group_norm_team.cuh"
#include "cuda/one_cta_backward.cuh"
#include "cuda/split_path.cuh"

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(at::Half);
FUSEDNORM_INSTANTIATE_COLS_ONE_PASS_RESIDENCY(at::Half);
FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(at::Half);
FUSEDNORM_INSTANTIATE_TEAM(at::Half);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(at::Half);
FUSEDNORM_INSTANTIATE_SPLIT(at::Half);
