// The fp32 kernels compiled for a cell: the cell's register-only variants (fp32_forward.cu, fp32_backward.cu), then
// three that keep what the registers cannot hold in shared memory, tried by the planner only where no register-only
// variant runs the launch (plan.cpp): 2 rows x 8 chunks in up to 512 threads, 3 x 8 and 5 x 6 in up to 384. Between
// them they cover the row counts per CTA that larger matrices need (NOTES.md v21). Last, two that keep what shared
// memory cannot hold either in L2, for matrices larger than the chip, tried only where nothing else runs one direction:
// 2 x 8 (16 units of an LSTM, or 16 or more of one row each in the backward) and 3 x 8 (16 GRU units) (NOTES.md v23).
#pragma once

#include <vector>

#include "engine.cuh"
#include "fp32_math.cuh"

namespace prnn {

template <class Cell>
std::vector<KernelVariant> fp32_variants(std::vector<KernelVariant> in_registers) {
  constexpr WeightHome kShared = WeightHome::kShared;
  constexpr WeightHome kL2 = WeightHome::kSharedAndL2;
  for (const KernelVariant& variant :
       {kernel_variant<Fp32Math<2, 8, 512, kShared>, Cell>(), kernel_variant<Fp32Math<3, 8, 384, kShared>, Cell>(),
        kernel_variant<Fp32Math<5, 6, 384, kShared>, Cell>(), kernel_variant<Fp32Math<2, 8, 512, kL2>, Cell>(),
        kernel_variant<Fp32Math<3, 8, 384, kL2>, Cell>()}) {
    in_registers.push_back(variant);
  }
  return in_registers;
}

}  // namespace prnn
