// at::Half: the kernels of the channels-last sweep forward, path ColsSweep (paths.h). One translation unit
// per path and dtype, compiled in parallel, or together in kernels/half.cu on machines with few
// cores (docs/design.md, "Source layout").
#include "cuda/cols_sweep_path.cuh"

FUSEDNORM_INSTANTIATE_COLS_SWEEP(at::Half);
