// fp32 forward kernels: 2 rows x 8 chunks (64 weights) per thread, at most 512 threads (128 registers each).
#include "engine.cuh"
#include "fp32_math.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_forward_variants() {
  return {kernel_variant<Fp32Math<2, 8, 512>, VanillaForward<float>>()};
}

}  // namespace prnn
