// bf16 matrix-vector engine: weights on chip as tensor-core fragments, fp32 accumulation.
//
// One mma.m16n8k16 multiplies a 16 rows x 16 k tile of the weights by the staged vector (16 k x 8 samples, bf16;
// samples >= B read a zero row): the weights are the A operand, so a batch of up to 8 takes one MMA per tile, up to
// 16 two and up to 32 four, where the vector as the A operand (16 samples) would waste 12 of 16 rows at batch 4 and
// need twice the MMAs. A CTA holds R = 16 * row_groups rows. Warp w takes the 16-row tile w % row_groups and the K
// split w / row_groups; it holds the A fragments of its k-tiles kt_j = split + j * k_splits for the whole sequence:
// the first kRegisterTiles in registers, the next kSharedTiles in shared memory, where matrices larger than the
// register file (GRU and LSTM at H = 2048) keep the rest, and with kL2Tiles tiling.l2_chunks more in a global workspace
// read again every step, for matrices larger than the chip (GRU and LSTM above 2048; NOTES.md v23). Warps of one K
// split write disjoint rows; the k_splits partial sums of each output are reduced through shared memory.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_bf16.h>

#include "element.cuh"

namespace prnn {

template <int kRegisterTiles, int kSharedTiles, int kMaxThreads_, int kMaxSampleTiles = 2, bool kL2Tiles = false>
struct MmaMath {
  static_assert(kRegisterTiles > 0, "the first tile's A fragment comes from registers");
  static_assert(!kL2Tiles || kSharedTiles > 0, "tiles go to L2 only where shared memory holds its share");
  static_assert(kMaxSampleTiles == 2 || kMaxSampleTiles == 4, "up to 16 samples, or 17 to 32");
  static constexpr int kMaxThreads = kMaxThreads_;
  // (hidden unit, sample) elements a thread finishes per step; tilings keep units_per_cta * batch <= this * threads.
  // The 20-tile variant for up to 16 samples holds one: with two, ptxas spilled 12-44 bytes in the gated cells, with
  // one 0-8 (LSTM bf16 H = 1152: 3.59 -> 3.18 us a forward step; NOTES.md v17). The rest keep two, which the largest
  // batches need.
  static constexpr int kElementsPerThread = kRegisterTiles == 20 && kMaxSampleTiles == 2 ? 1 : 2;
  static constexpr int kTilesPerWarp = kRegisterTiles + kSharedTiles;
  static constexpr int kRowsPerTile = 16;
  using Element = __nv_bfloat16;
  using Staged = __nv_bfloat16;  // staged vector: (B + 1, padded_k + 8), row B and k >= H zero

  // A lane's A fragment of one k-tile, bf16 pairs at k = 16 kt + 2 tig (+ 1): rows gid and gid + 8 of the tile at k,
  // then the same rows at k + 8 (gid = lane / 4, tig = lane % 4).
  uint32_t weight[kRegisterTiles][4];
  // The shared tiles' fragments: (warp, tile, lane) order, so a warp reads 512 contiguous bytes per tile. The L2
  // tiles likewise, in the CTA's slice of the workspace (l2_tiles_of).
  const uint4* shared_weight;  // this lane's fragment of the warp's first shared tile; tile j at [32 * j]
  int row_tile;
  int split;

  __host__ __device__ static int weight_smem_bytes(int threads) {
    return threads / 32 * kSharedTiles * static_cast<int>(sizeof(uint4)) * 32;
  }

  // 16 bytes of padding per staged row put the 8 rows an ldmatrix reads in different banks.
  __host__ __device__ static int staged_stride(const Tiling& tiling) { return tiling.padded_k + 8; }
  __host__ __device__ static int staged_bytes(const Tiling& tiling, int batch) {
    return (batch + 1) * staged_stride(tiling) * static_cast<int>(sizeof(__nv_bfloat16));
  }

