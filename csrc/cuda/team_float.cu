// The team kernels of float, both directions (paths.h; docs/design.md, "Source layout").
#include "cuda/group_norm_team.cuh"

FUSEDNORM_INSTANTIATE_TEAM(float);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(float);

// double has no team kernels: its entries only assert.
FUSEDNORM_INSTANTIATE_TEAM(double);
