// fp32 matrix-vector engine: weights in registers, the published vector in shared memory, FFMA.
//
// A CTA holds R = G * kRowsPerThread rows. Thread tid sits in row group g = tid % G (rows g + G*i) and K split
// s = tid / G; it holds its rows' weights at the 16-byte chunks c_j = s + j * k_splits (k = 4 c_j .. 4 c_j + 3) in
// registers for the whole sequence. The lanes of a warp with different s read adjacent chunks of the staged vector
// (at most 8 distinct 16-byte addresses, one shared-memory wavefront) and every load feeds 4 * kRowsPerThread FMAs.
// Partial sums are reduced across the lanes of a warp with shuffles, then across warps through shared memory.
// Variants with WeightHome::kShared hold tiling.shared_chunks more chunks per row in shared memory after their
// registers' (c_j for j >= kChunksPerThread), for matrices the register file cannot hold: ReLU above H = 2048, the GRU
// and LSTM above 1152, and the two directions of a bidirectional layer in one launch (NOTES.md v21). Variants with
// kSharedAndL2 fill shared memory and keep tiling.l2_chunks more in a global workspace, laid out as the shared chunks
// and read again every step, for matrices the chip cannot hold at all: the GRU and LSTM from about H = 1600 (lower
// at 16 utterances), the ReLU above 3072 (NOTES.md v23).
#pragma once

#include <vector>

#include "element.cuh"

namespace prnn {

template <int kRowsPerThread, int kChunksPerThread, int kMaxThreads_, WeightHome kHome = WeightHome::kRegisters>
struct Fp32Math {
  static constexpr int kMaxThreads = kMaxThreads_;
  // The variants whose weights take 96 or more of their 168 registers (GRU and LSTM at H ~ 1152).
  static constexpr bool kLarge = kRowsPerThread * kChunksPerThread >= 24;
  // Samples whose partial sums a thread accumulates at once. The large variants take two: ten fewer live
  // accumulators stop the 168-register LSTM variant spilling (ptxas: 548/768 bytes of spill stores/loads with four,
  // 132/196 with two). The order of each sum's FMAs is the same either way. Variants with weights in L2 take four, so
  // that each L2 weight is loaded once a step rather than once a pass (3 x 8: 0-16 bytes of spills).
  static constexpr int kSamplesPerPass = kLarge && kHome != WeightHome::kSharedAndL2 ? 2 : 4;
  // (hidden unit, sample) elements a thread finishes per step; tilings keep units_per_cta * batch <= this * threads.
  // The large variants hold one element's cell state, not two: with two, ptxas spilled values the step's input loads
  // had just returned, so their warps waited there for the loads (~0.6 us of a GRU backward step; NOTES.md v17).
  // Their shapes have more threads than elements at every batch whose staged vector fits in shared memory.
  static constexpr int kElementsPerThread = kLarge ? 1 : 2;
  // Samples whose FMAs with one weight register are issued back to back. In the two-sample variants both samples'
  // chunks are loaded first and each weight meets them in turn: ptxas then spills far less (LSTM 5 x 6 forward: 132/196
  // -> 24/24 bytes; GRU 3 x 10 backward: 176/300 -> 16/16) and their steps are 1-9 % shorter (H100, NOTES.md v16). The
  // four-sample variants keep one sample at a time: two made ReLU's 4-sample variant 1 % slower.
  static constexpr int kSamplesPerWeightUse = kLarge ? kSamplesPerPass : 1;
  // The chained engine's passes: two samples, so that a chain of two takes one pass (NOTES.md v24).
  static constexpr int kChainSamplesPerPass = 2;
  using Element = float;
  using Staged = float;  // staged vector: (round_up(B, 4), padded_k), samples >= B and k >= K zero

  float4 weight[kRowsPerThread][kChunksPerThread];
  // The shared chunks, (chunk, row, thread) order so that a warp reads 512 contiguous bytes per load: this thread's
  // row i of shared chunk j at [(j * kRowsPerThread + i) * threads]. The L2 chunks likewise, in the CTA's slice of
  // the workspace (l2_chunks_of).
  const float4* shared_weight;
  int group;  // g
  int split;  // s