  // Variants for up to 16 samples take those batches; variants with four sample tiles, whose accumulators cost
  // registers that would slow the smaller batches down, take 17 to 32.
  static std::vector<Tiling> tilings(const MatrixShape& shape) {
    std::vector<Tiling> result;
    if (shape.batch > 8 * kMaxSampleTiles || (kMaxSampleTiles == 4 && shape.batch <= 16)) return result;
    const int k_tiles = ceil_div(shape.k_extent, 16);
    for (int row_tiles = 1; row_tiles <= 16; ++row_tiles) {
      Tiling t{};
      t.row_groups = row_tiles;
      t.rows_per_cta = kRowsPerTile * row_tiles;
      // All gates of a unit in one CTA; rows past units_per_cta * row_gates are padding (zero weights).
      t.units_per_cta = t.rows_per_cta / shape.row_gates;
      if (t.units_per_cta == 0) continue;
      t.num_ctas = ceil_div(shape.units, t.units_per_cta);
      const int needed_for_outputs = ceil_div(t.units_per_cta * shape.batch, kElementsPerThread * 32 * row_tiles);
      const int needed_for_k = ceil_div(k_tiles, kTilesPerWarp);
      t.k_splits = needed_for_k > needed_for_outputs ? needed_for_k : needed_for_outputs;
      if constexpr (kL2Tiles) {
        // As many warps as the variant takes, so that the chip holds the most and L2 the least: at least one tile,
        // which keeps these tilings out of the planner's rounds before L2.
        const int most_splits = kMaxThreads / (32 * row_tiles);
        if (most_splits < needed_for_outputs) continue;
        t.k_splits = most_splits;
        t.l2_chunks = ceil_div(k_tiles, most_splits) - kTilesPerWarp;
        t.l2_chunks = t.l2_chunks > 1 ? t.l2_chunks : 1;
      }
      t.threads = 32 * row_tiles * t.k_splits;
      t.padded_k = 16 * (kTilesPerWarp + t.l2_chunks) * t.k_splits;
      t.weight_l2_bytes = t.threads / 32 * t.l2_chunks * static_cast<int>(sizeof(uint4)) * 32;
      t.num_partials = t.k_splits;
      t.partial_stride = shape.batch * t.rows_per_cta;
      t.weight_smem_bytes = weight_smem_bytes(t.threads);
      t.smem_bytes = cta_shared_bytes(staged_bytes(t, shape.batch), partial_floats(t)) +
                     t.weight_smem_bytes;
      if (t.threads <= 1024) result.push_back(t);
    }
    return result;
  }

  __device__ static uint32_t pack(__nv_bfloat16 low, __nv_bfloat16 high) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(low)) | (static_cast<uint32_t>(__bfloat16_as_ushort(high)) << 16);
  }

  // The B fragments of one 16 k x 8 samples tile of the staged vector for each of kSampleTiles sample tiles: one
  // ldmatrix .x2 for one tile, one .x4 per two tiles (each 8 x 8 matrix is 8 samples' rows of 8 k; `pair_address[q]`
  // is this lane's row of sample tiles 2q and 2q + 1, `offset` the k-tile's byte offset in it).
  template <int kSampleTiles>
  __device__ static void load_fragments(uint32_t (&b)[kSampleTiles][2], const uint32_t* pair_address, int offset) {
    if constexpr (kSampleTiles == 1) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                   : "=r"(b[0][0]), "=r"(b[0][1])
                   : "r"(pair_address[0] + offset)
                   : "memory");  // reads shared memory: keeps it after the wait for the staging
    } else {
#pragma unroll
      for (int q = 0; q < kSampleTiles / 2; ++q) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b[2 * q][0]), "=r"(b[2 * q][1]), "=r"(b[2 * q + 1][0]), "=r"(b[2 * q + 1][1])
                     : "r"(pair_address[q] + offset)
                     : "memory");
      }
    }
  }

  // d += a b for one 16 x 16 weight tile (A fragment a) and one 16 k x 8 samples tile (B fragment b), in fp32.
  __device__ static void mma(float (&d)[4], const uint4& a, const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]));
  }

  // shared_weights: weight_smem_bytes(threads) of the CTA's shared memory, 16-byte aligned, for this CTA alone.
  __device__ void load_weights(const RnnParams<__nv_bfloat16>& p, int cta, void* shared_weights) {
    const Tiling& t = p.tiling;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    row_tile = warp % t.row_groups;
    split = warp / t.row_groups;
    const int row = row_tile * kRowsPerTile + lane / 4;
    uint4* shared = static_cast<uint4*>(shared_weights) + warp * kSharedTiles * 32 + lane;
    shared_weight = shared;
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      const uint4 fragment = fragment_of(p, cta, row, j);
      if (j < kRegisterTiles) {
        weight[j][0] = fragment.x;
        weight[j][1] = fragment.y;
        weight[j][2] = fragment.z;
        weight[j][3] = fragment.w;
      } else {
        shared[32 * (j - kRegisterTiles)] = fragment;
      }
    }
    if constexpr (kL2Tiles) {
      // Each lane reads back only what it wrote here, so no fence or barrier stands between.
      uint4* l2 = l2_tiles_of(p);
      for (int j = 0; j < t.l2_chunks; ++j) l2[32 * j] = fragment_of(p, cta, row, kTilesPerWarp + j);
    }
  }

  // This lane's fragment of the warp's k-tile kt_j, as load_weights lays the shared and L2 tiles out.
  __device__ uint4 fragment_of(const RnnParams<__nv_bfloat16>& p, int cta, int row, int j) const {
    const int k = 16 * (split + j * p.tiling.k_splits) + 2 * (threadIdx.x % 4);
    uint32_t fragment[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // (row, k), (row + 8, k), (row, k + 8), (row + 8, k + 8)
      const int r = row + 8 * (i % 2), c = k + 8 * (i / 2);
      fragment[i] = pack(weight_at(p, cta, r, c), weight_at(p, cta, r, c + 1));
    }
    return make_uint4(fragment[0], fragment[1], fragment[2], fragment[3]);
  }

  // This lane's fragment of the warp's first L2 tile in the workspace; tile j at [32 * j].
  __device__ static uint4* l2_tiles_of(const RnnParams<__nv_bfloat16>& p) {
    const int cta = blockIdx.x % p.tiling.num_ctas;
    return reinterpret_cast<uint4*>(p.l2_weights) + static_cast<size_t>(cta) * (p.tiling.weight_l2_bytes / 16) +
           threadIdx.x / 32 * p.tiling.l2_chunks * 32 + threadIdx.x % 32;
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
    if constexpr (kMaxSampleTiles == 4) {
      multiply_sample_tiles<4>(p, staged, partials);
    } else if (p.batch > 8) {
      multiply_sample_tiles<2>(p, staged, partials);
    } else {
      multiply_sample_tiles<1>(p, staged, partials);
    }
  }

 private:
  template <int kSampleTiles>
  __device__ void multiply_sample_tiles(const RnnParams<__nv_bfloat16>& p, const __nv_bfloat16* staged,
                                        float* partials) const {
    static_assert(kSampleTiles == 1 || kSampleTiles % 2 == 0, "sample tiles load in pairs");
    const Tiling& t = p.tiling;
    const int lane = threadIdx.x % 32;
    // ldmatrix: lanes 0-7 give the rows (samples 0-7) of k 0-7 of the tile, lanes 8-15 those of k 8-15, lanes 16-31
    // the same for samples 8-15; each further pair of sample tiles 16 samples on.
    constexpr int kPairs = kSampleTiles == 1 ? 1 : kSampleTiles / 2;
    uint32_t pair_address[kPairs];
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      const int sample = 16 * q + lane % 8 + 8 * (lane / 16);
      const int sample_row = sample < p.batch ? sample : p.batch;
      pair_address[q] = static_cast<uint32_t>(
          __cvta_generic_to_shared(staged + sample_row * staged_stride(t) + ((lane / 8) % 2) * 8));
    }
    // The B fragments (and shared A fragments) of tile j + 1 load while tile j multiplies. Consecutive MMAs must not
    // wait on each other: one sample tile alternates between two accumulators, two or more sample tiles are
    // independent already (a second accumulator each would make the 64-register variant spill).
    constexpr int kAccumulators = kSampleTiles == 1 ? 2 : 1;
    uint32_t b[2][kSampleTiles][2];
    uint4 a[2];
    float sum[kAccumulators][kSampleTiles][4] = {};
    load_fragments<kSampleTiles>(b[0], pair_address, 32 * split);  // 16 bf16 = 32 bytes per k-tile
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      if (j + 1 < kTilesPerWarp) {
        load_fragments<kSampleTiles>(b[(j + 1) % 2], pair_address, 32 * (split + (j + 1) * t.k_splits));
        if (j + 1 >= kRegisterTiles) a[(j + 1) % 2] = shared_weight[32 * (j + 1 - kRegisterTiles)];
      }
      const uint32_t a0 = j < kRegisterTiles ? weight[j][0] : a[j % 2].x;
      const uint32_t a1 = j < kRegisterTiles ? weight[j][1] : a[j % 2].y;
      const uint32_t a2 = j < kRegisterTiles ? weight[j][2] : a[j % 2].z;
      const uint32_t a3 = j < kRegisterTiles ? weight[j][3] : a[j % 2].w;
