// fp32 backward-data kernels: the forward engine on U^T (one row per unit, K = G * H) with each cell's backward.
#include "engine.cuh"
#include "fp32_math.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_backward_variants(CellKind cell) {
  switch (cell) {
    case CellKind::kGru:
      return {kernel_variant<Fp32Math<2, 8, 512>, GruBackward<float>>()};
    case CellKind::kLstm:
      return {kernel_variant<Fp32Math<2, 8, 512>, LstmBackward<float>>()};
    default:
      return {kernel_variant<Fp32Math<2, 8, 512>, VanillaBackward<float>>()};
  }
}

}  // namespace prnn