  __host__ __device__ static int staged_bytes(const Tiling& tiling, int batch) {
    return round_up(batch, 4) * tiling.padded_k * static_cast<int>(sizeof(float));
  }

  static std::vector<Tiling> tilings(const MatrixShape& shape) {
    std::vector<Tiling> result;
    for (int groups = 32; groups >= 1; groups /= 2) {
      Tiling t{};
      t.row_groups = groups;
      t.rows_per_cta = groups * kRowsPerThread;
      // All gates of a unit in one CTA. Rows past units_per_cta * row_gates are padding (zero weights): they let a
      // power-of-two row count hold, say, the 30 rows of 10 GRU units.
      t.units_per_cta = t.rows_per_cta / shape.row_gates;
      if (t.units_per_cta == 0) continue;
      t.num_ctas = ceil_div(shape.units, t.units_per_cta);
      const int chunks = ceil_div(shape.k_extent, 4);
      if constexpr (kHome != WeightHome::kRegisters) {
        // As many threads as the variant takes, so that registers hold the most and shared memory the least; at least
        // one chunk in shared memory, which keeps these tilings out of the planner's register-only round.
        const int most_splits = kMaxThreads / groups;
        t.shared_chunks = ceil_div(chunks, most_splits) - kChunksPerThread;
        t.shared_chunks = t.shared_chunks > 1 ? t.shared_chunks : 1;
      }
      const int chunks_per_thread = kChunksPerThread + t.shared_chunks;
      int k_splits = ceil_div(chunks, chunks_per_thread);
      // Enough threads to finish the CTA's units_per_cta * batch elements each step.
      const int for_elements = ceil_div(t.units_per_cta * shape.batch, kElementsPerThread * groups);
      k_splits = k_splits > for_elements ? k_splits : for_elements;
      t.k_splits = round_up(k_splits, 32 / groups);  // whole warps
      t.threads = groups * t.k_splits;
      t.padded_k = 4 * t.k_splits * chunks_per_thread;
      t.num_partials = t.threads / 32;
      t.partial_stride = shape.batch * t.rows_per_cta;
      const int chunk_bytes = t.threads * kRowsPerThread * static_cast<int>(sizeof(float4));  // one chunk, every row
      const int unshared_bytes =
          cta_shared_bytes(staged_bytes(t, shape.batch), partial_floats(t));
      if constexpr (kHome == WeightHome::kSharedAndL2) {
        // Shared memory holds what it can of the chunks past the registers', L2 the rest: at least one, which keeps
        // these tilings out of the planner's shared-memory round.
        const int beyond_registers = t.shared_chunks;
        const int fit = (shape.smem_limit - unshared_bytes) / chunk_bytes;
        if (fit < 0) continue;
        t.shared_chunks = fit < beyond_registers - 1 ? fit : beyond_registers - 1;
        t.l2_chunks = beyond_registers - t.shared_chunks;
      }
      t.weight_smem_bytes = t.shared_chunks * chunk_bytes;
      t.weight_l2_bytes = t.l2_chunks * chunk_bytes;
      t.smem_bytes = unshared_bytes + t.weight_smem_bytes;
      if (t.threads <= 1024) result.push_back(t);
    }
    return result;
  }

