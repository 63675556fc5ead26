// fp32 backward-data kernels: the forward engine on U^T with the backward cell.
#include "engine.cuh"
#include "fp32_math.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> fp32_backward_variants() {
  return {kernel_variant<Fp32Math<2, 8, 512>, VanillaBackward<float>>()};
}

}  // namespace prnn
