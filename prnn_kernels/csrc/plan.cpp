// The one tiling chooser and the one launch path for every persistent kernel (torch-free host code).
//
// Each compiled variant proposes tilings for a shape (its geometry); here they are held to the device's limits read
// from its properties (threads, registers and shared memory through the occupancy query, co-residency of all CTAs) and
// the cheapest is kept: first the cluster engine's wherever one fits (one cluster a direction, bf16, up to 8 utterances
// and 8 KB of the vector a step, weights in registers: faster than the plain engine at every such shape measured,
// NOTES.md "The cluster engine lands"), then one CTA per SM, then (bf16) CTAs of at most 16 warps, then the least work
// per busy sub-partition (rows x padded K over the SM's sub-partitions the CTA's warps occupy, at most four), then the
// fewest CTAs, then the fewest threads that still give each (unit, sample) element a thread of its own and each
// sub-partition a warp (kMinThreads), then the largest cluster of the sizes offered (cluster_sizes: the fewest L2 reads
// of each step's vector, stage.cuh), then fewer CTAs after rounding to whole clusters. Variants that keep weights in
// shared memory are tried only where the register-only variants cannot run all of the launch's directions at once, and
// those that re-read some from L2 every step only where nothing else runs one direction (choose_plan). An fp32 tiling
// runs in the plain or the chained engine as chains_for says (fp32_variants.cuh); a chained launch adds a sync
// warpgroup to the tiling's threads (launch_threads).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>

#include "persistent_rnn.h"

namespace prnn {
namespace {

std::vector<KernelVariant> kernel_variants(Precision precision, Pass pass, CellKind cell) {
  if (precision == Precision::kFloat32) {
    return pass == Pass::kForward ? fp32_forward_variants(cell) : fp32_backward_variants(cell);
  }
  return pass == Pass::kForward ? bf16_forward_variants(cell) : bf16_backward_variants(cell);
}

// Between tilings of equal work, the one with fewer warps (more k-tiles each, fewer partial sums to add) ran every bf16
// pass it changed up to 27 % faster on an H100, but for the ReLU at 512 and 768 with 16 utterances, where each thread
// then finished two elements (3-14 % slower), and the GRU's forward at 256 on 64 threads (up to 11 % slower; NOTES.md,
// "Threads per CTA"). fp32 tilings of equal work have had equal threads at every shape measured.
constexpr int kSubPartitions = 4;  // an SM's warp schedulers; a warp runs on one of them
constexpr int kMinThreads = 32 * kSubPartitions;

// bf16 CTAs of more than 16 warps come from the 4-tile variant, where its K splits pad K least (H = 800: 26 warps, 13
// partial sums to add for each element). They are taken only where no tiling of 16 warps or fewer fits: that changes
// 308 of 5170 bf16 plans (H = 64 to 4096 in steps of 32, 1 to 32 utterances, one and two directions), and 36 of them
// drawn at random each ran forward+backward 4-13 % faster (median 8 %), forward up to 25 % (the LSTM at 800; NOTES.md
// v32).
constexpr int kMostBf16Threads = 512;

// A CTA of fewer than four warps leaves sub-partitions idle, so its work per CTA understates how long it takes: the
// fp32 ReLU at 512 ran 33-38 % faster on 32 CTAs of four warps than on 128 of one, the same work per warp on a quarter
// of the CTAs to hand off. Where more warps would add work per busy sub-partition (the ReLU at 768: three warps on 96
// CTAs rather than six on 48) the fewer CTAs were 1-10 % slower (NOTES.md, "Work per busy sub-partition").
double work_per_busy_partition(const Tiling& t) {
  const int busy_partitions = std::min(t.threads / 32, kSubPartitions);
  return static_cast<double>(t.rows_per_cta) * t.padded_k / busy_partitions;
}

// Thread-block cluster sizes tried for every tiling, largest first (8 is the largest every GPU of compute capability
// 9.0 takes), powers of two only (stage.cuh's row_slice shifts by their logarithm); a tiling that fits at all fits
// with 1. A cluster reads each step's vector from L2 once for all its CTAs, but each of them waits for all of their
// copies. Measured on an H100 (NOTES.md, "Cluster sizes by precision"): in bf16 clusters of 2 took up to 23 % off a
// pass against none, and 8 up to 9 % against 4; an fp32 launch of one direction ran up to 9 % faster in none than in
// clusters of 2 wherever the planner had picked 2 (about as fast at 1 utterance), while both directions of the fp32
// ReLU at 1536 in one launch ran 4-6 % slower in none at 8 utterances.
std::vector<int> cluster_sizes(Precision precision, int directions) {
  if (precision == Precision::kFloat32 && directions == 1) return {8, 4, 1};
  return {8, 4, 2, 1};
}

// The launch every plan makes, for the occupancy query and for launch().
struct LaunchConfig {
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attributes[2];

