// fp32 forward kernels. Vanilla and LSTM: 2 rows x 8 chunks (64 weights) per thread; GRU: its 3 gate rows x 4 chunks
// (48 weights), so a thread's rows are the three gates of one unit. At most 512 threads (128 registers each).
// Where those hold too few units per CTA for all CTAs to fit (GRU and LSTM at H = 1152: 8 units, 144 CTAs), fewer
// threads hold more weights each, in a row count with padding: GRU 2 rows x 12 chunks in 32-row CTAs (10 units),
// LSTM 5 rows x 6 chunks in 40-row CTAs (10 units); at most 384 threads (170 registers). Larger matrices keep part of
// their weights in shared memory (fp32_variants.cuh).
#include "fp32_variants.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_forward_variants(CellKind cell) {
  std::vector<KernelVariant> in_registers;
  switch (cell) {
    case CellKind::kGru:
      add_variant<Fp32Math<3, 4, 512>, GruForward<float>>(in_registers);
      add_variant<Fp32Math<2, 12, 384>, GruForward<float>>(in_registers);
      return fp32_variants<GruForward<float>>(in_registers);
    case CellKind::kLstm:
      add_variant<Fp32Math<2, 8, 512>, LstmForward<float>, false>(in_registers);
      add_variant<Fp32Math<5, 6, 384>, LstmForward<float>, false>(in_registers);
      return fp32_variants<LstmForward<float>>(in_registers);
    default:
      add_variant<Fp32Math<2, 8, 512>, VanillaForward<float>>(in_registers);
      return fp32_variants<VanillaForward<float>>(in_registers);
  }
}

}  // namespace prnn
