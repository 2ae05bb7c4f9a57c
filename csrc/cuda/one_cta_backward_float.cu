// The one-CTA backward kernels of float (paths.h; docs/design.md, "Source layout").
#include "cuda/one_cta_backward.cuh"

FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(float);

// double has no one-CTA backward kernel: its entry only asserts.
FUSEDNORM_INSTANTIATE_ONE_CTA_BACKWARD(double);
