// The persistent loop shared by every cell, pass and precision.
//
// Math (fp32_math.cuh, mma_math.cuh) holds this CTA's rows of the matrix on chip and multiplies the staged vector
// by them; Cell (vanilla_cell.cuh) finishes each (row, sample) output. Per step:
//   wait until every CTA published the previous vector -> start loading the next step's inputs -> stage the vector
//   in shared memory -> multiply into per-warp partial sums -> reduce, finish, store the CTA's slice of the next
//   vector -> publish.
#pragma once

#include <type_traits>

#include "element.cuh"
#include "sync.cuh"

namespace prnn {

template <class Math, class Cell>
__global__ void __launch_bounds__(Math::kMaxThreads, 1)
    persistent_rnn_kernel(const RnnParams<typename Cell::Element> p) {
  static_assert(std::is_same<typename Math::Element, typename Cell::Element>::value, "one dtype per kernel");
  extern __shared__ __align__(16) unsigned char smem[];
  const Tiling& tiling = p.tiling;
  const int rows = tiling.rows_per_cta;
  const int staged_bytes = Math::staged_bytes(tiling, p.batch);
  auto* staged = reinterpret_cast<typename Math::Staged*>(smem);
  float* partials = reinterpret_cast<float*>(smem + staged_bytes);  // (num_partials, B, R)
  int* abort_s = reinterpret_cast<int*>(partials + tiling.num_partials * p.batch * rows);

  Math math;
  math.load_weights(p, blockIdx.x);
  zero_shared(smem, staged_bytes);  // padding samples and k >= H stay zero for the whole sequence
  if (threadIdx.x == 0) *abort_s = 0;

  Cell cell[kElementsPerThread];
  int row_local[kElementsPerThread];
  int sample[kElementsPerThread];
  bool active[kElementsPerThread];
#pragma unroll
  for (int u = 0; u < kElementsPerThread; ++u) {
    const int e = threadIdx.x + u * blockDim.x;
    sample[u] = e / rows;
    row_local[u] = e - sample[u] * rows;
    active[u] = sample[u] < p.batch && blockIdx.x * rows + row_local[u] < p.hidden;
    if (active[u]) cell[u].init(p, blockIdx.x * rows + row_local[u], sample[u]);
  }
  __syncthreads();

  const size_t vector_size = static_cast<size_t>(p.batch) * p.state_stride;
  for (int step = 0; step < p.num_steps; ++step) {
    if (step > 0 && !wait_for_step(p, step, abort_s)) return;
#pragma unroll
    for (int u = 0; u < kElementsPerThread; ++u) {
      if (active[u]) cell[u].prefetch(p, step, blockIdx.x * rows + row_local[u], sample[u]);
    }
    math.stage(p, p.state + step * vector_size, staged);
    __syncthreads();
    math.multiply(p, staged, partials);
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kElementsPerThread; ++u) {
      if (active[u]) {
        float recurrent = 0.f;
        for (int q = 0; q < tiling.num_partials; ++q) {
          recurrent += partials[(q * p.batch + sample[u]) * rows + row_local[u]];
        }
        const int row = blockIdx.x * rows + row_local[u];
        const float next = cell[u].finish(p, step, row, sample[u], recurrent);
        p.state[(step + 1) * vector_size + sample[u] * p.state_stride + row] = next;
      }
    }
    __syncthreads();
    publish(p.flags, step + 1);
  }
}

template <class Math, class Cell>
KernelVariant kernel_variant() {
  return {reinterpret_cast<const void*>(&persistent_rnn_kernel<Math, Cell>), Math::kMaxThreads, &Math::tilings};
}

}  // namespace prnn
