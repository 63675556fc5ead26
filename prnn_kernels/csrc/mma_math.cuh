// bf16 matrix-vector engine: weights on chip as tensor-core fragments, fp32 accumulation.
//
// One mma.m16n8k16 multiplies the staged vector (16 samples x 16 k, bf16; samples >= B read a zero row) by a
// 16 k x 8 rows tile of the weights. A CTA holds R = 8 * row_groups rows. Warp w takes the 8-row tile
// w % row_groups and the K split w / row_groups; it holds the B fragments of its k-tiles kt_j = split + j * k_splits
// for the whole sequence: the first kRegisterTiles in registers, the next kSharedTiles in shared memory, where
// matrices larger than the register file (GRU and LSTM at H = 2048) keep the rest. Warps of one K split write
// disjoint rows; the k_splits partial sums of each output are reduced through shared memory.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_bf16.h>

#include "element.cuh"

namespace prnn {

template <int kRegisterTiles, int kSharedTiles, int kMaxThreads_>
struct MmaMath {
  static_assert(kRegisterTiles > 0, "the first tile's B fragment comes from registers");
  static constexpr int kMaxThreads = kMaxThreads_;
  static constexpr int kTilesPerWarp = kRegisterTiles + kSharedTiles;
  using Element = __nv_bfloat16;
  using Staged = __nv_bfloat16;  // staged vector: (B + 1, padded_k + 8), row B and k >= H zero

  // A lane's B fragment of one k-tile, bf16 pairs: (k, k + 1) and (k + 8, k + 9) of row gid, k = 16 kt + 2 tig.
  uint32_t weight[kRegisterTiles][2];
  // The shared tiles' fragments: (warp, tile, lane) order, so a warp reads 256 contiguous bytes per tile.
  const uint2* shared_weight;  // this lane's fragment of the warp's first shared tile; tile j at [32 * j]
  int row_tile;
  int split;

  __host__ __device__ static int weight_smem_bytes(int threads) {
    return threads / 32 * kSharedTiles * static_cast<int>(sizeof(uint2)) * 32;
  }

  // 16 bytes of padding per staged row put the 8 rows an ldmatrix reads in different banks.
  __host__ __device__ static int staged_stride(const Tiling& tiling) { return tiling.padded_k + 8; }
  __host__ __device__ static int staged_bytes(const Tiling& tiling, int batch) {
    return (batch + 1) * staged_stride(tiling) * static_cast<int>(sizeof(__nv_bfloat16));
  }

  static std::vector<Tiling> tilings(const MatrixShape& shape) {
    std::vector<Tiling> result;
    const int k_tiles = ceil_div(shape.k_extent, 16);
    for (int row_tiles = 1; row_tiles <= 32; ++row_tiles) {
      Tiling t{};
      t.row_groups = row_tiles;
      t.rows_per_cta = 8 * row_tiles;
      // All gates of a unit in one CTA; rows past units_per_cta * row_gates are padding (zero weights).
      t.units_per_cta = t.rows_per_cta / shape.row_gates;
      if (t.units_per_cta == 0) continue;
      t.num_ctas = ceil_div(shape.units, t.units_per_cta);
      const int needed_for_outputs = ceil_div(t.units_per_cta * shape.batch, kElementsPerThread * 32 * row_tiles);
      const int needed_for_k = ceil_div(k_tiles, kTilesPerWarp);
      t.k_splits = needed_for_k > needed_for_outputs ? needed_for_k : needed_for_outputs;
      t.threads = 32 * row_tiles * t.k_splits;
      t.padded_k = 16 * kTilesPerWarp * t.k_splits;
      t.num_partials = t.k_splits;
      t.weight_smem_bytes = weight_smem_bytes(t.threads);
      t.smem_bytes = cta_shared_bytes(staged_bytes(t, shape.batch), t.num_partials * shape.batch * t.rows_per_cta) +
                     t.weight_smem_bytes;
      if (t.threads <= 1024) result.push_back(t);
    }
    return result;
  }

