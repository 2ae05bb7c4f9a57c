// The CUDA kernel of replication_pad (ops.cpp): F.pad(input, padding, mode="replicate") on a
// contiguous floating-point input, a copy in which each output row reads its clamped source row
// (docs/design.md, "Replication pad"). Every other call (another layout or dtype, negative
// padding, an empty dimension, 2^30 output rows or more) is ATen's own pad, which also raises
// PyTorch's errors for bad arguments.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/pad.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace fusednorm {
namespace {

// Output rows a thread copies, and the columns of each (kCols * blockDim.x a pass over a row):
// 16 loads a thread in flight before its stores, the bytes in flight an SM needs at the copy rate
// with 2-byte elements, whose rows (an odd left padding) allow no wider access.
constexpr int kRows = 4;
constexpr int kCols = 4;
constexpr int kPadThreads = 256;

// The padded problem as (planes, D, H, W), the padded dimensions right-aligned (a 1-d or 2-d
// padding has D = 1, or D = H = 1, and no padding there).
struct PadGeometry {
  at::cuda::detail::IntDivider<unsigned> out_h, out_d;  // output rows: (plane, d, h) of one index
  unsigned rows;                                        // planes * out_d * out_h
  int D, H, W, out_w;
  int front, top, left;  // padding before each dimension
};

__device__ __forceinline__ int clamp_index(int i, int size) {
  return min(max(i, 0), size - 1);
}

// Element type T: the dtype's bits (uint16_t, uint32_t, uint64_t), copied unchanged.
template <typename T>
__global__ void __launch_bounds__(kPadThreads) replication_pad_kernel(const T* __restrict__ in, T* __restrict__ out,
    const PadGeometry g) {
  const unsigned first = blockIdx.x * (blockDim.y * kRows) + threadIdx.y;
  const T* src[kRows];
  T* dst[kRows];
  bool live[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const unsigned row = first + j * blockDim.y;
    live[j] = row < g.rows;
    const auto h = g.out_h.divmod(live[j] ? row : 0u);
    const auto d = g.out_d.divmod(h.div);
    const int64_t plane = d.div;
    const int64_t source_row =
        (plane * g.D + clamp_index(static_cast<int>(d.mod) - g.front, g.D)) * g.H +
        clamp_index(static_cast<int>(h.mod) - g.top, g.H);
    src[j] = in + source_row * g.W;
    dst[j] = out + static_cast<int64_t>(row) * g.out_w;
  }
  for (int w0 = threadIdx.x; w0 < g.out_w; w0 += kCols * blockDim.x) {
    T v[kRows][kCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int w = w0 + i * blockDim.x;
        if (live[j] && w < g.out_w) v[j][i] = src[j][clamp_index(w - g.left, g.W)];
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int w = w0 + i * blockDim.x;
        if (live[j] && w < g.out_w) dst[j][w] = v[j][i];
      }
    }
  }
}

// Whether the kernel takes the call: what ATen's pad would accept (a batched or unbatched input
// of the padding's dimensions), non-negative padding, a contiguous floating-point input with no
// empty dimension, and sizes well inside the kernel's 32-bit row and column indices.
bool kernel_takes(const at::Tensor& input, at::IntArrayRef padding) {
  const int64_t dims = static_cast<int64_t>(padding.size()) / 2;
  if (padding.size() % 2 != 0 || dims < 1 || dims > 3) return false;
  if (input.dim() != dims + 1 && input.dim() != dims + 2) return false;
  const auto dtype = input.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat && dtype != at::kDouble) return false;
  if (!input.is_contiguous() || input.numel() == 0) return false;
  if (std::any_of(padding.begin(), padding.end(), [](int64_t p) { return p < 0; })) return false;
  constexpr int64_t kMax = std::numeric_limits<int>::max() / 2;
  int64_t rows = 1;
  for (int64_t k = 0; k < input.dim() - 1; ++k) {
    const int64_t from_end = input.dim() - 1 - k;  // 1: H, 2: D
    const int64_t size = input.size(k) + (from_end <= dims - 1 ? padding[2 * from_end] + padding[2 * from_end + 1] : 0);
    if (size > kMax) return false;
    rows *= size;
    if (rows > kMax) return false;
  }
  return input.size(-1) + padding[0] + padding[1] <= kMax;
}

at::Tensor replication_pad_cuda(const at::Tensor& input, at::IntArrayRef padding) {
  if (!kernel_takes(input, padding)) return at::pad(input, padding, "replicate");
  const int64_t dims = static_cast<int64_t>(padding.size()) / 2;
  const auto pad_of = [&](int64_t from_end, int64_t side) {  // from_end 0: W, 1: H, 2: D
    return from_end < dims ? static_cast<int>(padding[2 * from_end + side]) : 0;
  };
  const auto size_of = [&](int64_t from_end) {
    return from_end < input.dim() - 1 ? static_cast<int>(input.size(-1 - from_end)) : 1;
  };
  std::vector<int64_t> out_sizes = input.sizes().vec();
  for (int64_t k = 0; k < dims; ++k) out_sizes[input.dim() - 1 - k] += pad_of(k, 0) + pad_of(k, 1);
  at::Tensor out = at::empty(out_sizes, input.options());
  PadGeometry g;
  g.W = size_of(0);
  g.H = dims >= 2 ? size_of(1) : 1;
  g.D = dims >= 3 ? size_of(2) : 1;
  g.left = pad_of(0, 0);
  g.top = pad_of(1, 0);
  g.front = pad_of(2, 0);
  g.out_w = g.W + g.left + pad_of(0, 1);
  const unsigned out_h = static_cast<unsigned>(g.H + g.top + pad_of(1, 1));
  const unsigned out_d = static_cast<unsigned>(g.D + g.front + pad_of(2, 1));
  g.out_h = at::cuda::detail::IntDivider<unsigned>(out_h);
  g.out_d = at::cuda::detail::IntDivider<unsigned>(out_d);
  g.rows = static_cast<unsigned>(out.numel() / g.out_w);
  // Threads along a row: a whole number of warps covering it in one pass of kCols columns where
  // it fits; the rest of the block's threads take other rows.
  const int tx = std::min(kPadThreads, (g.out_w + kCols * 32 - 1) / (kCols * 32) * 32);
  const int ty = std::max(1, kPadThreads / tx);
  const int64_t blocks = (static_cast<int64_t>(g.rows) + ty * kRows - 1) / (ty * kRows);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto bits) {
    using T = decltype(bits);
    replication_pad_kernel<T><<<static_cast<unsigned>(blocks), dim3(tx, ty), 0, stream>>>(
        static_cast<const T*>(input.data_ptr()), static_cast<T*>(out.data_ptr()), g);
  };
  switch (input.element_size()) {
    case 2: launch(uint16_t()); break;
    case 4: launch(uint32_t()); break;
    default: launch(uint64_t()); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("replication_pad", &replication_pad_cuda);
}

}  // namespace fusednorm
