// The persistent loops shared by every cell, pass and precision: the plain engine and the chained engine.
//
// Math (fp32_math.cuh, mma_math.cuh) holds this CTA's rows of the matrix on chip and multiplies the staged vector
// by them; Cell (vanilla_cell.cuh, gated_cells.cuh) finishes each (hidden unit, sample) element from the recurrent
// products of its kRowGates rows and returns the kVectorGates values it publishes. A thread finishes up to
// Math::kElementsPerThread elements, whose cell state stays in its registers.
//
// The plain engine, per step, with the whole CTA:
//   wait until every CTA of this direction published the previous vector (the step count, sync.cuh) -> start staging
//   the vector in shared memory (bulk copies shared by the cluster, stage.cuh) -> start loading the cells' inputs ->
//   wait for the staged vector -> multiply into per-warp partial sums -> reduce, finish, store the CTA's slice of the
//   next vector -> count the step.
// A CTA whose wait timed out (the launch is failing and Python will raise) stops waiting but runs the remaining
// steps: the other CTAs of its cluster wait for its share of every step's staging.
//
// The chained engine (fp32 layers with enough work per CTA, fp32_variants.cuh) splits the samples into tiling.chains
// chains (1 or kChains), each with its own step count and staged rows, and hands each chain's step off in a sync
// warpgroup: per chain one warp counts the chain's step once the compute warps' stores are done, one waits for the
// count and issues the staging copies. The compute warps run chain 0's step, then chain 1's, never waiting for a
// count: while they multiply one chain, the other chain's vector travels between the SMs (NOTES.md v24). With one
// chain (one or two utterances) only the hand-off moves off the compute warps.
//
// The cluster engine (bf16 layers small enough for one cluster of at most 16 CTAs a direction, up to 8 utterances and
// 8 KB of the vector a step) keeps the plain engine's multiply and cells but hands each step off inside the cluster:
// each CTA sends its slice of the next vector straight into every CTA's shared memory (st.async, counted on the
// receiver's mbarrier), so no step goes through global memory or a gpu-scope release (about 1.5 us a step through L2,
// 0.4-0.8 us in a cluster; NOTES.md, "Probe after v30"). It still writes each step's fp32 vector to RnnParams::state,
// which the gather after the launch, h_n and the backward read.
#pragma once

#include <type_traits>

#include "element.cuh"
#include "stage.cuh"
#include "sync.cuh"

namespace prnn {

// The vanilla cells: one matrix row and one published value per element.
template <class Cell>
constexpr bool vanilla_cell = Cell::kRowGates == 1 && Cell::kVectorGates == 1;

// The (hidden unit, sample) elements of the chained engine. `lanes` neighbouring lanes reduce an element's partial
// sums together, and the first of them, its owner, keeps the element's cell state and finishes it: group g =
// threadIdx.x / lanes holds elements e = g + u * threads / lanes for u < Math::kElementsPerThread. Four lanes for the
// gated cells where the CTA's elements fit four to a group, else one: a lane summing a GRU unit's 3 x 12 partials
// alone took 0.38 us of the fp32 GRU 1152's 3.47 us forward step at 4 utterances, and four lanes took the backward
// step there from 3.69 to 3.20 us, while the vanilla cells and two lanes (16 utterances) ran as fast or faster with
// one (NOTES.md v27, v28).
template <class Math, class Cell>
struct Elements {
  static constexpr int kCount = Math::kElementsPerThread;
  static constexpr int kMostLanes = vanilla_cell<Cell> ? 1 : 4;
  using Element = typename Cell::Element;
  Cell cell[kCount];
  int unit_local[kCount];
  int sample[kCount];
  bool active[kCount];  // the element exists (in every lane of its group)
  int lanes;
  bool owner;

