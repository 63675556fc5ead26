// bf16 backward-data kernels: the forward engine on U^T with the backward cell.
#include "engine.cuh"
#include "mma_math.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> bf16_backward_variants() {
  return {kernel_variant<MmaMath<8, 1024>, VanillaBackward<__nv_bfloat16>>(),
          kernel_variant<MmaMath<16, 512>, VanillaBackward<__nv_bfloat16>>(),
          kernel_variant<MmaMath<40, 480>, VanillaBackward<__nv_bfloat16>>()};
}

}  // namespace prnn
