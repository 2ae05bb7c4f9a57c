// The one-pass forward kernels of at::Half (paths.h; docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(at::Half);
FUSEDNORM_INSTANTIATE_COLS_ONE_PASS_RESIDENCY(at::Half);
