// The CUDA copies to_layout (group_norm.cpp) takes for CUDA tensors (docs/design.md, "Layout
// copies"). An operand dense in one layout into the other (channels-first <-> channels-last): a
// batched transpose through shared-memory tiles whose loads and stores fill whole 32-byte sectors,
// where ATen's copy of the permuted view reads an element a sector. An operand whose rows are
// contiguous, at least 256 bytes, but whose other strides are any (the frames of an NCDHW video)
// into channels-first: the replication pad's lines kernel with no padding, where ATen's copy runs
// a generic strided loop.
#include "cuda/replication_pad.h"
#include "group_norm.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace fusednorm {
namespace {

// A CTA moves a kTile x kTile tile: kTile / kTileWarps rows a warp, two elements a lane each row,
// 16 loads a thread.
constexpr int kTile = 64;
constexpr int kTileWarps = 8;

// out[b][k][r] = in[b][r][k] for every batch b, r < rows, k < cols; T the element's bits. A CTA a
// tile; the tile's index decomposes into (batch, row tile, column tile), column tiles fastest.
template <typename T>
__global__ void __launch_bounds__(32 * kTileWarps) transpose_tiles_kernel(const T* __restrict__ in,
    T* __restrict__ out, int64_t rows, int64_t cols, int64_t row_tiles, int64_t col_tiles) {
  __shared__ T tile[kTile][kTile + 1];  // + 1: a column's elements in different banks
  const int64_t t = blockIdx.x;
  const int64_t per_batch = row_tiles * col_tiles;
  const int64_t batch = t / per_batch;
  const int64_t r0 = (t - batch * per_batch) / col_tiles * kTile;
  const int64_t k0 = (t - batch * per_batch) % col_tiles * kTile;
  const T* src = in + batch * rows * cols;
  T* dst = out + batch * rows * cols;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // The loads go to registers first, so that they are in flight together, not one a store.
  T v[kTile / kTileWarps][kTile / 32];
#pragma unroll
  for (int a = 0; a < kTile / kTileWarps; ++a) {
#pragma unroll
    for (int b = 0; b < kTile / 32; ++b) {
      const int i = warp + a * kTileWarps;
      const int j = lane + b * 32;
      v[a][b] = r0 + i < rows && k0 + j < cols ? src[(r0 + i) * cols + k0 + j] : T(0);
    }
  }
#pragma unroll
  for (int a = 0; a < kTile / kTileWarps; ++a) {
#pragma unroll
    for (int b = 0; b < kTile / 32; ++b) tile[warp + a * kTileWarps][lane + b * 32] = v[a][b];
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < kTile / kTileWarps; ++a) {
#pragma unroll
    for (int b = 0; b < kTile / 32; ++b) {
      const int i = warp + a * kTileWarps;
      const int j = lane + b * 32;
      if (k0 + i < cols && r0 + j < rows) dst[(k0 + i) * rows + r0 + j] = tile[j][i];
    }
  }
}

template <typename T>
void launch_transpose(const at::Tensor& in, at::Tensor& out, int64_t batches, int64_t rows, int64_t cols,
    int64_t row_tiles, int64_t col_tiles) {
  transpose_tiles_kernel<T><<<static_cast<unsigned>(batches * row_tiles * col_tiles), 32 * kTileWarps, 0,
      at::cuda::getCurrentCUDAStream()>>>(static_cast<const T*>(in.data_ptr()),
      static_cast<T*>(out.data_ptr()), rows, cols, row_tiles, col_tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// `t` (a CUDA tensor of rank >= 3 with elements, dense in the layout other than `layout`) copied
// into `layout`; undefined where the kernel does not take it (elements of another size, a grid of
// more tiles than a launch holds).
at::Tensor transpose_copy(const at::Tensor& t, Layout layout) {
  const int64_t batches = t.size(0);
  const int64_t channels = t.size(1);
  const int64_t spatial = t.numel() / (batches * channels);
  // Channels-last memory is (N, S, C): rows of C; channels-first memory is (N, C, S): rows of S.
  const bool to_first = layout == Layout::ChannelsFirst;
  const int64_t rows = to_first ? spatial : channels;
  const int64_t cols = to_first ? channels : spatial;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const auto bytes = t.element_size();
  if (batches * row_tiles * col_tiles > std::numeric_limits<int32_t>::max() || (bytes != 2 && bytes != 4 && bytes != 8)) {
    return at::Tensor();
  }
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor out = empty_in_layout(t, layout, t.scalar_type());
  switch (bytes) {
    case 2: launch_transpose<uint16_t>(t, out, batches, rows, cols, row_tiles, col_tiles); break;
    case 4: launch_transpose<uint32_t>(t, out, batches, rows, cols, row_tiles, col_tiles); break;
    default: launch_transpose<uint64_t>(t, out, batches, rows, cols, row_tiles, col_tiles); break;
  }
  return out;
}

// `t` (a CUDA tensor of rank >= 3 with elements, copied into `layout`): the transpose where it is
// dense in the other layout; the pad's lines kernel, no padding, where the copy is channels-first
// and its rows are contiguous and at least kPadLinesMinBytes long (ranks 3 to 5, the pad's; on
// shorter rows ATen's copy was as fast or faster, docs/design.md, "Layout
// copies"); otherwise undefined, and to_layout then copies with ATen.
at::Tensor layout_copy_cuda(const at::Tensor& t, Layout layout) {
  const Layout other = layout == Layout::ChannelsFirst ? Layout::ChannelsLast : Layout::ChannelsFirst;
  if (has_strides_of(t, other)) return transpose_copy(t, layout);
  if (layout != Layout::ChannelsFirst || t.dim() > 5 || t.stride(-1) != 1 ||
      t.size(-1) * static_cast<int64_t>(t.element_size()) < kPadLinesMinBytes ||
      t.suggest_memory_format() != at::MemoryFormat::Contiguous) {
    return at::Tensor();
  }
  // Undefined where the pad's kernels refuse the tensor as it lies (~2^30 rows or 16-byte chunks
  // and more): ATen's .contiguous() is then faster than the pad's own fallback, ATen's strided pad.
  return replication_pad_by_kernels(t, std::vector<int64_t>(2 * (t.dim() - 2), 0));
}

const bool registered = (register_cuda_layout_copy(&layout_copy_cuda), true);

}  // namespace
}  // namespace fusednorm
