// The one-CTA backward kernels of at::BFloat16 (paths.h; docs/design.md, "Source layout").
#include "cuda/one_cta_backward.cuh"

FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(at::BFloat16);
