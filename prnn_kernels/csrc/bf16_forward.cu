// bf16 forward kernels: 8, 16 or 40 k-tiles per warp (small, mid-size, large H); each launch bound leaves the
// variant the registers its fragments need.
#include "engine.cuh"
#include "mma_math.cuh"
#include "vanilla_cell.cuh"

namespace prnn {

std::vector<KernelVariant> bf16_forward_variants() {
  return {kernel_variant<MmaMath<8, 1024>, VanillaForward<__nv_bfloat16>>(),
          kernel_variant<MmaMath<16, 512>, VanillaForward<__nv_bfloat16>>(),
          kernel_variant<MmaMath<40, 480>, VanillaForward<__nv_bfloat16>>()};
}

}  // namespace prnn
