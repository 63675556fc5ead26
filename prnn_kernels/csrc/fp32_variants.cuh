// The fp32 kernels compiled for a cell: the cell's register-only variants (fp32_forward.cu, fp32_backward.cu), then
// three that keep what the registers cannot hold in shared memory, tried by the planner only where no register-only
// variant runs the launch (plan.cpp): 2 rows x 8 chunks in up to 512 threads, 3 x 8 and 5 x 6 in up to 384. Between
// them they cover the row counts per CTA that larger matrices need (NOTES.md v21).
#pragma once

#include <vector>

#include "engine.cuh"
#include "fp32_math.cuh"

namespace prnn {

template <class Cell>
std::vector<KernelVariant> fp32_variants(std::vector<KernelVariant> in_registers) {
  for (const KernelVariant& variant :
       {kernel_variant<Fp32Math<2, 8, 512, true>, Cell>(), kernel_variant<Fp32Math<3, 8, 384, true>, Cell>(),
        kernel_variant<Fp32Math<5, 6, 384, true>, Cell>()}) {
    in_registers.push_back(variant);
  }
  return in_registers;
}

}  // namespace prnn