#pragma unroll
      for (int n = 0; n < kSampleTiles; ++n) mma(sum[j % kAccumulators][n], make_uint4(a0, a1, a2, a3), b[j % 2][n]);
    }
    if constexpr (kL2Tiles) {
      // Unrolled so that several tiles' loads are in flight at once; the loads skip L1, which full shared memory leaves
      // small. One accumulator: the index of a second would depend on the run-time trip count.
      const uint4* l2 = l2_tiles_of(p);
#pragma unroll 4
      for (int j = 0; j < t.l2_chunks; ++j) {
        uint32_t b_l2[kSampleTiles][2];
        load_fragments<kSampleTiles>(b_l2, pair_address, 32 * (split + (kTilesPerWarp + j) * t.k_splits));
        const uint4 a_l2 = __ldcg(l2 + 32 * j);
#pragma unroll
        for (int n = 0; n < kSampleTiles; ++n) mma(sum[0][n], a_l2, b_l2[n]);
      }
    }
    // Accumulator layout: d0, d1 at (row gid, samples 2 tig, 2 tig + 1); d2, d3 at row gid + 8.
    const int row = row_tile * kRowsPerTile + lane / 4;
#pragma unroll
    for (int n = 0; n < kSampleTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int out_sample = 8 * n + 2 * (lane % 4) + i % 2;
        if (out_sample < p.batch) {
          float total = 0.f;
#pragma unroll
          for (int acc = 0; acc < kAccumulators; ++acc) total += sum[acc][n][i];
          partials[(split * p.batch + out_sample) * t.rows_per_cta + row + 8 * (i / 2)] = total;
        }
      }
    }
  }
};

}  // namespace prnn