  __device__ void init(const RnnParams<Element>& p, int cta, int threads) {
    const int units = p.tiling.units_per_cta;
    lanes = p.batch * units <= kCount * (threads / kMostLanes) ? kMostLanes : 1;
    owner = threadIdx.x % lanes == 0;
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      const int e = threadIdx.x / lanes + u * (threads / lanes);
      sample[u] = e / units;
      unit_local[u] = e - sample[u] * units;
      active[u] = sample[u] < p.batch && cta * units + unit_local[u] < p.hidden;
      if (active[u] && owner) cell[u].init(p, cta * units + unit_local[u], sample[u]);
    }
  }

  // Starts loading the step's inputs of the elements in `runs`.
  __device__ void load(const RnnParams<Element>& p, int step, int cta, const bool (&runs)[kCount]) {
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      if (runs[u] && owner) cell[u].load(p, step, cta * p.tiling.units_per_cta + unit_local[u], sample[u]);
    }
  }

  // Finishes the step of the elements in `runs` from the per-warp partial sums and stores what they publish. Each lane
  // of a group sums every lanes-th partial in order, then the group adds its lanes' sums pairwise. The tilings of those
  // cells pad partial_stride to 8 modulo 32 floats (chained_tilings), so that a group's four loads hit different banks.
  __device__ void finish(const RnnParams<Element>& p, int step, int cta, const float* partials,
                         const bool (&runs)[kCount]) {
    const Tiling& t = p.tiling;
    const size_t vector_size = static_cast<size_t>(p.batch) * p.state_stride;
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      if (kMostLanes > 1 && !__any_sync(0xffffffffu, runs[u])) continue;  // warp-uniform: the shuffles need every lane
      float recurrent[Cell::kRowGates] = {};
      if (runs[u]) {
        const float* element_partials = partials + sample[u] * t.rows_per_cta + unit_local[u];
#pragma unroll 4
        for (int q = threadIdx.x % lanes; q < t.num_partials; q += lanes) {
#pragma unroll
          for (int gate = 0; gate < Cell::kRowGates; ++gate) {
            recurrent[gate] += element_partials[q * t.partial_stride + gate * t.units_per_cta];
          }
        }
      }
      for (int offset = 1; kMostLanes > 1 && offset < lanes; offset *= 2) {
#pragma unroll
        for (int gate = 0; gate < Cell::kRowGates; ++gate) {
          recurrent[gate] += __shfl_xor_sync(0xffffffffu, recurrent[gate], offset);
        }
      }
      if (runs[u] && owner) {
        const int unit = cta * t.units_per_cta + unit_local[u];
        float published[Cell::kVectorGates];
        cell[u].finish(p, step, unit, sample[u], recurrent, published);
        float* next = p.state + (step + 1) * vector_size + sample[u] * p.state_stride + unit;
#pragma unroll
        for (int gate = 0; gate < Cell::kVectorGates; ++gate) next[gate * p.hidden] = published[gate];
      }
    }
  }

  __device__ void end(const RnnParams<Element>& p, int cta) {
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      if (active[u] && owner) cell[u].end(p, cta * p.tiling.units_per_cta + unit_local[u], sample[u]);
    }
  }
};

// Where the chained engine's shared memory goes (element.cuh): staged vector, partial sums, control words, weights.
template <class Math>
struct SharedLayout {
  typename Math::Staged* staged;
  float* partials;  // partials[warp * partial_stride + sample * R + row]
  uint64_t* stage_barriers;
  volatile int* stored_steps;  // (kChains,) steps whose stores the compute warps finished, per chain
  volatile int* failing;       // nonzero once a wait of this CTA failed: it counts no more steps
  void* weights;

  __device__ SharedLayout(unsigned char* smem, const Tiling& tiling, int batch) {
    const int staged_bytes = Math::staged_bytes(tiling, batch);
    staged = reinterpret_cast<typename Math::Staged*>(smem);
    partials = reinterpret_cast<float*>(smem + staged_bytes);
    unsigned char* control =
        smem + control_offset(staged_bytes, partial_floats(tiling));
    stage_barriers = reinterpret_cast<uint64_t*>(control);
    stored_steps = reinterpret_cast<int*>(stage_barriers + 2 * kChains);
    failing = stored_steps + kChains;
    weights = control + kControlBytes;
  }
};

