// The bf16 kernels compiled for a cell: 8, 16 or 40 k-tiles per warp (small, mid-size, large K); each launch bound
// leaves the variant the registers its fragments need.
#pragma once

#include <vector>

#include "engine.cuh"
#include "mma_math.cuh"

namespace prnn {

template <class Cell>
std::vector<KernelVariant> bf16_variants() {
  return {kernel_variant<MmaMath<8, 1024>, Cell>(), kernel_variant<MmaMath<16, 512>, Cell>(),
          kernel_variant<MmaMath<40, 480>, Cell>()};
}

}  // namespace prnn
