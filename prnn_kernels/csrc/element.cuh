// Conversions between the storage dtype (float or bf16) and the fp32 the kernels compute in, and weight access.
#pragma once

#include <cuda_bf16.h>

#include "persistent_rnn.h"

namespace prnn {

__host__ __device__ constexpr int round_up(int value, int multiple) {
  return (value + multiple - 1) / multiple * multiple;
}
__host__ __device__ constexpr int ceil_div(int value, int divisor) { return (value + divisor - 1) / divisor; }

// A CTA's dynamic shared memory: the staged vector, the per-warp partial sums, then, 16-byte aligned, the control
// words (the plain engine's two staging mbarriers and abort flag, or the chained engine's two mbarriers per chain,
// each chain's stored steps and the CTA's failing word), then the weights a variant keeps in shared memory.
constexpr int kControlBytes = 48;
static_assert(2 * kChains * 8 + 4 * (kChains + 1) <= kControlBytes, "the chained engine's words fit");
__host__ __device__ constexpr int control_offset(int staged_bytes, int partial_floats) {
  return round_up(staged_bytes + 4 * partial_floats, 16);
}
__host__ __device__ constexpr int cta_shared_bytes(int staged_bytes, int partial_floats) {
  return control_offset(staged_bytes, partial_floats) + kControlBytes;
}
// The per-warp partial sums: partials[warp * partial_stride + sample * R + row].
__host__ __device__ constexpr int partial_floats(const Tiling& tiling) {
  return tiling.num_partials * tiling.partial_stride;
}

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

template <class Element>
__device__ __forceinline__ Element from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16(value); }

// Element (local row, k) of the slice of the matrix this pass multiplies by that CTA `cta` holds: local rows are
// gate-major (row = gate * units_per_cta + unit); 0 in the tiles' padding. Padding rows have gate >= p.gates: only the
// forward pass (G gate rows per unit) has them, the backward's single row per unit always fills the tile.
template <class Element>
__device__ __forceinline__ Element weight_at(const RnnParams<Element>& p, int cta, int local_row, int k) {
  const int units = p.tiling.units_per_cta;
  const int gate = local_row / units;
  const int unit = cta * units + local_row % units;
  if (gate >= p.gates || unit >= p.hidden || k >= p.vector_length) return from_float<Element>(0.f);
  const size_t row = static_cast<size_t>(gate) * p.hidden + unit;
  return p.weight[row * p.weight_row_stride + static_cast<size_t>(k) * p.weight_col_stride];
}

// Zeroes `bytes` (a multiple of 16) of shared memory with the whole CTA.
__device__ __forceinline__ void zero_shared(void* base, int bytes) {
  float4* words = reinterpret_cast<float4*>(base);
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) words[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace prnn
