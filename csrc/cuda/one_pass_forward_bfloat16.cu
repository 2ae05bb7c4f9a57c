// The one-pass forward kernels of at::BFloat16 (paths.h; docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(at::BFloat16);
FUSEDNORM_INSTANTIATE_COLS_ONE_PASS_RESIDENCY(at::BFloat16);
