// fp32 forward kernels. Vanilla and LSTM: 2 rows x 8 chunks (64 weights) per thread; GRU: its 3 gate rows x 4 chunks
// (48 weights), so a thread's rows are the three gates of one unit. At most 512 threads (128 registers each).
#include "engine.cuh"
#include "fp32_math.cuh"
#include "gated_cells.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_forward_variants(CellKind cell) {
  switch (cell) {
    case CellKind::kGru:
      return {kernel_variant<Fp32Math<3, 4, 512>, GruForward<float>>()};
    case CellKind::kLstm:
      return {kernel_variant<Fp32Math<2, 8, 512>, LstmForward<float>>()};
    default:
      return {kernel_variant<Fp32Math<2, 8, 512>, VanillaForward<float>>()};
  }
}

}  // namespace prnn
