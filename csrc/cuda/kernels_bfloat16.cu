// Every path's kernels of at::BFloat16, as planned (paths.h): one translation unit per dtype, so that the
// build compiles the dtypes in parallel while each TU's fixed cost (the ATen headers, about half
// a minute) is paid only a few times (docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"
#include "cuda/group_norm_team.cuh"
#include "cuda/one_cta_backward.cuh"
#include "cuda/split_path.cuh"

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(at::BFloat16);
FUSEDNORM_INSTANTIATE_COLS_ONE_PASS_RESIDENCY(at::BFloat16);
FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(at::BFloat16);
FUSEDNORM_INSTANTIATE_TEAM(at::BFloat16);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(at::BFloat16);
FUSEDNORM_INSTANTIATE_SPLIT(at::BFloat16);
