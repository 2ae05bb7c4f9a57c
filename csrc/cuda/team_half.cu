// The team kernels of at::Half, both directions (paths.h; docs/design.md, "Source layout").
#include "cuda/group_norm_team.cuh"

FUSEDNORM_INSTANTIATE_TEAM(at::Half);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(at::Half);