// The plain engine keeps the elements' loops and the shared-memory layout inline: routing them through Elements and
// SharedLayout changed ptxas's register allocation in 35 of its 48 bf16 kernels (spills from none up to 44 bytes), and
// the finishing loop alone through a function shared with Elements in 34, so the chained engine has its own copy.
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
  init_staging(stage_barriers, 2);

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
    // The last thread rarely owns outputs, so no input loads of its own delay the release.
    if (threadIdx.x == blockDim.x - 1) count_step(p.step_counts);
  }
#pragma unroll
  for (int u = 0; u < Math::kElementsPerThread; ++u) {
    if (active[u]) cell[u].end(p, cta * units + unit_local[u], sample[u]);
  }
}

// Registers per thread of the chained engine's warpgroups. A launch gets launch_threads x the launch bound's registers
// (ptxas: 65536 / threads, in steps of 8, at most 255), and setmaxnreg only moves registers between the CTA's own
// warpgroups: the sync warpgroup keeps kSyncRegisters and the compute warpgroups take the rest (112 for the 512-thread
// variants instead of the plain engine's 128, 160 for the 384-thread ones instead of 168).
constexpr int kSyncRegisters = 32;
__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int compute_registers(int compute_threads) {
  return min_int(((compute_threads + 128) * min_int(65536 / (compute_threads + 128) / 8 * 8, 248) -
                  128 * kSyncRegisters) / compute_threads / 8 * 8,
                 248);
}

// Named barriers: 0 is __syncthreads, 1 the compute warps' own, 2 + c chain c's stores handed to its counting warp.
__device__ __forceinline__ void compute_barrier(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}
__device__ __forceinline__ void stores_done(int chain, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(2 + chain), "r"(threads + 32) : "memory");
}
__device__ __forceinline__ void wait_for_stores(int chain, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(2 + chain), "r"(threads + 32) : "memory");
}

