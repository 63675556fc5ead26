// The persistent loop shared by every cell, pass and precision.
//
// Math (fp32_math.cuh, mma_math.cuh) holds this CTA's rows of the matrix on chip and multiplies the staged vector
// by them; Cell (vanilla_cell.cuh, gated_cells.cuh) finishes each (hidden unit, sample) element from the recurrent
// products of its kRowGates rows and returns the kVectorGates values it publishes. A thread finishes up to
// Math::kElementsPerThread elements, whose cell state stays in its registers. Per step:
//   wait until every CTA of this direction published the previous vector -> start staging the vector in shared
//   memory (bulk copies shared by the cluster, stage.cuh) -> start loading the cells' inputs -> wait for the staged
//   vector -> multiply into per-warp partial sums -> reduce, finish, store the CTA's slice of the next vector ->
//   publish.
// A CTA whose wait timed out (the launch is failing and Python will raise) stops waiting but runs the remaining
// steps: the other CTAs of its cluster wait for its share of every step's staging.
#pragma once

#include <type_traits>

#include "element.cuh"
#include "stage.cuh"
#include "sync.cuh"

namespace prnn {

template <class Math, class Cell>
__global__ void __launch_bounds__(Math::kMaxThreads, 1)
    persistent_rnn_kernel(const __grid_constant__ LayerParams<typename Cell::Element> layer) {
  static_assert(std::is_same<typename Math::Element, typename Cell::Element>::value, "one dtype per kernel");
  extern __shared__ __align__(16) unsigned char smem[];
  const int num_ctas = layer.direction[0].tiling.num_ctas;
  // A reference into the launch's parameter space (__grid_constant__): no copy to local memory.
  const RnnParams<typename Cell::Element>& p = layer.direction[blockIdx.x / num_ctas];
  const int cta = blockIdx.x % num_ctas;
  const Tiling& tiling = p.tiling;
  const int rows = tiling.rows_per_cta;
  const int units = tiling.units_per_cta;
  const int staged_bytes = Math::staged_bytes(tiling, p.batch);
  auto* staged = reinterpret_cast<typename Math::Staged*>(smem);
  float* partials = reinterpret_cast<float*>(smem + staged_bytes);  // (num_partials, B, R)
  unsigned char* control = smem + control_offset(staged_bytes, tiling.num_partials * p.batch * rows);
  uint64_t* stage_barriers = reinterpret_cast<uint64_t*>(control);
  int* abort_s = reinterpret_cast<int*>(stage_barriers + 2);
  void* shared_weights = control + kControlBytes;

  Math math;
  math.load_weights(p, cta, shared_weights);
  zero_shared(smem, staged_bytes);  // padding samples and k >= K stay zero for the whole sequence
  if (threadIdx.x == 0) *abort_s = 0;
  init_staging(stage_barriers);

  Cell cell[Math::kElementsPerThread];
  int unit_local[Math::kElementsPerThread];
  int sample[Math::kElementsPerThread];
  bool active[Math::kElementsPerThread];
#pragma unroll
  for (int u = 0; u < Math::kElementsPerThread; ++u) {
    const int e = threadIdx.x + u * blockDim.x;
    sample[u] = e / units;
    unit_local[u] = e - sample[u] * units;
    active[u] = sample[u] < p.batch && cta * units + unit_local[u] < p.hidden;
    if (active[u]) cell[u].init(p, cta * units + unit_local[u], sample[u]);
  }
  __syncthreads();

  const size_t vector_size = static_cast<size_t>(p.batch) * p.state_stride;
  bool in_time = true;
  for (int step = 0; step < p.num_steps; ++step) {
    if (step > 0 && in_time) in_time = wait_for_step(p, step, abort_s);
    // Copies first: the warps that issue them would otherwise wait for their own input loads (NOTES.md v17).
    uint64_t* stage_barrier = stage_barriers + step % 2;
    start_staging(Math::published(p, step), Math::published_row_bytes(p), staged, Math::staged_row_bytes(tiling),
                  p.batch, tiling.cluster_size, stage_barrier);
#pragma unroll
    for (int u = 0; u < Math::kElementsPerThread; ++u) {
      if (active[u]) cell[u].load(p, step, cta * units + unit_local[u], sample[u]);
    }
    finish_staging(stage_barrier, (step / 2) % 2);
    math.multiply(p, staged, partials);
    __syncthreads();
#pragma unroll
    for (int u = 0; u < Math::kElementsPerThread; ++u) {
      if (active[u]) {
        // Gates innermost and the partials unrolled by 4, so independent shared-memory loads are in flight together
        // while each gate still sums its partials in order.
        float recurrent[Cell::kRowGates] = {};
        const float* unit_partials = partials + sample[u] * rows + unit_local[u];
#pragma unroll 4
        for (int q = 0; q < tiling.num_partials; ++q) {
#pragma unroll
          for (int gate = 0; gate < Cell::kRowGates; ++gate) {
            recurrent[gate] += unit_partials[q * p.batch * rows + gate * units];
          }
        }
        const int unit = cta * units + unit_local[u];
        float published[Cell::kVectorGates];
        cell[u].finish(p, step, unit, sample[u], recurrent, published);
        float* next = p.state + (step + 1) * vector_size + sample[u] * p.state_stride + unit;
#pragma unroll
        for (int gate = 0; gate < Cell::kVectorGates; ++gate) next[gate * p.hidden] = published[gate];
        if constexpr (std::is_same<typename Cell::Element, __nv_bfloat16>::value) {  // the copy the bf16 engine stages
          __nv_bfloat16* next_bf16 = p.state_bf16 + (static_cast<size_t>(step + 1) * p.batch + sample[u]) *
                                                        p.state_bf16_stride + unit;
#pragma unroll
          for (int gate = 0; gate < Cell::kVectorGates; ++gate) {
            next_bf16[gate * p.hidden] = __float2bfloat16(published[gate]);
          }
        }
      }
    }
    __syncthreads();
    publish(p.flags, cta, step + 1);
  }
#pragma unroll
  for (int u = 0; u < Math::kElementsPerThread; ++u) {
    if (active[u]) cell[u].end(p, cta * units + unit_local[u], sample[u]);
  }
}

template <class Math, class Cell>
KernelVariant kernel_variant() {
  return {reinterpret_cast<const void*>(&persistent_rnn_kernel<Math, Cell>), Math::kMaxThreads, &Math::tilings};
}

}  // namespace prnn