  LaunchConfig(const Tiling& tiling, int directions, cudaStream_t stream) : config{}, attributes{} {
    config.gridDim = dim3(directions * tiling.num_ctas);
    config.blockDim = dim3(launch_threads(tiling));
    config.dynamicSmemBytes = tiling.smem_bytes;
    config.stream = stream;
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = tiling.cluster_size;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    // Cooperative: the driver launches all CTAs at once or fails, so no CTA spins on one that never starts.
    attributes[1].id = cudaLaunchAttributeCooperative;
    attributes[1].val.cooperative = 1;
    config.attrs = attributes;
    config.numAttrs = 2;
  }
};

LaunchPlan refuse(const std::string& reason) { return LaunchPlan{false, reason, Tiling{}, nullptr}; }

std::string cuda_failure(const char* what, cudaError_t error) {
  return std::string(what) + " failed: " + cudaGetErrorString(error);
}

LaunchPlan choose(Precision precision, Pass pass, CellKind cell, int hidden, int batch, int directions, int device,
                  WeightHome farthest) {
  if (batch < 1 || batch > kMaxBatch) {
    return refuse("batch size " + std::to_string(batch) + " is out of range: the persistent kernel runs 1.." +
                  std::to_string(kMaxBatch) + " samples");
  }
  if (hidden < 1) return refuse("hidden size must be positive, got " + std::to_string(hidden));
  int num_sms = 0, smem_optin = 0, cooperative = 0, l2_bytes = 0;
  cudaError_t error = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
  if (error != cudaSuccess) return refuse(cuda_failure("reading the device properties", error));
  if (!cooperative) return refuse("the device cannot launch cooperative kernels, so CTAs cannot be made co-resident");

  bool found = false;
  Tiling best{};
  const void* best_kernel = nullptr;
  std::tuple<bool, int, bool, double, int, bool, int, int, int> best_score;
  int fewest_ctas_not_resident = 0, most_resident = 0;  // for the reason when nothing fits
  bool l2_tried = false;
  const int gates = gates_of(cell);
  const MatrixShape shape = pass == Pass::kForward ? MatrixShape{hidden, gates, hidden, batch, smem_optin}
                                                   : MatrixShape{hidden, 1, gates * hidden, batch, smem_optin};
  for (const KernelVariant& variant : kernel_variants(precision, pass, cell)) {
    error = cudaFuncSetAttribute(variant.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin);
    // The cluster engine's clusters take up to 16 CTAs; past 8 a kernel must allow it.
    if (error == cudaSuccess) {
      error = cudaFuncSetAttribute(variant.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    if (error != cudaSuccess) return refuse(cuda_failure("cudaFuncSetAttribute", error));
    for (const Tiling& t : variant.tilings(shape)) {
      if (t.threads > variant.max_threads || t.smem_bytes > smem_optin) continue;
      const WeightHome home = t.weight_l2_bytes > 0    ? WeightHome::kSharedAndL2
                              : t.weight_smem_bytes > 0 ? WeightHome::kShared
                                                        : WeightHome::kRegisters;
      if (home > farthest) continue;
      l2_tried = l2_tried || home == WeightHome::kSharedAndL2;
      int per_sm = 0;
      error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, variant.kernel, launch_threads(t), t.smem_bytes);
      if (error != cudaSuccess) return refuse(cuda_failure("cudaOccupancyMaxActiveBlocksPerMultiprocessor", error));
      if (per_sm == 0) continue;
      const std::vector<int> sizes =
          t.one_cluster ? std::vector<int>{t.num_ctas} : cluster_sizes(precision, directions);
      for (const int cluster_size : sizes) {
        Tiling candidate = t;
        candidate.cluster_size = cluster_size;
        candidate.num_ctas = (t.num_ctas + cluster_size - 1) / cluster_size * cluster_size;
        const int ctas = directions * candidate.num_ctas;
        if (t.weight_l2_bytes > 0) {
          // Weights read again every step want most SMs' share of the L2's bandwidth: on fewer than half of them (the
          // bf16 LSTM at 2304 and 8 utterances, 24 CTAs) a layer ran 2.5x slower than cuDNN. And no more of them than
          // the L2 holds: re-reading more than ~42 MB of an H100's 50 slows towards HBM's rate ("The L2's rate"), yet
          // the fp32 GRU at 2304 with 49.5 MB still ran 2.1x cuDNN. For bf16 no more than three quarters: cuDNN is
          // about three times faster in fp16 than in fp32, and the bf16 LSTM at 2816 with 40-46 MB in L2 only matched
          // it (NOTES.md v23).
          const long long budget = precision == Precision::kFloat32 ? l2_bytes : l2_bytes / 4 * 3;
          if (2 * ctas < num_sms || static_cast<long long>(ctas) * t.weight_l2_bytes > budget) continue;
        }
        int resident = per_sm * num_sms;
        if (cluster_size > 1) {  // clusters are placed whole within a GPC, so fewer CTAs may fit
          int clusters = 0;
          LaunchConfig launch_config(candidate, directions, nullptr);
          launch_config.config.numAttrs = 1;  // the query takes the cluster shape only
          error = cudaOccupancyMaxActiveClusters(&clusters, variant.kernel, &launch_config.config);
          if (error != cudaSuccess) return refuse(cuda_failure("cudaOccupancyMaxActiveClusters", error));
          resident = std::min(resident, clusters * cluster_size);
        }
        if (ctas > resident) {
          if (fewest_ctas_not_resident == 0 || ctas < fewest_ctas_not_resident) {
            fewest_ctas_not_resident = ctas;
            most_resident = resident;
          }
          continue;
        }
        const int ctas_per_sm = (ctas + num_sms - 1) / num_sms;
        const bool too_few_threads = t.threads < std::max(kMinThreads, t.units_per_cta * batch);
        const bool too_many_threads = precision == Precision::kBFloat16 && t.threads > kMostBf16Threads;
        const auto score = std::make_tuple(!t.one_cluster, ctas_per_sm, too_many_threads, work_per_busy_partition(t),
                                           t.num_ctas, too_few_threads, t.threads, -cluster_size, candidate.num_ctas);
        if (!found || score < best_score) {
          found = true;
          best = candidate;
          best_kernel = variant.kernel;
          best_score = score;
        }
      }
    }
  }
  if (found) return LaunchPlan{true, "", best, best_kernel};

  const char* cell_name[] = {"ReLU RNN", "tanh RNN", "GRU", "LSTM"};
  char megabytes[32];
  std::snprintf(megabytes, sizeof(megabytes), "%.1f",
                static_cast<double>(directions) * gates * hidden * hidden *
                    (precision == Precision::kFloat32 ? 4 : 2) / 1e6);
  std::string reason = std::string(directions == 2 ? "both directions' " : "") + "weights of a " +
                       cell_name[static_cast<int>(cell)] + " of hidden size " + std::to_string(hidden) + " (" +
                       (precision == Precision::kFloat32 ? "fp32" : "bf16") + ", " + megabytes +
                       " MB) do not fit on chip on this device (" + std::to_string(num_sms) + " SMs)";
  if (l2_tried) {
    reason += ", not even with what does not fit read again from its L2 (" + std::to_string(l2_bytes >> 20) +
              " MB) every step";
  }
  if (fewest_ctas_not_resident > 0) {
    reason += ": the smallest tiling that fits one SM's registers and shared memory needs " +
              std::to_string(fewest_ctas_not_resident) + " co-resident CTAs, the device holds " +
              std::to_string(most_resident);
  } else {
    reason += ": no tiling fits one SM's registers and shared memory with batch " + std::to_string(batch);
  }
  return refuse(reason);
}

// Registers first. Where they cannot hold all of the launch's directions at once, part of the weights goes to shared
// memory: for one direction because nothing else fits, for two because one launch of both beat one register-only
// launch per direction at every shape it changed, by 7-34 % a layer's forward+backward (H100, NOTES.md v19). Where
// the chip cannot hold one direction's weights at all, what it cannot hold is read from L2 every step; never for two
// directions at once, which would put on L2 what one launch per direction keeps on chip. The caller falls back to one
// launch per direction where no plan holds both.
LaunchPlan choose_plan(Precision precision, Pass pass, CellKind cell, int hidden, int batch, int directions,
                       int device) {
  const LaunchPlan in_registers = choose(precision, pass, cell, hidden, batch, directions, device,
                                         WeightHome::kRegisters);
  if (in_registers.ok) return in_registers;
  const LaunchPlan on_chip = choose(precision, pass, cell, hidden, batch, directions, device, WeightHome::kShared);
  if (on_chip.ok || directions > 1) return on_chip;
  return choose(precision, pass, cell, hidden, batch, directions, device, WeightHome::kSharedAndL2);
}

}  // namespace

LaunchPlan plan_launch(Precision precision, Pass pass, CellKind cell, int hidden, int batch, int directions) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int, int, int, int, int>, LaunchPlan> cache;
  int device = 0;
  const cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return refuse(cuda_failure("cudaGetDevice", error));
  const auto key = std::make_tuple(device, static_cast<int>(precision), static_cast<int>(pass),
                                   static_cast<int>(cell), hidden, batch, directions);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found == cache.end()) {
    found = cache.emplace(key, choose_plan(precision, pass, cell, hidden, batch, directions, device)).first;
  }
  return found->second;
}

template <class Element>
cudaError_t launch(const LaunchPlan& plan, const LayerParams<Element>& params, int directions, cudaStream_t stream) {
  LaunchConfig launch_config(plan.tiling, directions, stream);
  void* arguments[] = {const_cast<LayerParams<Element>*>(&params)};
  return cudaLaunchKernelExC(&launch_config.config, plan.kernel, arguments);
}

template cudaError_t launch<float>(const LaunchPlan&, const LayerParams<float>&, int, cudaStream_t);
template cudaError_t launch<__nv_bfloat16>(const LaunchPlan&, const LayerParams<__nv_bfloat16>&, int, cudaStream_t);

}  // namespace prnn
