// at::BFloat16: the kernels of the split passes, path Split, both directions (paths.h). One
// translation unit per path and dtype, compiled in parallel, or together in kernels/bfloat16.cu on
// machines with few cores (docs/design.md, "Source layout").
#include "cuda/split_path.cuh"

FUSEDNORM_INSTANTIATE_SPLIT(at::BFloat16);
