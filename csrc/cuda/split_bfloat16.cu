// The split-pass kernels of at::BFloat16, both directions (paths.h; docs/design.md, "Split passes").
#include "cuda/split_path.cuh"

FUSEDNORM_INSTANTIATE_SPLIT(at::BFloat16);
