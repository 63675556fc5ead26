// bf16 forward kernels of every cell.
#include "bf16_variants.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> bf16_forward_variants(CellKind cell) {
  switch (cell) {
    case CellKind::kGru:
      return bf16_variants<GruForward<__nv_bfloat16>>();
    case CellKind::kLstm:
      return bf16_variants<LstmForward<__nv_bfloat16>>();
    default:
      return bf16_variants<VanillaForward<__nv_bfloat16>>();
  }
}

}  // namespace prnn