// The planner gives every chain samples (chains_for, fp32_variants.cuh).
template <class Math, class Cell>
__global__ void __launch_bounds__(Math::kMaxThreads + 128, 1)
    chained_rnn_kernel(const __grid_constant__ LayerParams<typename Cell::Element> layer) {
  static_assert(std::is_same<typename Cell::Element, float>::value, "fp32 only: bf16's multiply is per 8 samples");
  static_assert(2 * kChains == 4, "one staging and one counting warp per chain fill the sync warpgroup");
  extern __shared__ __align__(16) unsigned char smem[];
  const int num_ctas = layer.direction[0].tiling.num_ctas;
  const RnnParams<float>& p = layer.direction[blockIdx.x / num_ctas];
  const int cta = blockIdx.x % num_ctas;
  const Tiling& tiling = p.tiling;
  const int threads = tiling.threads;  // compute threads; the sync warpgroup starts at the next warpgroup
  const int chain_samples = ceil_div(p.batch, tiling.chains);
  const SharedLayout<Math> shared(smem, tiling, p.batch);
  zero_shared(smem, Math::staged_bytes(tiling, p.batch));
  if (threadIdx.x == 0) {
    for (int chain = 0; chain < kChains; ++chain) shared.stored_steps[chain] = 0;
    *shared.failing = 0;
  }
  init_staging(shared.stage_barriers, 2 * kChains);  // chain c, step s: stage_barriers[2 c + s % 2]

  const int sync_warpgroup = round_up(threads, 128);
  if (threadIdx.x >= sync_warpgroup) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kSyncRegisters));
    const int warp = (threadIdx.x - sync_warpgroup) / 32;
    const int chain = warp % kChains;
    if (chain >= tiling.chains) return;
    const int first = chain * chain_samples;
    const int count = min(p.batch - first, chain_samples);
    unsigned* step_count = p.step_counts + chain * kCountStride;
    if (warp >= kChains) {  // counts the chain's step after each step's stores
      for (int step = 0; step < p.num_steps; ++step) {
        wait_for_stores(chain, threads);
        if (threadIdx.x % 32 == 0) {
          // A failing CTA stops counting: its steps no longer wait for the others', and a count they inflated could
          // let another CTA's staging run ahead of its own multiply (the mbarriers' phases).
          if (*shared.failing == 0) count_step(step_count);
          shared.stored_steps[chain] = step + 1;
        }
      }
      return;
    }
    // Step 0's published vector; step s's lies s vectors further on.
    const auto* vectors = reinterpret_cast<const char*>(Math::published(p, 0));
    const ChainStaging staging(vectors + static_cast<size_t>(first) * Math::published_row_bytes(p),
                               reinterpret_cast<const char*>(Math::published(p, 1)) - vectors,
                               Math::published_row_bytes(p),
                               reinterpret_cast<char*>(shared.staged) + first * Math::staged_row_bytes(tiling),
                               Math::staged_row_bytes(tiling), count, tiling.cluster_size,
                               shared.stage_barriers + 2 * chain);
    bool in_time = true;
    for (int step = 0; step < p.num_steps; ++step) {
      if (step > 0 && in_time) {
        // Every lane polls (one load for the warp) and acquires for the copies it issues.
        in_time = __all_sync(0xffffffffu, wait_for_count(p, step_count, step * num_ctas));
        // Set before this step's copies, whose mbarrier carries it to the compute warps and on to the counting warps.
        if (!in_time && threadIdx.x % 32 == 0) *shared.failing = 1;
      }
      if (step > 0 && !in_time) {
        // Failing: wait for this CTA's own stores of the step before alone, so that the staging still runs at most a
        // step ahead of the multiply (the mbarriers' phases) while the launch runs out its steps.
        while (shared.stored_steps[chain] < step) {
        }
      }
      staging.start(step);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(compute_registers(Math::kMaxThreads)));
  if (threadIdx.x >= threads) return;  // the last compute warpgroup's idle warps
  Math math;
  math.load_weights(p, cta, shared.weights);
  Elements<Math, Cell> elements;
  elements.init(p, cta, threads);
  bool in_chain[kChains][Elements<Math, Cell>::kCount];
#pragma unroll
  for (int chain = 0; chain < kChains; ++chain) {
#pragma unroll
    for (int u = 0; u < Elements<Math, Cell>::kCount; ++u) {
      in_chain[chain][u] = elements.active[u] && elements.sample[u] / chain_samples == chain;
    }
  }

  for (int step = 0; step < p.num_steps; ++step) {
#pragma unroll
    for (int chain = 0; chain < kChains; ++chain) {
      if (chain >= tiling.chains) break;
      const int first = chain * chain_samples;
      elements.load(p, step, cta, in_chain[chain]);
      // A chain's partial sums are rewritten after the other chain's barrier, which every warp reaches only after
      // finishing this chain's elements; a lone chain needs a barrier of its own for that.
      if (tiling.chains == 1) compute_barrier(threads);
      finish_staging(shared.stage_barriers + 2 * chain + step % 2, (step / 2) % 2);
      math.template multiply_samples<Math::kChainSamplesPerPass, true>(p, shared.staged, shared.partials, first,
                                                                       min(p.batch, first + chain_samples));
      compute_barrier(threads);
      elements.finish(p, step, cta, shared.partials, in_chain[chain]);
      stores_done(chain, threads);
    }
  }
  elements.end(p, cta);
}

// The cluster engine's shared memory: the staged vector twice (a peer may send step s + 1's slice while this CTA
// still multiplies step s's), the partial sums, the control words (two mbarriers, one per staged buffer), this CTA's
// slice of the next vector in bf16 (B, units_per_cta), then the weights a variant keeps there (none of those offered:
// bf16_variants.cuh).
template <class Math>
struct ClusterLayout {
  int staged_bytes;  // one buffer
  int control;
  int slice;
  int weights;
  int total;

