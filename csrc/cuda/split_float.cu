// The split-pass kernels of float, both directions (paths.h; docs/design.md, "Split passes").
#include "cuda/split_path.cuh"

FUSEDNORM_INSTANTIATE_SPLIT(float);
