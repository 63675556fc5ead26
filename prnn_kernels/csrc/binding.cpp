// The only file that touches ATen: checks the tensors, allocates outputs, workspace and flags through PyTorch on the
// current stream, and launches the torch-free kernels (persistent_rnn.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <limits>

#include "persistent_rnn.h"

namespace {

using prnn::Activation;
using prnn::Pass;
using prnn::Precision;

Activation activation_of(const std::string& cell) {
  TORCH_CHECK(cell == "relu" || cell == "tanh", "persistent RNN kernel: cell must be 'relu' or 'tanh', got '", cell,
              "'");
  return cell == "relu" ? Activation::kRelu : Activation::kTanh;
}

Precision precision_of(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "persistent RNN kernel: dtype must be float32 or bfloat16, got ", dtype);
  return dtype == at::kFloat ? Precision::kFloat32 : Precision::kBFloat16;
}

int state_stride(int64_t hidden) { return static_cast<int>((hidden + 3) / 4 * 4); }

void check_tensor(const at::Tensor& tensor, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                  const at::Device& device) {
  TORCH_CHECK(tensor.device() == device, "persistent RNN kernel: ", name, " is on ", tensor.device(), ", expected ",
              device);
  TORCH_CHECK(tensor.scalar_type() == dtype, "persistent RNN kernel: ", name, " has dtype ", tensor.scalar_type(),
              ", expected ", dtype);
  TORCH_CHECK(tensor.sizes() == shape, "persistent RNN kernel: ", name, " has shape ", tensor.sizes(), ", expected ",
              shape);
  TORCH_CHECK(tensor.is_contiguous(), "persistent RNN kernel: ", name, " must be contiguous");
}

prnn::LaunchPlan plan_or_throw(Precision precision, Pass pass, int64_t hidden, int64_t batch) {
  TORCH_CHECK(hidden <= std::numeric_limits<int>::max() / 16, "persistent RNN kernel: hidden size ", hidden,
              " is too large");
  prnn::LaunchPlan plan = prnn::plan_launch(precision, pass, static_cast<int>(hidden), static_cast<int>(batch));
  TORCH_CHECK(plan.ok, "persistent RNN kernel cannot run this shape: ", plan.reason);
  return plan;
}

template <class Element>
const Element* pointer(const at::Tensor& tensor) {
  return tensor.defined() ? reinterpret_cast<const Element*>(tensor.data_ptr()) : nullptr;
}

template <class Element>
void run(const prnn::LaunchPlan& plan, prnn::RnnParams<Element>& params, const at::Tensor& status) {
  // Zeroed on the stream before each launch: no flag survives from an earlier call.
  at::Tensor flags = at::zeros({plan.tiling.num_ctas * prnn::kFlagStride}, status.options());
  params.tiling = plan.tiling;
  params.flags = reinterpret_cast<unsigned*>(flags.data_ptr<int>());
  params.status = status.data_ptr<int>();
  const cudaError_t error = prnn::launch(plan, params, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == cudaSuccess, "persistent RNN kernel launch failed: ", cudaGetErrorString(error));
}

template <class Element>
prnn::RnnParams<Element> common_params(Activation activation, const at::Tensor& weight, const at::Tensor& lengths,
                                       int64_t seq_len, int64_t batch, int64_t hidden, bool reverse,
                                       int64_t timeout_ns) {
  prnn::RnnParams<Element> params = {};
  params.seq_len = static_cast<int>(seq_len);
  params.batch = static_cast<int>(batch);
  params.hidden = static_cast<int>(hidden);
  params.state_stride = state_stride(hidden);
  params.reverse = reverse;
  params.activation = activation;
  params.weight = pointer<Element>(weight);
  params.lengths = lengths.data_ptr<int64_t>();
  params.timeout_ns = static_cast<unsigned long long>(timeout_ns);
  return params;
}

