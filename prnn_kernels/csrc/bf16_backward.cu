// bf16 backward-data kernels: the forward engine on U^T (one row per unit, K = G * H) with each cell's backward.
#include "bf16_variants.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> bf16_backward_variants(CellKind cell) {
  switch (cell) {
    case CellKind::kGru:
      return bf16_variants<GruBackward<__nv_bfloat16>>();
    case CellKind::kLstm:
      return bf16_variants<LstmBackward<__nv_bfloat16>>();
    default:
      return bf16_variants<VanillaBackward<__nv_bfloat16>>();
  }
}

}  // namespace prnn
