// The bf16 kernels compiled for a cell: 4, 8 or 20 k-tiles per warp in registers (small, mid-size, large K), and
// 16 in registers plus 16 in shared memory for matrices the register file cannot hold (GRU and LSTM at H = 2048);
// each launch bound leaves the variant the registers its fragments need (4 per tile). All take up to 16 samples;
// two more, with four sample tiles, take 17 to 32. Last, 16 in registers, 16 or 8 in shared memory and the rest in
// L2, for matrices larger than the chip, the 8 leaving room for the larger staged vectors of the backward (NOTES.md
// v23); the planner tries them only where nothing else runs one direction. Then the cluster engine's (engine.cuh).
#pragma once

#include <vector>

#include "engine.cuh"
#include "mma_math.cuh"

namespace prnn {

template <class Cell>
std::vector<KernelVariant> bf16_variants() {
  std::vector<KernelVariant> variants = {
      kernel_variant<MmaMath<4, 0, 1024>, Cell>(),        kernel_variant<MmaMath<8, 0, 512>, Cell>(),
      kernel_variant<MmaMath<20, 0, 480>, Cell>(),        kernel_variant<MmaMath<16, 16, 512>, Cell>(),
      kernel_variant<MmaMath<8, 0, 512, 4>, Cell>(),      kernel_variant<MmaMath<20, 0, 480, 4>, Cell>(),
      kernel_variant<MmaMath<16, 16, 512, 2, true>, Cell>(), kernel_variant<MmaMath<16, 8, 512, 2, true>, Cell>()};
  // The cluster engine where each CTA's slice of the next vector is one run of units (the forward passes, the vanilla
  // backward), its weights in registers; 16 tiles a warp fit a vanilla layer of 1024 on 16 CTAs of 512 threads, 20 a
  // GRU of 640 (the vanilla cells spill with 20).
  if constexpr (Cell::kVectorGates == 1) {
    variants.push_back(cluster_kernel_variant<MmaMath<8, 0, 512>, Cell>());
    variants.push_back(cluster_kernel_variant<MmaMath<16, 0, 512>, Cell>());
    if constexpr (Cell::kRowGates > 1) variants.push_back(cluster_kernel_variant<MmaMath<20, 0, 480>, Cell>());
  }
  return variants;
}

}  // namespace prnn