  __host__ __device__ ClusterLayout(const Tiling& tiling, int batch) {
    staged_bytes = Math::staged_bytes(tiling, batch);
    control = control_offset(2 * staged_bytes, partial_floats(tiling));
    slice = control + kControlBytes;
    weights = slice + round_up(batch * tiling.units_per_cta * 2, 16);
    total = weights + tiling.weight_smem_bytes;
  }
};

// The largest cluster a GPU of compute capability 9.0 takes (non-portable above 8); the most utterances the cluster
// engine runs (one MMA sample tile); and the most bytes of the vector each CTA receives a step: the hand-off grows with
// them, and the engine was measured faster than the plain one up to 8 KB and level at 16 (NOTES.md, "The cluster
// engine lands").
constexpr int kMaxClusterCtas = 16;
constexpr int kMaxClusterBatch = 8;
constexpr int kMaxClusterVectorBytes = 8192;

__device__ __forceinline__ uint32_t cluster_address(uint32_t local_address, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_address), "r"(rank));
  return remote;
}

// Waits, bounded by the timeout, until the mbarrier's phase of this `parity` completed: every CTA's slice landed.
// Returns false, with the status word set, if the wait ran out of time. The clock is read only once the slices are
// found missing (a zero timeout then fails at once; the tests use that): reading it every step cost the step.
__device__ __forceinline__ bool slices_landed(uint32_t barrier_address, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred ready;\n\tmbarrier.test_wait.parity.acquire.cluster.shared::cta.b64 ready, [%1], %2;\n\t"
      "selp.b32 %0, 1, 0, ready;\n\t}"
      : "=r"(done)
      : "r"(barrier_address), "r"(parity)
      : "memory");
  return done;
}

template <class Element>
__device__ bool wait_for_slices(const RnnParams<Element>& p, uint64_t* barrier, uint32_t parity) {
  const uint32_t address = shared_address(barrier);
  if (slices_landed(address, parity)) return true;
  const unsigned long long start = global_ns();
  while (!slices_landed(address, parity)) {
    if (global_ns() - start >= p.timeout_ns) {
      atomicCAS(p.status, 0, kStatusTimedOut);
      return false;
    }
  }
  return true;
}

