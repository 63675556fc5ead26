// Launches the fp32 matrix products that prnn_kernels/products.py compiles with Triton (3xTF32 on tensor cores).
// Triton's own launcher costs the host 20-45 us a call, more than the product saves on the GPU in an eager training
// step (csrc/NOTES.md, "Tried after v21"); launched from here a call costs what a cuBLAS call does.
//
// A product is out (M, N) = a (M, K) @ b (N, K)^T [+ bias (N,)]. The kernel loads its tiles by TMA with descriptors
// it makes on the device, in `scratch` (Triton's global scratch), and Hopper's tensor cores take 32-bit operands only
// K-major: an operand laid out otherwise is copied first (k_major_copy.cu), which costs less than Triton's own
// transposes on chip (csrc/NOTES.md, v22).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <torch/extension.h>

#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "products.h"

namespace {

// The driver API through the runtime's entry points, so that the extension needs no libcuda at link or import time.
template <class Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found;
  C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found));
  TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr, "prnn_kernels: CUDA driver has no ", name);
  return reinterpret_cast<Function>(function);
}

struct Driver {
  decltype(&cuModuleLoadData) module_load_data = driver_function<decltype(&cuModuleLoadData)>("cuModuleLoadData");
  decltype(&cuModuleGetFunction) module_get_function =
      driver_function<decltype(&cuModuleGetFunction)>("cuModuleGetFunction");
  decltype(&cuFuncSetAttribute) func_set_attribute =
      driver_function<decltype(&cuFuncSetAttribute)>("cuFuncSetAttribute");
  decltype(&cuLaunchKernel) launch_kernel = driver_function<decltype(&cuLaunchKernel)>("cuLaunchKernel");
  decltype(&cuCtxGetCurrent) ctx_get_current = driver_function<decltype(&cuCtxGetCurrent)>("cuCtxGetCurrent");
  decltype(&cuGetErrorString) get_error_string = driver_function<decltype(&cuGetErrorString)>("cuGetErrorString");
};

const Driver& driver() {
  static const Driver instance;
  return instance;
}

void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  driver().get_error_string(result, &message);
  TORCH_CHECK(false, "prnn_kernels: ", what, " failed: ", message ? message : "unknown CUDA driver error");
}

// Driver calls act on the calling thread's current context; a thread that has not yet made a runtime call on the
// device (an autograd worker, say) may have none.
void make_context_current(int device) {
  CUcontext context = nullptr;
  check_driver(driver().ctx_get_current(&context), "querying the current context");
  if (context == nullptr) C10_CUDA_CHECK(cudaSetDevice(device));  // makes the device's primary context current
}

struct Product {
  CUfunction function;
  int block_m, block_n, threads, shared_bytes, scratch_bytes, device_sms;
};

// (device, has bias, small tiles) -> the loaded kernel. Modules stay loaded for the life of the process, as cuBLAS's
// do.
std::map<std::tuple<int, bool, bool>, Product> products;
std::mutex products_mutex;

int64_t round_up_4(int64_t value) { return (value + 3) / 4 * 4; }

// `operand` (R, K) as the product reads it: K contiguous, the rows and the start on 16-byte boundaries (TMA's
// rule), K's blocks reversed if asked. Itself where it is so; a copy by k_major_copy.cu where it runs along R; a copy
// by ATen otherwise.
at::Tensor k_major(const at::Tensor& operand, int64_t reverse_blocks_of, const char* name) {
  TORCH_CHECK(operand.dim() == 2 && operand.scalar_type() == at::kFloat, "prnn_kernels product: ", name,
              " must be a 2-D float32 tensor, got ", operand.scalar_type(), " of shape ", operand.sizes());
  const int64_t rows = operand.size(0), columns = operand.size(1);
  TORCH_CHECK(reverse_blocks_of == 0 || (reverse_blocks_of > 0 && columns % reverse_blocks_of == 0),
              "prnn_kernels product: ", name, "'s ", columns, " columns are not blocks of ", reverse_blocks_of);
  const bool aligned = reinterpret_cast<uintptr_t>(operand.data_ptr()) % 16 == 0;
  // Rows of their own (not an expanded tensor's stride 0 or overlapping views), as the bulk copies' tensor map reads.
  const bool rows_apart = operand.stride(0) >= columns || rows == 1;
  if (operand.stride(1) == 1 && operand.stride(0) % 4 == 0 && rows_apart && aligned && reverse_blocks_of == 0) {
    return operand;
  }
  at::Tensor out = at::empty({rows, round_up_4(columns)}, operand.options()).narrow(1, 0, columns);
  if (operand.numel() == 0) return out;
  if (operand.stride(0) == 1 && (rows + 31) / 32 <= 65535) {
    C10_CUDA_CHECK(launch_k_major_copy(operand.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(rows),
                                       static_cast<int>(columns), operand.stride(1), out.stride(0),
                                       static_cast<int>(reverse_blocks_of),
                                       c10::cuda::getCurrentCUDAStream(operand.device().index()).stream()));
    return out;
  }
  if (reverse_blocks_of == 0) return out.copy_(operand);
  return out.copy_(operand.unflatten(1, {-1, reverse_blocks_of}).flip(1).flatten(1));
}

}  // namespace

