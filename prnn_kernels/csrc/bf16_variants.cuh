// The bf16 kernels compiled for a cell: 8, 16 or 40 k-tiles per warp in registers (small, mid-size, large K), and
// 32 in registers plus 32 in shared memory for matrices the register file cannot hold (GRU and LSTM at H = 2048);
// each launch bound leaves the variant the registers its fragments need.
#pragma once

#include <vector>

#include "engine.cuh"
#include "mma_math.cuh"

namespace prnn {

template <class Cell>
std::vector<KernelVariant> bf16_variants() {
  return {kernel_variant<MmaMath<8, 0, 1024>, Cell>(), kernel_variant<MmaMath<16, 0, 512>, Cell>(),
          kernel_variant<MmaMath<40, 0, 480>, Cell>(), kernel_variant<MmaMath<32, 32, 512>, Cell>()};
}

}  // namespace prnn
