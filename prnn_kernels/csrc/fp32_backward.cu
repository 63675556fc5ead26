// fp32 backward-data kernels: the forward engine on U^T (one row per unit, K = G * H) with each cell's backward.
// 2 rows x 8 chunks per thread, at most 512 threads; for GRU and LSTM also more weights per thread in fewer threads
// (3 x 10 and 5 x 6 in 384), which hold the 10-12 units per CTA that H = 1152 needs for its CTAs to fit. Larger
// matrices keep part of their weights in shared memory (fp32_variants.cuh).
#include "fp32_variants.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_backward_variants(CellKind cell) {
  std::vector<KernelVariant> in_registers;
  switch (cell) {
    case CellKind::kGru:
      add_variant<Fp32Math<2, 8, 512>, GruBackward<float>, false>(in_registers);
      add_variant<Fp32Math<3, 10, 384>, GruBackward<float>>(in_registers);
      return fp32_variants<GruBackward<float>>(in_registers);
    case CellKind::kLstm:
      add_variant<Fp32Math<2, 8, 512>, LstmBackward<float>, false>(in_registers);
      add_variant<Fp32Math<5, 6, 384>, LstmBackward<float>, false>(in_registers);
      return fp32_variants<LstmBackward<float>>(in_registers);
    default:
      add_variant<Fp32Math<2, 8, 512>, VanillaBackward<float>>(in_registers);
      return fp32_variants<VanillaBackward<float>>(in_registers);
  }
}

}  // namespace prnn
