// The copy that puts an fp32 product's operand into the layout Hopper's TF32 tensor cores read (products.cpp).
#include <cstdint>

#include "products.h"

namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;

// out (rows, columns), rows `out_stride` apart, is the transpose of source (columns, rows), rows `source_stride`
// apart: out[r][c] = source[c'][r], with c' = c, or with `reverse_blocks_of` = n the index c's block of n taken from
// the other end (a sequence's steps of n samples in reverse order). Through a shared tile, so that both sides move
// whole lines; the extra column keeps the tile's columns in different banks.
__global__ void k_major_copy_kernel(const float* __restrict__ source, float* __restrict__ out, int rows, int columns,
                                    int64_t source_stride, int64_t out_stride, int reverse_blocks_of) {
  __shared__ float tile[kTile][kTile + 1];
  const int column_base = blockIdx.x * kTile;
  const int row_base = blockIdx.y * kTile;
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int column = column_base + i;
    const int row = row_base + threadIdx.x;
    if (column < columns && row < rows) {
      int source_column = column;
      if (reverse_blocks_of > 0) {
        const int blocks = columns / reverse_blocks_of;
        source_column = (blocks - 1 - column / reverse_blocks_of) * reverse_blocks_of + column % reverse_blocks_of;
      }
      tile[i][threadIdx.x] = source[source_column * source_stride + row];
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int row = row_base + i;
    const int column = column_base + threadIdx.x;
    if (row < rows && column < columns) out[row * out_stride + column] = tile[threadIdx.x][i];
  }
}

}  // namespace

cudaError_t launch_k_major_copy(const float* source, float* out, int rows, int columns, int64_t source_stride,
                                int64_t out_stride, int reverse_blocks_of, cudaStream_t stream) {
  const dim3 grid((columns + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  k_major_copy_kernel<<<grid, dim3(kTile, kRowsPerPass), 0, stream>>>(source, out, rows, columns, source_stride,
                                                                      out_stride, reverse_blocks_of);
  return cudaGetLastError();
}
