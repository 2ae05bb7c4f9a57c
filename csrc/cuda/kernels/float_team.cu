// float: the kernels of the team path, both directions, and the one-CTA backward, path OneCta
// (paths.h). One translation unit per path and dtype, compiled in parallel, or together in
// kernels/float.cu on machines with few cores (docs/design.md, "Source layout").
#include "cuda/group_norm_team.cuh"
#include "cuda/one_cta_backward.cuh"

FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(float);
FUSEDNORM_INSTANTIATE_TEAM(float);
FUSEDNORM_INSTANTIATE_TEAM_RESIDENCY(float);
