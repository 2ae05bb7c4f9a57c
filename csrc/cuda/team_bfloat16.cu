// The team kernels of at::BFloat16, both directions (paths.h; docs/design.md, "Source layout").
#include "cuda/group_norm_team.cuh"

FUSEDNORM_INSTANTIATE_TEAM(at::BFloat16);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(at::BFloat16);
