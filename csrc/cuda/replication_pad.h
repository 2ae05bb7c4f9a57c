// F.pad(input, padding, mode="replicate") on a CUDA tensor by fusednorm's kernels
// (replication_pad_kernel.cu; docs/design.md, "Replication pad"): the op's CUDA kernel, and, with
// no padding, layout_copy_kernel.cu's channels-first copy of an input whose rows are contiguous.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace fusednorm {

// Rows of this many bytes and more take the lines kernel (a warp an item of a row, 16-byte loads
// and stores); shorter ones the rows kernel (a thread 4 columns of 4 rows, element by element).
constexpr int64_t kPadLinesMinBytes = 256;

// The padded copy of `input` in its suggested memory format (ATen's pad where the kernels do not
// take the call, which also raises PyTorch's errors).
at::Tensor replication_pad_cuda(const at::Tensor& input, at::IntArrayRef padding);

// The same padded copy where the kernels take `input` as it lies; undefined where they do not (no
// dense copy first, no ATen fallback): for callers that have a better fallback of their own.
at::Tensor replication_pad_by_kernels(const at::Tensor& input, at::IntArrayRef padding);

}  // namespace fusednorm