  __device__ static uint32_t pack(__nv_bfloat16 low, __nv_bfloat16 high) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(low)) | (static_cast<uint32_t>(__bfloat16_as_ushort(high)) << 16);
  }

  // ldmatrix.x4 of one 16 x 16 tile of the staged vector, in the A-fragment order of mma.m16n8k16.
  __device__ static void load_fragment(uint32_t (&a)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(address)
                 : "memory");  // reads shared memory: keeps it after the wait for the staging
  }

  // shared_weights: weight_smem_bytes(threads) of the CTA's shared memory, 16-byte aligned, for this CTA alone.
  __device__ void load_weights(const RnnParams<__nv_bfloat16>& p, int cta, void* shared_weights) {
    const Tiling& t = p.tiling;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    row_tile = warp % t.row_groups;
    split = warp / t.row_groups;
    const int row = row_tile * 8 + lane / 4;
    uint2* shared = static_cast<uint2*>(shared_weights) + warp * kSharedTiles * 32 + lane;
    shared_weight = shared;
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      const int k = 16 * (split + j * t.k_splits) + 2 * (lane % 4);
      const uint32_t low = pack(weight_at(p, cta, row, k), weight_at(p, cta, row, k + 1));
      const uint32_t high = pack(weight_at(p, cta, row, k + 8), weight_at(p, cta, row, k + 9));
      if (j < kRegisterTiles) {
        weight[j][0] = low;
        weight[j][1] = high;
      } else {
        shared[32 * (j - kRegisterTiles)] = make_uint2(low, high);
      }
    }
  }

  // Where the step's published vector is read from (its bf16 copy: half the bytes of the fp32 rows, and the multiply
  // rounds to bf16 anyway; B rows of state_bf16_stride entries, those past K zero) and staged to.
  __device__ static const __nv_bfloat16* published(const RnnParams<__nv_bfloat16>& p, int step) {
    return p.state_bf16 + static_cast<size_t>(step) * p.batch * p.state_bf16_stride;
  }
  __device__ static int published_row_bytes(const RnnParams<__nv_bfloat16>& p) { return p.state_bf16_stride * 2; }
  __device__ static int staged_row_bytes(const Tiling& tiling) { return staged_stride(tiling) * 2; }

  // partials[(split * B + sample) * R + row] = this warp's share of sum_k W[row][k] * v[sample][k].
  __device__ void multiply(const RnnParams<__nv_bfloat16>& p, const __nv_bfloat16* staged, float* partials) const {
    const Tiling& t = p.tiling;
    const int lane = threadIdx.x % 32;
    // ldmatrix.x4: lanes 0-15 give the rows (samples) of k 0-7 of the tile, lanes 16-31 those of k 8-15.
    const int sample_row = lane % 16 < p.batch ? lane % 16 : p.batch;
    const __nv_bfloat16* row_start = staged + sample_row * staged_stride(t) + (lane / 16) * 8;
    const uint32_t row_address = static_cast<uint32_t>(__cvta_generic_to_shared(row_start));
    // The A fragments (and shared B fragments) of tile j + 1 load while tile j multiplies; two accumulators so
    // consecutive MMAs do not wait on each other.
    uint32_t a[2][4];
    uint2 b[2];
    float sum[2][4] = {};
    load_fragment(a[0], row_address + 32 * split);  // 16 bf16 = 32 bytes per k-tile
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      if (j + 1 < kTilesPerWarp) {
        load_fragment(a[(j + 1) % 2], row_address + 32 * (split + (j + 1) * t.k_splits));
        if (j + 1 >= kRegisterTiles) b[(j + 1) % 2] = shared_weight[32 * (j + 1 - kRegisterTiles)];
      }
      float* d = sum[j % 2];
      const uint32_t* f = a[j % 2];
      const uint32_t b0 = j < kRegisterTiles ? weight[j][0] : b[j % 2].x;
      const uint32_t b1 = j < kRegisterTiles ? weight[j][1] : b[j % 2].y;
      asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(f[0]), "r"(f[1]), "r"(f[2]), "r"(f[3]), "r"(b0), "r"(b1));
    }
    // Accumulator layout: d0, d1 at (sample gid, rows 2 tig, 2 tig + 1); d2, d3 at sample gid + 8.
    const int row = row_tile * 8 + 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int sample = lane / 4 + 8 * half;
      if (sample < p.batch) {
        float* out = partials + (split * p.batch + sample) * t.rows_per_cta + row;
        out[0] = sum[0][2 * half] + sum[1][2 * half];
        out[1] = sum[0][2 * half + 1] + sum[1][2 * half + 1];
      }
    }
  }
};

}  // namespace prnn
