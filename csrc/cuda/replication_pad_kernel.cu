// The CUDA kernels of replication_pad (ops.cpp): F.pad(input, padding, mode="replicate") on a
// floating-point input whose rows are contiguous (any strides before them) or dense in
// channels-last, a copy in which each output row reads its clamped source row, the output in the
// input's suggested memory format (docs/design.md, "Replication pad"). Every other call (another
// layout or dtype, negative padding, an empty dimension, 2^30 items or more) is ATen's own pad,
// which also raises PyTorch's errors for bad arguments, its output then put in that format.
#include "cuda/replication_pad.h"

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
#include <optional>
#include <vector>

namespace fusednorm {
namespace {

// Two kernels (docs/design.md, "Replication pad"). Rows of kPadLinesMinBytes and more: a warp copies
// an item, at most kChunkBytes of an output row; it stages the input elements the item reads in
// its shared-memory buffer with 16-byte loads, then writes the item with 16-byte stores, each lane
// gathering its line's elements from the buffer (an odd left padding puts an output row at 2-byte
// offsets from its source row, so that no access wide enough for the copy rate reads and writes
// the same elements). Shorter rows, where a warp's one row a round in flight is too few bytes: a
// thread copies kCols columns of kRows rows, element by element, its 16 loads issued before its
// stores. A channels-last input moves its channel vectors whole, in units of up to 16 bytes, kUnits
// of them a thread in flight.
constexpr int kPadThreads = 256;
constexpr int kPadWarps = kPadThreads / 32;
constexpr int kChunkBytes = 2048;
constexpr int kLine = 16;
// A buffer holds an item's input and the part of a line before its first element.
constexpr int kBufferLines = (kChunkBytes + 2 * kLine) / kLine;
constexpr int kRows = 4;
constexpr int kCols = 4;
constexpr int kUnits = 4;

// The padded problem as (planes, D, H, W), the padded dimensions right-aligned (a 1-d or 2-d
// padding has D = 1, or D = H = 1, and no padding there); the lines kernel's items are (output
// row, chunk), the rows kernel's output rows (one chunk a row), the channels-last kernel's the
// units of the output, each row's out_w channel vectors of vector_units units. The row kernels
// read an input row through the input's strides: a plane is (outer, inner), the dimensions before
// D (inner 1 where there is one).
struct PadGeometry {
  at::cuda::detail::IntDivider<unsigned> chunks, out_h, out_d;  // an item's (row, chunk); a row's (plane, d, h)
  at::cuda::detail::IntDivider<unsigned> inner;  // a plane's (outer, inner)
  int64_t outer_stride, inner_stride, d_stride, h_stride;  // the input's, in elements
  at::cuda::detail::IntDivider<unsigned> vector_units, out_w_vectors;  // channels-last: a unit's (vector, unit); a vector's (row, w)
  unsigned items;
  int D, H, W, out_w, chunk;  // chunk: elements an item (kChunkBytes of them)
  int front, top, left;       // padding before each dimension
};

__device__ __forceinline__ int clamp_index(int i, int size) {
  return min(max(i, 0), size - 1);
}

// The row of a dense input that output row `row` copies (its index among the input's rows).
__device__ __forceinline__ int64_t source_row(const PadGeometry& g, unsigned row) {
  const auto h = g.out_h.divmod(row);
  const auto d = g.out_d.divmod(h.div);
  return (static_cast<int64_t>(d.div) * g.D + clamp_index(static_cast<int>(d.mod) - g.front, g.D)) * g.H +
         clamp_index(static_cast<int>(h.mod) - g.top, g.H);
}

// The first element of the input row that output row `row` copies, through the input's strides.
__device__ __forceinline__ int64_t source_row_offset(const PadGeometry& g, unsigned row) {
  const auto h = g.out_h.divmod(row);
  const auto d = g.out_d.divmod(h.div);
  const auto plane = g.inner.divmod(d.div);
  return plane.div * g.outer_stride + plane.mod * g.inner_stride +
         clamp_index(static_cast<int>(d.mod) - g.front, g.D) * g.d_stride +
         clamp_index(static_cast<int>(h.mod) - g.top, g.H) * g.h_stride;
}

// Element type T in both: the dtype's bits (uint16_t, uint32_t, uint64_t), copied unchanged.
template <typename T>
__global__ void __launch_bounds__(kPadThreads) replication_pad_lines_kernel(const T* __restrict__ in,
    T* __restrict__ out, const PadGeometry g) {
  constexpr int E = kLine / static_cast<int>(sizeof(T));  // elements a line
  __shared__ uint4 buffers[kPadWarps][kBufferLines];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  T* buf = reinterpret_cast<T*>(buffers[warp]);
  const unsigned stride = gridDim.x * kPadWarps;
  for (unsigned item = blockIdx.x * kPadWarps + warp; item < g.items; item += stride) {
    const auto rc = g.chunks.divmod(item);
    const T* src = in + source_row_offset(g, rc.div);
    T* dst = out + static_cast<int64_t>(rc.div) * g.out_w;
    const int c0 = static_cast<int>(rc.mod) * g.chunk;  // the item's output elements [c0, c1)
    const int c1 = min(c0 + g.chunk, g.out_w);
    const int i0 = clamp_index(c0 - g.left, g.W);  // and the input elements they read, [i0, i1)
    const int i1 = clamp_index(c1 - 1 - g.left, g.W) + 1;
    // buf[k] is src[base + k], base the first element of i0's line: lines whole within [i0, i1)
    // by 16-byte loads, the partial lines' elements one at a time.
    const int base = i0 - static_cast<int>(reinterpret_cast<uintptr_t>(src + i0) % kLine / sizeof(T));
    const int first_line = base == i0 ? 0 : 1;
    const int end_line = max((i1 - base) / E, first_line);
    const uint4* src_lines = reinterpret_cast<const uint4*>(src + base);
    for (int v = first_line + lane; v < end_line; v += 32) buffers[warp][v] = src_lines[v];
    for (int k = i0 + lane; k < min(i1, base + first_line * E); k += 32) buf[k - base] = src[k];
    for (int k = max(i0, base + end_line * E) + lane; k < i1; k += 32) buf[k - base] = src[k];
    __syncwarp();
    const auto value = [&](int w) { return buf[clamp_index(w - g.left, g.W) - base]; };
    // Output elements to dst's next 16-byte line one at a time, then whole lines, then the rest.
    const int lead = static_cast<int>((kLine - reinterpret_cast<uintptr_t>(dst + c0) % kLine) % kLine / sizeof(T));
    const int body = c0 + min(lead, c1 - c0);
    const int lines = (c1 - body) / E;
    if (lane < body - c0) dst[c0 + lane] = value(c0 + lane);
    uint4* dst_lines = reinterpret_cast<uint4*>(dst + body);
    for (int v = lane; v < lines; v += 32) {
      union {
        uint4 line;
        T e[E];
      } u;
#pragma unroll
      for (int e = 0; e < E; ++e) u.e[e] = value(body + v * E + e);
      dst_lines[v] = u.line;
    }
    for (int w = body + lines * E + lane; w < c1; w += 32) dst[w] = value(w);
    __syncwarp();  // the buffer is the next item's
  }
}

// Blocks of (tx, ty) threads, tx along a row.
template <typename T>
__global__ void __launch_bounds__(kPadThreads) replication_pad_rows_kernel(const T* __restrict__ in,
    T* __restrict__ out, const PadGeometry g) {
  const unsigned first = blockIdx.x * (blockDim.y * kRows) + threadIdx.y;
  const T* src[kRows];
  T* dst[kRows];
  bool live[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const unsigned row = first + j * blockDim.y;
    live[j] = row < g.items;
    src[j] = in + source_row_offset(g, live[j] ? row : 0u);
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

// Channels-last input: memory (planes, D, H, W, C), padded in D, H and W; U the unit's bits (16, 8,
// 4 or 2 bytes), a whole number of them a channel vector. Unit i of the output copies the unit of
// its vector's source: the same unit of the vector at the clamped (d, h, w).
template <typename U>
__global__ void __launch_bounds__(kPadThreads) replication_pad_channels_last_kernel(const U* __restrict__ in,
    U* __restrict__ out, const PadGeometry g) {
  const unsigned stride = gridDim.x * kPadThreads * kUnits;
  for (unsigned first = blockIdx.x * kPadThreads * kUnits + threadIdx.x; first < g.items; first += stride) {
    U v[kUnits];
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {  // the loads first, all in flight together
      const unsigned i = first + k * kPadThreads;
      if (i < g.items) {
        const auto unit = g.vector_units.divmod(i);
        const auto vector = g.out_w_vectors.divmod(unit.div);
        const int64_t source_vector =
            source_row(g, vector.div) * g.W + clamp_index(static_cast<int>(vector.mod) - g.left, g.W);
        v[k] = in[source_vector * g.vector_units.divisor + unit.mod];
      }
    }
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const unsigned i = first + k * kPadThreads;
      if (i < g.items) out[i] = v[k];
    }
  }
}

// The dtypes the kernels copy (as 16, 32 and 64-bit words).
bool kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble;
}

// The padded output's sizes when the kernels take the call: what ATen's pad would accept (a
// batched or unbatched input of the padding's dimensions), non-negative padding, a floating-point
// input with no empty dimension, whose suggested memory format `format` is contiguous and whose
// rows are contiguous (any strides before them: the frames of a video viewed back, as Mochi's
// decoder pads them), or dense in channels-last (a batched input padded in every spatial
// dimension), and sizes well inside the kernels' 32-bit item and column indices. Nothing when
// they do not: ATen's pad takes the call.
std::optional<std::vector<int64_t>> kernel_output_sizes(
    const at::Tensor& input, at::IntArrayRef padding, at::MemoryFormat format) {
  const int64_t dims = static_cast<int64_t>(padding.size()) / 2;
  if (padding.size() % 2 != 0 || dims < 1 || dims > 3) return std::nullopt;
  if (input.dim() != dims + 1 && input.dim() != dims + 2) return std::nullopt;
  if (!kernel_dtype(input.scalar_type()) || input.numel() == 0) return std::nullopt;
  const bool channels_last = format != at::MemoryFormat::Contiguous;
  const bool rows_contiguous = input.stride(-1) == 1 || input.size(-1) == 1;
  if (channels_last ? !input.is_contiguous(format) : !rows_contiguous) return std::nullopt;
  if (channels_last && input.dim() != dims + 2) return std::nullopt;
  if (std::any_of(padding.begin(), padding.end(), [](int64_t p) { return p < 0; })) return std::nullopt;
  std::vector<int64_t> sizes = input.sizes().vec();
  for (int64_t k = 0; k < dims; ++k) sizes[input.dim() - 1 - k] += padding[2 * k] + padding[2 * k + 1];
  constexpr int64_t kMax = std::numeric_limits<int>::max() / 2;
  int64_t rows = 1;
  for (size_t k = 0; k + 1 < sizes.size(); ++k) {
    if (sizes[k] > kMax) return std::nullopt;
    rows *= sizes[k];
    if (rows > kMax) return std::nullopt;
  }
  const int64_t out_w = sizes.back();
  const int64_t chunk = kChunkBytes / static_cast<int64_t>(input.element_size());
  if (out_w > kMax || rows * ((out_w + chunk - 1) / chunk) > kMax) return std::nullopt;
  if (channels_last && rows * out_w > kMax) return std::nullopt;  // its items: at most the output's elements
  return sizes;
}

// The unit of the channels-last kernel: the widest of 16, 8, 4 and 2 bytes, at least an element,
// that divides a channel vector's bytes and the input's address (the output's is 16-byte aligned).
int channels_last_unit(const at::Tensor& input) {
  const int64_t vector_bytes = input.size(1) * static_cast<int64_t>(input.element_size());
  const auto address = reinterpret_cast<uintptr_t>(input.data_ptr());
  int unit = 16;
  while (unit > input.element_size() && (vector_bytes % unit != 0 || address % unit != 0)) unit /= 2;
  return unit;
}

// The padded copy of `input` by the kernels, `out_sizes` its sizes (kernel_output_sizes of the
// input in its suggested memory format `format`).
at::Tensor launch_replication_pad(const at::Tensor& input, at::IntArrayRef padding, at::MemoryFormat format,
    const std::vector<int64_t>& out_sizes) {
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(out_sizes, input.options().memory_format(format));
  const int64_t dims = static_cast<int64_t>(padding.size()) / 2;
  // Sizes and leading pads by dimension from the end (0: W, 1: H, 2: D); 1 and 0 past the padded ones.
  const auto size_of = [&](const std::vector<int64_t>& sizes, int64_t from_end) {
    return from_end < dims ? static_cast<int>(sizes[sizes.size() - 1 - from_end]) : 1;
  };
  const auto leading_pad = [&](int64_t from_end) {
    return from_end < dims ? static_cast<int>(padding[2 * from_end]) : 0;
  };
  const std::vector<int64_t> in_sizes = input.sizes().vec();
  PadGeometry g;
  g.W = size_of(in_sizes, 0);
  g.H = size_of(in_sizes, 1);
  g.D = size_of(in_sizes, 2);
  g.left = leading_pad(0);
  g.top = leading_pad(1);
  g.front = leading_pad(2);
  g.out_w = size_of(out_sizes, 0);
  // The row kernels' strides (a dimension of size 1 has index 0: its stride unused). The planes
  // are the one or two dimensions before the padded ones: (outer, inner), or (0, inner).
  const int64_t lead = input.dim() - dims;
  g.inner = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(input.size(lead - 1)));
  g.inner_stride = input.stride(lead - 1);
  g.outer_stride = lead == 2 ? input.stride(0) : 0;
  g.d_stride = dims >= 3 ? input.stride(-3) : 0;
  g.h_stride = dims >= 2 ? input.stride(-2) : 0;
  g.out_h = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(size_of(out_sizes, 1)));
  g.out_d = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(size_of(out_sizes, 2)));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (format != at::MemoryFormat::Contiguous) {
    const auto launch_channels_last = [&](auto bits) {
      using U = decltype(bits);
      const unsigned vector_units = static_cast<unsigned>(input.size(1) * input.element_size() / sizeof(U));
      g.vector_units = at::cuda::detail::IntDivider<unsigned>(vector_units);
      g.out_w_vectors = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(g.out_w));
      g.items = static_cast<unsigned>(out.numel() / input.size(1)) * vector_units;
      // As many blocks as the units need, at most 8 an SM (2048 threads); a thread loops over units.
      const int64_t blocks = std::min<int64_t>((g.items + kPadThreads * kUnits - 1) / (kPadThreads * kUnits), sms * 8);
      replication_pad_channels_last_kernel<U><<<static_cast<unsigned>(blocks), kPadThreads, 0, stream>>>(
          static_cast<const U*>(input.data_ptr()), static_cast<U*>(out.data_ptr()), g);
    };
    switch (channels_last_unit(input)) {
      case 16: launch_channels_last(uint4()); break;
      case 8: launch_channels_last(uint2()); break;
      case 4: launch_channels_last(uint32_t()); break;
      default: launch_channels_last(uint16_t()); break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  const unsigned rows = static_cast<unsigned>(out.numel() / g.out_w);
  const auto launch = [&](auto bits) {
    using T = decltype(bits);
    const auto* src = static_cast<const T*>(input.data_ptr());
    auto* dst = static_cast<T*>(out.data_ptr());
    if (g.out_w * static_cast<int64_t>(sizeof(T)) >= kPadLinesMinBytes) {
      g.chunk = kChunkBytes / static_cast<int>(sizeof(T));
      const unsigned chunks = static_cast<unsigned>((g.out_w + g.chunk - 1) / g.chunk);
      g.chunks = at::cuda::detail::IntDivider<unsigned>(chunks);
      g.items = rows * chunks;
      // As many blocks as the items need, at most 8 an SM (2048 threads); a warp loops over items.
      const int64_t blocks = std::min<int64_t>((g.items + kPadWarps - 1) / kPadWarps, sms * 8);
      replication_pad_lines_kernel<T><<<static_cast<unsigned>(blocks), kPadThreads, 0, stream>>>(src, dst, g);
    } else {
      g.items = rows;
      // A whole number of warps along a row, covering it in one pass of kCols columns; the rest
      // of the block's threads take other rows.
      const int tx = std::min(kPadThreads, (g.out_w + kCols * 32 - 1) / (kCols * 32) * 32);
      const int ty = kPadThreads / tx;
      const int64_t blocks = (static_cast<int64_t>(rows) + ty * kRows - 1) / (ty * kRows);
      replication_pad_rows_kernel<T><<<static_cast<unsigned>(blocks), dim3(tx, ty), 0, stream>>>(src, dst, g);
    }
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

at::Tensor replication_pad_by_kernels(const at::Tensor& input, at::IntArrayRef padding) {
  const auto format = input.suggest_memory_format();
  const auto out_sizes = kernel_output_sizes(input, padding, format);
  return out_sizes ? launch_replication_pad(input, padding, format, *out_sizes) : at::Tensor();
}

at::Tensor replication_pad_cuda(const at::Tensor& input, at::IntArrayRef padding) {
  if (at::Tensor out = replication_pad_by_kernels(input, padding); out.defined()) return out;
  const auto format = input.suggest_memory_format();
  // Any other input of the kernels' dtypes dense in no layout (a channels-last slice, rows with a
  // stride) is copied dense in its suggested format first (docs/design.md, "Replication pad"); the
  // output's layout is the same either way.
  if (input.numel() > 0 && kernel_dtype(input.scalar_type()) && !input.is_contiguous(format)) {
    const at::Tensor dense = input.contiguous(format);
    if (dense.suggest_memory_format() == format) {
      if (const auto out_sizes = kernel_output_sizes(dense, padding, format)) {
        return launch_replication_pad(dense, padding, format, *out_sizes);
      }
    }
  }
  return at::pad(input, padding, "replicate").contiguous(format);
}

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("replication_pad", &replication_pad_cuda);
}

}  // namespace fusednorm