// One direction per cluster: CTA `cta` of its direction is rank `cta` of the cluster (cluster_size = num_ctas).
template <class Math, class Cell>
__device__ __forceinline__ void cluster_rnn_direction(const RnnParams<__nv_bfloat16>& p, const int cta) {
  static_assert(std::is_same<typename Cell::Element, __nv_bfloat16>::value, "slices travel in bf16");
  static_assert(Cell::kVectorGates == 1, "a CTA's slice of the next vector is one run of units");
  extern __shared__ __align__(16) unsigned char smem[];
  const int num_ctas = p.tiling.num_ctas;
  const Tiling& tiling = p.tiling;
  const int rows = tiling.rows_per_cta;
  const int units = tiling.units_per_cta;
  const ClusterLayout<Math> layout(tiling, p.batch);
  const int staged_stride = Math::staged_stride(tiling);
  auto* staged = reinterpret_cast<__nv_bfloat16*>(smem);  // buffer b at staged + b * staged_elements
  const int staged_elements = layout.staged_bytes / 2;
  float* partials = reinterpret_cast<float*>(smem + 2 * layout.staged_bytes);  // (num_partials, B, R)
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + layout.control);
  auto* slice = reinterpret_cast<__nv_bfloat16*>(smem + layout.slice);

  Math math;
  math.load_weights(p, cta, smem + layout.weights);
  zero_shared(smem, layout.weights);  // padding samples and k >= K stay zero for the whole sequence
  __syncthreads();
  // Step 0 multiplies the vector published before the launch (hx, or the backward's zero), read by each CTA itself.
  const __nv_bfloat16* first = Math::published(p, 0);
  for (int i = threadIdx.x; i < p.batch * p.vector_length; i += blockDim.x) {
    const int sample = i / p.vector_length, k = i - sample * p.vector_length;
    staged[sample * staged_stride + k] = first[sample * p.state_bf16_stride + k];
  }
  const uint32_t step_bytes = static_cast<uint32_t>(num_ctas * p.batch * units * 2);
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barriers + b)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // Buffer s % 2 receives the vector step s multiplies; arm it for step 1's.
    if (p.num_steps > 1) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barriers + 1)),
                   "r"(step_bytes)
                   : "memory");
    }
  }

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
    if (active[u]) {
      cell[u].init(p, cta * units + unit_local[u], sample[u]);
      // Each step's inputs load a step ahead, once the step before has handed off: a step here is short enough that
      // loads issued at its start still ran when its cells needed them.
      cell[u].load(p, 0, cta * units + unit_local[u], sample[u]);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the zeroing, then the peers' asynchronous stores
  cluster_sync();  // every CTA's barriers initialised and staged buffers zeroed before any slice arrives

  const size_t vector_size = static_cast<size_t>(p.batch) * p.state_stride;
  // Each thread sends one 16-byte chunk of this CTA's slice (one_cluster_tilings: no more chunks than threads) to
  // every rank_stride-th peer from its first_rank, into the same place of each peer's staged buffer: worked out here
  // once, the two divisions it takes are off every step's hand-off.
  const int chunks = p.batch * units / 8;
  const int chunk = threadIdx.x % chunks, first_rank = threadIdx.x / chunks, rank_stride = blockDim.x / chunks;
  const int chunk_row = chunk / (units / 8), chunk_part = chunk - chunk_row * (units / 8);
  const uint32_t chunk_to = shared_address(staged + chunk_row * staged_stride + cta * units + 8 * chunk_part);
  for (int step = 0; step < p.num_steps; ++step) {
    const int buffer = step % 2;
    const bool timed_out = step > 0 && !wait_for_slices(p, barriers + buffer, ((step - 1) / 2) % 2);
    math.multiply(p, staged + buffer * staged_elements, partials);
    // A CTA whose wait ran out of time stops (after a multiply of whatever had landed, which nothing reads), so it
    // arms and sends no more; its peers then run out of time waiting for its slices and stop too, and all meet at
    // the cluster barrier below (Python raises from the status word). One barrier both sums the partials and agrees.
    if (__syncthreads_or(timed_out)) break;
    if (threadIdx.x == 0 && step + 2 < p.num_steps) {  // every thread is past this buffer's wait
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barriers + buffer)),
                   "r"(step_bytes)
                   : "memory");
    }
    float published[Math::kElementsPerThread][1];
#pragma unroll
    for (int u = 0; u < Math::kElementsPerThread; ++u) {
      if (active[u]) {
        // Summed as the plain engine sums them. A helper shared by the two moved ptxas's register allocation in 9 to
        // 53 of the 111 kernels (two tries, by -Xptxas -v), which no device call has measured: each keeps its copy.
        float recurrent[Cell::kRowGates] = {};
        const float* unit_partials = partials + sample[u] * rows + unit_local[u];
#pragma unroll 4
        for (int q = 0; q < tiling.num_partials; ++q) {
#pragma unroll
          for (int gate = 0; gate < Cell::kRowGates; ++gate) {
            recurrent[gate] += unit_partials[q * p.batch * rows + gate * units];
          }
        }
        cell[u].finish(p, step, cta * units + unit_local[u], sample[u], recurrent, published[u]);
        slice[sample[u] * units + unit_local[u]] = __float2bfloat16(published[u][0]);
      }
    }
    __syncthreads();
    if (step + 1 < p.num_steps && first_rank < rank_stride) {
      const int next = (step + 1) % 2;
      const uint4 value = *reinterpret_cast<const uint4*>(slice + 8 * chunk);
      const uint32_t to = chunk_to + next * layout.staged_bytes;
      const uint32_t next_barrier = shared_address(barriers + next);
      for (int rank = first_rank; rank < num_ctas; rank += rank_stride) {
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                cluster_address(to, rank)),
            "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w), "r"(cluster_address(next_barrier, rank))
            : "memory");
      }
    }
    // What the hand-off does not wait for comes after it: the published vector's fp32 copy, read after the launch,
    // and the next step's inputs, which then load behind the wait for the peers' slices.