// Builds the parameters shared by both passes in the element type of `precision` and hands them to `fill`,
// which adds the pass's own pointers and launches.
template <class Fill>
void with_common_params(Precision precision, Activation activation, const at::Tensor& weight,
                        const at::Tensor& lengths, int64_t seq_len, int64_t batch, int64_t hidden, bool reverse,
                        int64_t timeout_ns, Fill&& fill) {
  if (precision == Precision::kFloat32) {
    auto params = common_params<float>(activation, weight, lengths, seq_len, batch, hidden, reverse, timeout_ns);
    fill(params);
  } else {
    auto params =
        common_params<__nv_bfloat16>(activation, weight, lengths, seq_len, batch, hidden, reverse, timeout_ns);
    fill(params);
  }
}

void check_common(const at::Tensor& weight, const at::Tensor& lengths, const at::Tensor& status, int64_t hidden,
                  int64_t batch, at::ScalarType dtype, const at::Device& device, int64_t seq_len,
                  int64_t timeout_ns) {
  TORCH_CHECK(device.is_cuda(), "persistent RNN kernel needs CUDA tensors, got ", device);
  check_tensor(weight, "weight_hh", {hidden, hidden}, dtype, device);
  check_tensor(lengths, "lengths", {batch}, at::kLong, device);
  check_tensor(status, "status", {1}, at::kInt, device);
  TORCH_CHECK(seq_len < std::numeric_limits<int>::max(), "persistent RNN kernel: sequence too long");
  TORCH_CHECK(timeout_ns >= 0, "persistent RNN kernel: timeout_ns must be >= 0");
}