  // shared_weights: weight_smem_bytes of the CTA's shared memory, 16-byte aligned, for this CTA alone.
  __device__ void load_weights(const RnnParams<float>& p, int cta, void* shared_weights) {
    const Tiling& t = p.tiling;
    group = threadIdx.x % t.row_groups;
    split = threadIdx.x / t.row_groups;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = group + t.row_groups * i;
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) weight[i][j] = weight_chunk(p, cta, row, j);
    }
    if constexpr (kHome != WeightHome::kRegisters) {
      float4* shared = static_cast<float4*>(shared_weights) + threadIdx.x;
      shared_weight = shared;
      for (int j = 0; j < t.shared_chunks; ++j) {
        for (int i = 0; i < kRowsPerThread; ++i) {
          shared[(j * kRowsPerThread + i) * t.threads] = weight_chunk(p, cta, group + t.row_groups * i,
                                                                      kChunksPerThread + j);
        }
      }
    }
    if constexpr (kHome == WeightHome::kSharedAndL2) {
      // Laid out as the shared chunks. Each thread reads back only what it wrote here, so no fence or barrier stands
      // between. A loop apart from the one above: one loop switching pointers changed the shared-memory variants'
      // machine code, this leaves it as it was.
      float4* l2 = l2_chunks_of(p);
      for (int j = 0; j < t.l2_chunks; ++j) {
        for (int i = 0; i < kRowsPerThread; ++i) {
          l2[(j * kRowsPerThread + i) * t.threads] = weight_chunk(p, cta, group + t.row_groups * i,
                                                                  kChunksPerThread + t.shared_chunks + j);
        }
      }
    }
  }

  // This thread's first L2 chunk in the workspace, computed where it is used rather than held in a member for the
  // whole sequence.
  __device__ static float4* l2_chunks_of(const RnnParams<float>& p) {
    const int cta = blockIdx.x % p.tiling.num_ctas;
    return reinterpret_cast<float4*>(p.l2_weights) + static_cast<size_t>(cta) * (p.tiling.weight_l2_bytes / 16) +
           threadIdx.x;
  }

  // Row `row`'s weights at this thread's chunk c_j.
  __device__ float4 weight_chunk(const RnnParams<float>& p, int cta, int row, int j) const {
    const int k = 4 * (split + j * p.tiling.k_splits);
    return make_float4(weight_at(p, cta, row, k), weight_at(p, cta, row, k + 1), weight_at(p, cta, row, k + 2),
                       weight_at(p, cta, row, k + 3));
  }

  // Where the step's published vector is read from (B rows of VS floats, entries past K zero) and staged to.
  __device__ static const float* published(const RnnParams<float>& p, int step) {
    return p.state + static_cast<size_t>(step) * p.batch * p.state_stride;
  }
  __device__ static int published_row_bytes(const RnnParams<float>& p) { return p.state_stride * 4; }
  __device__ static int staged_row_bytes(const Tiling& tiling) { return tiling.padded_k * 4; }

  __device__ static float component(const float4& value, int c) {
    return c == 0 ? value.x : (c == 1 ? value.y : (c == 2 ? value.z : value.w));
  }

  // The L2 chunks' products. A loop apart from the shared chunks' (one loop for both, or this function for both,
  // changed the shared-memory variants' machine code: 2 x 8 GRU spills 16 -> 24 bytes). Unrolled so that several
  // chunks' loads are in flight at once, each otherwise waiting a trip to L2: the GRU at 2048 took 9.02 us a forward
  // step loading one chunk at a time in passes of two samples, 8.8 unrolled, 7.35 unrolled in one pass of four (H100,
  // NOTES.md v23). The loads skip L1, which full shared memory leaves small.
  template <int kSamples>
  __device__ void multiply_l2_chunks(const RnnParams<float>& p, const float4* chunks, int first,
                                     float (&sum)[kRowsPerThread][kSamples]) const {
    const Tiling& t = p.tiling;
    const int chunks_per_sample = t.padded_k / 4;
    const float4* l2 = l2_chunks_of(p);
#pragma unroll 4
    for (int j = 0; j < t.l2_chunks; ++j, l2 += kRowsPerThread * t.threads) {
      float4 w[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) w[i] = __ldcg(l2 + i * t.threads);
      const int chunk = split + (kChunksPerThread + t.shared_chunks + j) * t.k_splits;
      multiply_chunk<kSamples>(w, chunks + first * chunks_per_sample + chunk, chunks_per_sample, sum);
    }
  }

  // sum[i][b] += w[i] . (sample first + b at one chunk, from sample_chunks on), one sample at a time: the products of
  // the chunks past the registers' (the loop over the register chunks pairs samples in some variants).
  template <int kSamples>
  __device__ static void multiply_chunk(const float4 (&w)[kRowsPerThread], const float4* sample_chunks,
                                        int chunks_per_sample, float (&sum)[kRowsPerThread][kSamples]) {
#pragma unroll
    for (int b = 0; b < kSamples; ++b) {
      const float4 v = sample_chunks[b * chunks_per_sample];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) sum[i][b] = fmaf(component(w[i], c), component(v, c), sum[i][b]);
      }
    }
  }

  // partials[(warp * B + sample) * R + row] = this warp's share of sum_k W[row][k] * v[sample][k], every sample.
  __device__ void multiply(const RnnParams<float>& p, const float* staged, float* partials) const {
    multiply_samples<kSamplesPerPass, false>(p, staged, partials, 0, p.batch);
  }

  // The same for samples [begin, end), kSamples at a time (staged rows past `end` are read but not used). With
  // kStrided, warp w's partial sums lie tiling.partial_stride floats after warp w - 1's (the chained engine's padded
  // stride); the plain engine keeps the index its kernels were tuned with, whose machine code is then v26's byte for
  // byte (NOTES.md v27).
  template <int kSamples, bool kStrided>
  __device__ void multiply_samples(const RnnParams<float>& p, const float* staged, float* partials, int begin,
                                   int end) const {
    static_assert(kSamples % kSamplesPerWeightUse == 0, "whole weight uses per pass");
    const Tiling& t = p.tiling;
    const float4* chunks = reinterpret_cast<const float4*>(staged);
    const int chunks_per_sample = t.padded_k / 4;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    for (int first = begin; first < end; first += kSamples) {
      float sum[kRowsPerThread][kSamples] = {};
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) {
        const int chunk = split + j * t.k_splits;
#pragma unroll
        for (int set = 0; set < kSamples; set += kSamplesPerWeightUse) {
          float4 v[kSamplesPerWeightUse];
#pragma unroll
          for (int b = 0; b < kSamplesPerWeightUse; ++b) {
            v[b] = chunks[(first + set + b) * chunks_per_sample + chunk];
          }
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#pragma unroll
              for (int b = 0; b < kSamplesPerWeightUse; ++b) {
                sum[i][set + b] = fmaf(component(weight[i][j], c), component(v[b], c), sum[i][set + b]);
              }
            }
          }
        }
      }
      // The shared chunks, one sample at a time. The same products as the loop above, written out again: routing that
      // loop through one helper for both changed ptxas's schedule of the 5 x 6 variant and cost the fp32 LSTM at 1152
      // 3 % a step (NOTES.md v21).
      if constexpr (kHome != WeightHome::kRegisters) {
        const float4* shared = shared_weight;
        for (int j = 0; j < t.shared_chunks; ++j, shared += kRowsPerThread * t.threads) {
          float4 w[kRowsPerThread];
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) w[i] = shared[i * t.threads];
          const int chunk = split + (kChunksPerThread + j) * t.k_splits;
          multiply_chunk<kSamples>(w, chunks + first * chunks_per_sample + chunk, chunks_per_sample, sum);
        }
      }
      if constexpr (kHome == WeightHome::kSharedAndL2) multiply_l2_chunks<kSamples>(p, chunks, first, sum);
      // Lanes of one row group differ in the lane bits above log2(G).
      for (int offset = t.row_groups; offset < 32; offset *= 2) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
          for (int b = 0; b < kSamples; ++b) sum[i][b] += __shfl_xor_sync(0xffffffffu, sum[i][b], offset);
        }
      }
      if (lane < t.row_groups) {
#pragma unroll
        for (int b = 0; b < kSamples; ++b) {
          if (first + b < end) {
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
              const int row = group + t.row_groups * i;
              if constexpr (kStrided) {
                partials[warp * t.partial_stride + (first + b) * t.rows_per_cta + row] = sum[i][b];
              } else {
                partials[(warp * p.batch + first + b) * t.rows_per_cta + row] = sum[i][b];
              }
            }
          }
        }
      }
    }
  }
};

}  // namespace prnn
