// Every path's kernels of float in one translation unit: what setup.py compiles on machines with
// few cores, where each translation unit's fixed cost (the headers, ~20 s) would outweigh the
// parallelism of the per-path files it includes (docs/design.md, "Source layout").
#include "cuda/kernels/float_one_pass.cu"
#include "cuda/kernels/float_cols_one_pass.cu"
#include "cuda/kernels/float_team.cu"
#include "cuda/kernels/float_split.cu"
#include "cuda/kernels/float_cols_sweep.cu"