#pragma unroll
    for (int u = 0; u < Math::kElementsPerThread; ++u) {
      if (active[u]) {
        const int unit = cta * units + unit_local[u];
        p.state[(step + 1) * vector_size + sample[u] * p.state_stride + unit] = published[u][0];
        if (step + 1 < p.num_steps) cell[u].load(p, step + 1, unit, sample[u]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < Math::kElementsPerThread; ++u) {
    if (active[u]) cell[u].end(p, cta * units + unit_local[u], sample[u]);
  }
  cluster_sync();  // no CTA leaves while a peer may still send into its shared memory
}

template <class Math, class Cell>
__global__ void __launch_bounds__(Math::kMaxThreads, 1)
    cluster_rnn_kernel(const __grid_constant__ LayerParams<typename Cell::Element> layer) {
  // Each direction gets its own inlined copy, in which p lies at a fixed offset of the parameter space and its fields
  // are immediate constant operands. Read at a run-time index, each field is a constant-cache load with a register
  // address, several in a row every step: 0.1-0.3 us of this engine's 1-2 us steps. The plain and chained engines
  // spilled with two copies and lost more than that (NOTES.md, "The cluster engine lands").
  const int num_ctas = layer.direction[0].tiling.num_ctas;
  if (static_cast<int>(blockIdx.x) < num_ctas) {
    cluster_rnn_direction<Math, Cell>(layer.direction[0], blockIdx.x);
  } else {
    cluster_rnn_direction<Math, Cell>(layer.direction[1], blockIdx.x - num_ctas);
  }
}

// Math's tilings that one cluster runs: at most kMaxClusterCtas CTAs, slices of whole 16-byte chunks (units_per_cta a
// multiple of 8), no more of them than threads, that stay inside the staged rows.
template <class Math>
std::vector<Tiling> one_cluster_tilings(const MatrixShape& shape) {
  std::vector<Tiling> result;
  if (shape.batch > kMaxClusterBatch || shape.batch * shape.k_extent * 2 > kMaxClusterVectorBytes) return result;
  for (Tiling t : Math::tilings(shape)) {
    if (t.num_ctas > kMaxClusterCtas || t.units_per_cta % 8 != 0 || t.num_ctas * t.units_per_cta > t.padded_k ||
        shape.batch * t.units_per_cta / 8 > t.threads) {
      continue;
    }
    t.one_cluster = 1;  // the planner makes the cluster the direction's num_ctas CTAs
    t.smem_bytes = ClusterLayout<Math>(t, shape.batch).total;
    result.push_back(t);
  }
  return result;
}

// The plain engine's kernel for Math and Cell, proposing `tilings` (all of Math's unless given).
template <class Math, class Cell>
KernelVariant kernel_variant(std::vector<Tiling> (*tilings)(const MatrixShape&) = &Math::tilings) {
  return {reinterpret_cast<const void*>(&persistent_rnn_kernel<Math, Cell>), Math::kMaxThreads, tilings};
}

// The chained engine's kernel for Math and Cell, proposing `tilings` (each with its chains set).
template <class Math, class Cell>
KernelVariant chained_kernel_variant(std::vector<Tiling> (*tilings)(const MatrixShape&)) {
  return {reinterpret_cast<const void*>(&chained_rnn_kernel<Math, Cell>), Math::kMaxThreads, tilings};
}

// The cluster engine's kernel for Math and Cell.
template <class Math, class Cell>
KernelVariant cluster_kernel_variant() {
  return {reinterpret_cast<const void*>(&cluster_rnn_kernel<Math, Cell>), Math::kMaxThreads,
          &one_cluster_tilings<Math>};
}

}  // namespace prnn