// Returns (output (T, B, H), h_n (B, H), state (T+1, B, HS) fp32); poison fills outputs with NaN before the launch so
// tests catch elements the kernel does not write.
std::vector<at::Tensor> forward(const std::string& cell, const at::Tensor& input_proj, const at::Tensor& hx,
                                const at::Tensor& weight_hh, const c10::optional<at::Tensor>& bias_hh,
                                const at::Tensor& lengths, bool reverse, const at::Tensor& status, int64_t timeout_ns,
                                bool poison) {
  const Activation activation = activation_of(cell);
  TORCH_CHECK(input_proj.dim() == 3, "persistent RNN kernel: input_proj must be (T, B, H), got ", input_proj.sizes());
  const int64_t seq_len = input_proj.size(0), batch = input_proj.size(1), hidden = input_proj.size(2);
  const at::ScalarType dtype = input_proj.scalar_type();
  const Precision precision = precision_of(dtype);
  const at::Device device = input_proj.device();
  check_common(weight_hh, lengths, status, hidden, batch, dtype, device, seq_len, timeout_ns);
  check_tensor(input_proj, "input_proj", {seq_len, batch, hidden}, dtype, device);
  check_tensor(hx, "hx", {batch, hidden}, dtype, device);
  if (bias_hh) check_tensor(*bias_hh, "bias_hh", {hidden}, dtype, device);
  const c10::cuda::CUDAGuard guard(device);

  at::Tensor output = at::empty_like(input_proj);
  at::Tensor state = at::empty({seq_len + 1, batch, state_stride(hidden)}, input_proj.options().dtype(at::kFloat));
  if (poison) {
    output.fill_(std::numeric_limits<float>::quiet_NaN());
    state.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  state[0].narrow(1, 0, hidden).copy_(hx);
  if (seq_len > 0) {
    const prnn::LaunchPlan plan = plan_or_throw(precision, Pass::kForward, hidden, batch);
    auto fill = [&](auto& params) {
      using Element = std::remove_cv_t<std::remove_pointer_t<decltype(params.weight)>>;
      params.num_steps = static_cast<int>(seq_len);
      params.weight_row_stride = static_cast<int>(hidden);
      params.weight_col_stride = 1;
      params.state = state.data_ptr<float>();
      params.out = reinterpret_cast<Element*>(output.data_ptr());
      params.input_proj = pointer<Element>(input_proj);
      params.bias = bias_hh ? pointer<Element>(*bias_hh) : nullptr;
      run(plan, params, status);
    };
    with_common_params(precision, activation, weight_hh, lengths, seq_len, batch, hidden, reverse, timeout_ns, fill);
  }
  at::Tensor h_n = state[seq_len].narrow(1, 0, hidden).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  return {output, h_n, state};
}

// Returns (grad_input_proj (T, B, H), grad_hx (B, H) fp32, grad_state (T+2, B, HS) fp32: [1 + q] is dpre of backward
// step q, i.e. of forward processing step T-1-q).
std::vector<at::Tensor> backward(const std::string& cell, const at::Tensor& grad_output, const at::Tensor& grad_h_n,
                                 const at::Tensor& forward_state, const at::Tensor& weight_hh,
                                 const at::Tensor& lengths, bool reverse, const at::Tensor& status,
                                 int64_t timeout_ns, bool poison) {
  const Activation activation = activation_of(cell);
  TORCH_CHECK(grad_output.dim() == 3, "persistent RNN kernel: grad_output must be (T, B, H), got ",
              grad_output.sizes());
  const int64_t seq_len = grad_output.size(0), batch = grad_output.size(1), hidden = grad_output.size(2);
  const at::ScalarType dtype = grad_output.scalar_type();
  const Precision precision = precision_of(dtype);
  const at::Device device = grad_output.device();
  check_common(weight_hh, lengths, status, hidden, batch, dtype, device, seq_len, timeout_ns);
  check_tensor(grad_h_n, "grad_h_n", {batch, hidden}, dtype, device);
  check_tensor(forward_state, "forward_state", {seq_len + 1, batch, state_stride(hidden)}, at::kFloat, device);
  const c10::cuda::CUDAGuard guard(device);

  at::Tensor grad_input = at::empty_like(grad_output);
  at::Tensor grad_hx = at::empty({batch, hidden}, grad_output.options().dtype(at::kFloat));
  at::Tensor grad_state = at::empty({seq_len + 2, batch, state_stride(hidden)}, grad_hx.options());
  if (poison) {
    grad_input.fill_(std::numeric_limits<float>::quiet_NaN());
    grad_hx.fill_(std::numeric_limits<float>::quiet_NaN());
    grad_state.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  grad_state[0].zero_();
  if (seq_len == 0) {
    grad_hx.copy_(grad_h_n);
    return {grad_input, grad_hx, grad_state};
  }
  const prnn::LaunchPlan plan = plan_or_throw(precision, Pass::kBackward, hidden, batch);
  auto fill = [&](auto& params) {
    using Element = std::remove_cv_t<std::remove_pointer_t<decltype(params.weight)>>;
    params.num_steps = static_cast<int>(seq_len) + 1;
    params.weight_row_stride = 1;  // U^T
    params.weight_col_stride = static_cast<int>(hidden);
    params.state = grad_state.data_ptr<float>();
    params.out = reinterpret_cast<Element*>(grad_input.data_ptr());
    params.grad_output = pointer<Element>(grad_output);
    params.grad_h_n = pointer<Element>(grad_h_n);
    params.forward_state = forward_state.data_ptr<float>();
    params.grad_hx = grad_hx.data_ptr<float>();
    run(plan, params, status);
  };
  with_common_params(precision, activation, weight_hh, lengths, seq_len, batch, hidden, reverse, timeout_ns, fill);
  return {grad_input, grad_hx, grad_state};
}

// (ok, reason): whether both passes can run this shape on the current device.
std::tuple<bool, std::string> support(int64_t hidden, int64_t batch, bool bf16) {
  const Precision precision = bf16 ? Precision::kBFloat16 : Precision::kFloat32;
  if (hidden < 1 || hidden > std::numeric_limits<int>::max() / 16) {
    return {false, "hidden size " + std::to_string(hidden) + " is out of range"};
  }
  const prnn::LaunchPlan forward_plan =
      prnn::plan_launch(precision, Pass::kForward, static_cast<int>(hidden), static_cast<int>(batch));
  if (!forward_plan.ok) return {false, forward_plan.reason};
  const prnn::LaunchPlan backward_plan =
      prnn::plan_launch(precision, Pass::kBackward, static_cast<int>(hidden), static_cast<int>(batch));
  if (!backward_plan.ok) return {false, "backward: " + backward_plan.reason};
  return {true, ""};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Persistent RNN CUDA kernels (see prnn_kernels/persistent.py)";
  m.def("forward", &forward, "forward recurrence of one layer and direction");
  m.def("backward", &backward, "backward data gradient of one layer and direction");
  m.def("support", &support, "whether the persistent kernel can run (hidden, batch, bf16) on the current device");
}
