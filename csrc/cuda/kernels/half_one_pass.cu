// at::Half: the kernels of the one-pass forward, paths Registers, Shared and Cluster (paths.h). One
// translation unit per path and dtype, compiled in parallel, or together in kernels/half.cu on
// machines with few cores (docs/design.md, "Source layout").
#include "cuda/group_norm_one_pass.cuh"

FUSEDNORM_INSTANTIATE_ONE_PASS_FORWARD(at::Half);