void load_product(int64_t device, bool has_bias, bool small_tiles, const std::string& cubin, const std::string& name,
                  int64_t block_m, int64_t block_n, int64_t warps, int64_t shared_bytes, int64_t scratch_bytes) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  make_context_current(static_cast<int>(device));
  const std::lock_guard<std::mutex> lock(products_mutex);
  if (products.count({static_cast<int>(device), has_bias, small_tiles})) return;
  CUmodule module;
  check_driver(driver().module_load_data(&module, cubin.data()), "loading the product's cubin");
  CUfunction function;
  check_driver(driver().module_get_function(&function, module, name.c_str()), "finding the product's kernel");
  check_driver(driver().func_set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           static_cast<int>(shared_bytes)),
               "setting the product's shared memory");
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device)));
  products[{static_cast<int>(device), has_bias, small_tiles}] =
      Product{function, static_cast<int>(block_m), static_cast<int>(block_n), static_cast<int>(warps * 32),
              static_cast<int>(shared_bytes), static_cast<int>(scratch_bytes), sms};
}

at::Tensor product(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                   int64_t reverse_b_blocks_of) {
  TORCH_CHECK(a.is_cuda() && b.device() == a.device(), "prnn_kernels product: a and b must be on one CUDA device");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(1), "prnn_kernels product: a is ", a.sizes(),
              " and b is ", b.sizes(), ": two matrices with as many columns are needed");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(std::max({M, N, round_up_4(K)}) <= std::numeric_limits<int>::max(),
              "prnn_kernels product: sizes out of range");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->device() == a.device() && bias->is_contiguous() &&
                    bias->numel() == N,
                "prnn_kernels product: bias must be a contiguous float32 vector of ", N, " on ", a.device());
  }
  const c10::cuda::CUDAGuard guard(a.device());
  const int device = a.device().index();
  make_context_current(device);
  Product large, small;
  {
    const std::lock_guard<std::mutex> lock(products_mutex);
    const auto found_large = products.find({device, bias.has_value(), false});
    const auto found_small = products.find({device, bias.has_value(), true});
    TORCH_CHECK(found_large != products.end() && found_small != products.end(),
                "prnn_kernels product: not loaded on device ", device,
                " (prnn_kernels.products loads it before the first call)");
    large = found_large->second;
    small = found_small->second;
  }
  // The large tiles, unless they would leave SMs idle and the small ones fill them in one wave.
  const auto tiles_of = [&](const Product& kernel) {
    return ((M + kernel.block_m - 1) / kernel.block_m) * ((N + kernel.block_n - 1) / kernel.block_n);
  };
  const int64_t sms = large.device_sms;
  const Product& kernel = tiles_of(large) < sms && tiles_of(small) <= sms ? small : large;
  // TMA stores want the output's rows 16 bytes apart too: pad them, and hand back the (M, N) view.
  at::Tensor out = at::empty({M, round_up_4(N)}, a.options()).narrow(1, 0, N);
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias ? out.copy_(bias->expand({M, N})) : out.zero_();
  const at::Tensor a_rows = k_major(a, 0, "a");
  const at::Tensor b_rows = k_major(b, reverse_b_blocks_of, "b");
  TORCH_CHECK(std::max(a_rows.stride(0), b_rows.stride(0)) <= std::numeric_limits<int>::max(),
              "prnn_kernels product: row strides out of range");
  const unsigned tiles = static_cast<unsigned>(tiles_of(kernel));
  at::Tensor scratch = at::empty({static_cast<int64_t>(tiles) * kernel.scratch_bytes}, a.options().dtype(at::kByte));

  void* a_ptr = a_rows.data_ptr();
  void* b_ptr = b_rows.data_ptr();
  void* out_ptr = out.data_ptr();
  void* bias_ptr = bias ? bias->data_ptr() : out_ptr;
  int sizes[6] = {static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(a_rows.stride(0)),
                  static_cast<int>(b_rows.stride(0)), static_cast<int>(out.stride(0))};
  void* scratch_ptr = scratch.data_ptr();
  void* profile_scratch = nullptr;
  // The kernel's parameters as Triton lays them out (checked against its PTX in products.py): the four pointers,
  // the six ints, then Triton's global and profiling scratch pointers.
  void* args[] = {&a_ptr, &b_ptr, &out_ptr, &bias_ptr, &sizes[0], &sizes[1], &sizes[2],
                  &sizes[3], &sizes[4], &sizes[5], &scratch_ptr, &profile_scratch};
  check_driver(driver().launch_kernel(kernel.function, tiles, 1, 1, kernel.threads, 1, 1, kernel.shared_bytes,
                                      c10::cuda::getCurrentCUDAStream(device).stream(), args, nullptr),
               "launching the product");
  return out;
}
