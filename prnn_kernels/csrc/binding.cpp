// The persistent layers' side of ATen: checks the tensors, allocates outputs, workspace and step counts through
// PyTorch on the current stream, and launches the torch-free kernels (persistent_rnn.h). The module's other functions,
// the fp32 products, are products.cpp's.
//
// A call runs D = 1 or 2 directions of one layer. Direction 0 runs reversed when `reverse` is set; with two
// directions, direction 1 runs the other way. Sequence tensors are laid out as torch.nn lays out a bidirectional
// layer: input_proj (T, B, D*G*H) holds each direction's G*H gate inputs side by side (one GEMM of the stacked
// weight_ih makes it), output (T, B, D*H) each direction's h. Both directions run in one launch when their CTAs fit
// on the device together, one after the other otherwise.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <limits>

#include "persistent_rnn.h"
#include "products.h"

namespace {

using prnn::CellKind;
using prnn::Pass;
using prnn::Precision;

CellKind cell_of(c10::string_view cell) {
  if (cell == "relu") return CellKind::kRelu;
  if (cell == "tanh") return CellKind::kTanh;
  if (cell == "gru") return CellKind::kGru;
  TORCH_CHECK(cell == "lstm", "persistent RNN kernel: cell must be 'relu', 'tanh', 'gru' or 'lstm', got '", cell, "'");
  return CellKind::kLstm;
}

Precision precision_of(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "persistent RNN kernel: dtype must be float32 or bfloat16, got ", dtype);
  return dtype == at::kFloat ? Precision::kFloat32 : Precision::kBFloat16;
}

int64_t round_up_4(int64_t value) { return (value + 3) / 4 * 4; }
int64_t round_up_8(int64_t value) { return (value + 7) / 8 * 8; }

// Rows of published vectors (..., row length) hold `length` entries; the kernels stage whole rows with bulk copies,
// so the entries past `length` are zeroed once here and never written.
void zero_row_padding(at::Tensor& rows, int64_t length) {
  const int64_t padding = rows.size(-1) - length;
  if (padding > 0) rows.narrow(-1, length, padding).zero_();
}

// The bf16 copy of a pass's published vectors that the bf16 engine stages from (RnnParams::state_bf16): rows like
// `state`'s, the first (the vector before the first step) copied from it; an empty tensor for fp32 layers.
at::Tensor state_bf16_like(const at::Tensor& state, int64_t length, Precision precision, bool poison) {
  if (precision != Precision::kBFloat16) return at::empty({0}, state.options());
  at::Tensor copy = at::empty({state.size(0), state.size(1), state.size(2), round_up_8(length)},
                              state.options().dtype(at::kBFloat16));
  if (poison) copy.fill_(std::numeric_limits<float>::quiet_NaN());
  zero_row_padding(copy, length);
  copy.select(1, 0).narrow(2, 0, length).copy_(state.select(1, 0).narrow(2, 0, length));
  return copy;
}

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

template <class Element>
const Element* pointer(const at::Tensor& tensor) {
  return tensor.defined() && tensor.numel() > 0 ? reinterpret_cast<const Element*>(tensor.data_ptr()) : nullptr;
}

template <class Element>
Element* mutable_pointer(const at::Tensor& tensor) {
  return tensor.defined() && tensor.numel() > 0 ? reinterpret_cast<Element*>(tensor.data_ptr()) : nullptr;
}

// What both passes share: the layer's shape and the tensors common to every direction.
struct Layer {
  CellKind cell;
  Precision precision;
  at::ScalarType dtype;
  at::Device device;
  int64_t seq_len, batch, hidden, gates, directions;
  bool reverse;
  const at::Tensor& lengths;
  const at::Tensor& status;
  int64_t timeout_ns;

  int64_t saved_values() const { return prnn::saved_values_of(cell); }
};

// `sequence` holds values_per_unit values per (t, b, direction, hidden unit): G in input_proj, 1 in grad_output.
Layer describe(c10::string_view cell_name, const at::Tensor& sequence, int64_t values_per_unit,
               at::TensorList weight_hh, const at::Tensor& lengths, bool reverse, const at::Tensor& status,
               int64_t timeout_ns) {
  const CellKind cell = cell_of(cell_name);
  TORCH_CHECK(sequence.dim() == 3, "persistent RNN kernel: sequence tensors must be (T, B, D * values), got ",
              sequence.sizes());
  const int64_t directions = static_cast<int64_t>(weight_hh.size());
  TORCH_CHECK(directions == 1 || directions == 2, "persistent RNN kernel: one or two directions, got ", directions);
  const int64_t gates = prnn::gates_of(cell);
  const int64_t hidden = sequence.size(2) / (directions * values_per_unit);
  const at::Device device = sequence.device();
  TORCH_CHECK(device.is_cuda(), "persistent RNN kernel needs CUDA tensors, got ", device);
  TORCH_CHECK(hidden >= 1 && hidden <= std::numeric_limits<int>::max() / 64,
              "persistent RNN kernel: hidden size out of range (", hidden, ")");
  const int64_t rows = sequence.size(0) * sequence.size(1) * directions;
  TORCH_CHECK(rows <= prnn::kMaxSequenceRows, "persistent RNN kernel: T=", sequence.size(0), " steps x B=",
              sequence.size(1), " samples x ", directions, " direction(s) = ", rows, " rows, above the kernels' ",
              prnn::kMaxSequenceRows);
  TORCH_CHECK(timeout_ns >= 0, "persistent RNN kernel: timeout_ns must be >= 0");
  const at::ScalarType dtype = sequence.scalar_type();
  Layer layer{cell, precision_of(dtype), dtype, device, sequence.size(0), sequence.size(1), hidden,
              gates, directions, reverse, lengths, status, timeout_ns};
  check_tensor(lengths, "lengths", {layer.batch}, at::kLong, device);
  check_tensor(status, "status", {1}, at::kInt, device);
  for (const at::Tensor& weight : weight_hh) check_tensor(weight, "weight_hh", {gates * hidden, hidden}, dtype, device);
  return layer;
}

// How one pass of a layer of `directions` directions launches: all directions in one launch where their CTAs fit
// together, else one launch per direction with the one-direction plan (which may itself be refused).
struct PassPlan {
  prnn::LaunchPlan plan;
  bool together;
};

PassPlan plan_pass(Precision precision, Pass pass, CellKind cell, int64_t hidden, int64_t batch, int directions) {
  const auto plan_for = [&](int count) {
    return prnn::plan_launch(precision, pass, cell, static_cast<int>(hidden), static_cast<int>(batch), count);
  };
  const prnn::LaunchPlan joint = plan_for(directions);
  return joint.ok ? PassPlan{joint, true} : PassPlan{plan_for(1), false};
}

// The parameters every direction shares, in the element type of the layer's precision, handed to `fill(params, d)`
// for each direction d to add its own pointers; then one launch for all directions when they fit together, one per
// direction otherwise.
template <class Element, class Fill>
void launch_directions(const Layer& layer, Pass pass, int num_steps, Fill&& fill) {
  prnn::LayerParams<Element> params = {};
  for (int d = 0; d < layer.directions; ++d) {
    prnn::RnnParams<Element>& p = params.direction[d];
    p.seq_len = static_cast<int>(layer.seq_len);
    p.batch = static_cast<int>(layer.batch);
    p.hidden = static_cast<int>(layer.hidden);
    p.gates = static_cast<int>(layer.gates);
    p.vector_length = static_cast<int>(pass == Pass::kForward ? layer.hidden : layer.gates * layer.hidden);
    p.state_stride = static_cast<int>(round_up_4(p.vector_length));
    p.state_bf16_stride = static_cast<int>(round_up_8(p.vector_length));  // used by bf16 launches only
    p.directions = static_cast<int>(layer.directions);
    p.num_steps = num_steps;
    p.reverse = layer.reverse != (d == 1);
    p.cell = layer.cell;
    p.weight_row_stride = pass == Pass::kForward ? p.hidden : 1;  // U, or U^T
    p.weight_col_stride = pass == Pass::kForward ? 1 : p.hidden;
    p.lengths = layer.lengths.data_ptr<int64_t>();
    p.status = layer.status.data_ptr<int>();
    p.timeout_ns = static_cast<unsigned long long>(layer.timeout_ns);
    fill(p, d);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int directions = static_cast<int>(layer.directions);
  const PassPlan pass_plan = plan_pass(layer.precision, pass, layer.cell, layer.hidden, layer.batch, directions);
  const prnn::LaunchPlan& plan = pass_plan.plan;
  const bool together = pass_plan.together;
  TORCH_CHECK(plan.ok, "persistent RNN kernel cannot run this shape: ", plan.reason);
  // Zeroed on the stream before each launch: no count survives from an earlier call.
  const int64_t counts_per_direction = static_cast<int64_t>(prnn::kChains) * prnn::kCountStride;
  at::Tensor step_counts = at::zeros({directions * counts_per_direction}, layer.status.options());
  // The weights the chip cannot hold, which the kernel lays out here and reads again every step; most plans need none.
  const int64_t l2_floats_per_direction = static_cast<int64_t>(plan.tiling.num_ctas) * plan.tiling.weight_l2_bytes / 4;
  at::Tensor l2_weights;
  if (l2_floats_per_direction > 0) {
    l2_weights = at::empty({directions * l2_floats_per_direction}, layer.status.options().dtype(at::kFloat));
  }
  for (int d = 0; d < directions; ++d) {
    params.direction[d].tiling = plan.tiling;
    params.direction[d].step_counts =
        reinterpret_cast<unsigned*>(step_counts.data_ptr<int>()) + d * counts_per_direction;
    params.direction[d].l2_weights =
        l2_floats_per_direction > 0 ? l2_weights.data_ptr<float>() + d * l2_floats_per_direction : nullptr;
  }
  const int launches = together ? 1 : directions;
  for (int d = 0; d < launches; ++d) {
    prnn::LayerParams<Element> one = params;
    if (!together) one.direction[0] = params.direction[d];
    const cudaError_t error = prnn::launch(plan, one, together ? directions : 1, stream);
    TORCH_CHECK(error == cudaSuccess, "persistent RNN kernel launch failed: ", cudaGetErrorString(error));
  }
}

// Fills `out` (T, B, D * width) from a pass's published vectors (D, V, B, stride), vector 1 + s of direction 0 holding
// time s, or T-1-s where `reversed` (launch_sequence_gather).
void gather_sequence(const Layer& layer, const at::Tensor& vectors, at::Tensor& out, int64_t width, bool reversed) {
  const int seq_len = static_cast<int>(layer.seq_len), batch = static_cast<int>(layer.batch);
  const int directions = static_cast<int>(layer.directions);
  const int stride = static_cast<int>(vectors.size(3)), per_direction = static_cast<int>(vectors.size(1));
  const int64_t* lengths = layer.lengths.data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t error =
      layer.precision == Precision::kFloat32
          ? prnn::launch_sequence_gather(vectors.data_ptr<float>(), out.data_ptr<float>(), lengths, seq_len, batch,
                                         static_cast<int>(width), stride, per_direction, directions, reversed, stream)
          : prnn::launch_sequence_gather(vectors.data_ptr<float>(), mutable_pointer<__nv_bfloat16>(out), lengths,
                                         seq_len, batch, static_cast<int>(width), stride, per_direction, directions,
                                         reversed, stream);
  TORCH_CHECK(error == cudaSuccess, "persistent RNN sequence gather launch failed: ", cudaGetErrorString(error));
}

template <class Fill>
void dispatch(const Layer& layer, Pass pass, int num_steps, Fill&& fill) {
  if (layer.precision == Precision::kFloat32) {
    launch_directions<float>(layer, pass, num_steps, fill);
  } else {
    launch_directions<__nv_bfloat16>(layer, pass, num_steps, fill);
  }
}

at::Tensor optional_or_empty(const c10::optional<at::Tensor>& tensor, const at::TensorOptions& options) {
  return tensor ? *tensor : at::empty({0}, options);
}

// Returns (output (T, B, D*H), h_n (D, B, H), c_n (D, B, H) for LSTM else empty, state (D, T+1, B, HS) fp32,
// saved (D, T, B, V, H) fp32 or empty). cx is required for LSTM and ignored otherwise. poison fills outputs and
// workspaces with NaN before the launch so tests catch elements the kernel does not write.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    c10::string_view cell, const at::Tensor& input_proj, const at::Tensor& hx, const c10::optional<at::Tensor>& cx,
    at::TensorList weight_hh, at::TensorList bias_hh, const at::Tensor& lengths, bool reverse, at::Tensor& status,
    int64_t timeout_ns, bool poison) {
  const int64_t gates = prnn::gates_of(cell_of(cell));
  const Layer layer = describe(cell, input_proj, gates, weight_hh, lengths, reverse, status, timeout_ns);
  const int64_t T = layer.seq_len, B = layer.batch, H = layer.hidden, D = layer.directions;
  check_tensor(input_proj, "input_proj", {T, B, D * gates * H}, layer.dtype, layer.device);
  check_tensor(hx, "hx", {D, B, H}, layer.dtype, layer.device);
  TORCH_CHECK(bias_hh.empty() || static_cast<int64_t>(bias_hh.size()) == D,
              "persistent RNN kernel: bias_hh must be empty or one per direction");
  for (const at::Tensor& bias : bias_hh) check_tensor(bias, "bias_hh", {gates * H}, layer.dtype, layer.device);
  const bool lstm = layer.cell == CellKind::kLstm;
  TORCH_CHECK(!lstm || cx, "persistent RNN kernel: an LSTM needs cx");
  if (lstm) check_tensor(*cx, "cx", {D, B, H}, layer.dtype, layer.device);
  const c10::cuda::CUDAGuard guard(layer.device);
  const at::TensorOptions fp32 = input_proj.options().dtype(at::kFloat);

  at::Tensor output = at::empty({T, B, D * H}, input_proj.options());
  at::Tensor state = at::empty({D, T + 1, B, round_up_4(H)}, fp32);
  at::Tensor saved = layer.saved_values() > 0 ? at::empty({D, T, B, layer.saved_values(), H}, fp32)
                                               : at::empty({0}, fp32);
  at::Tensor cell_state = lstm ? cx->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true) : at::empty({0}, fp32);
  if (poison) {
    for (at::Tensor* tensor : {&output, &state, &saved}) tensor->fill_(std::numeric_limits<float>::quiet_NaN());
  }
  zero_row_padding(state, H);
  state.select(1, 0).narrow(2, 0, H).copy_(hx);
  const at::Tensor state_bf16 = state_bf16_like(state, H, layer.precision, poison);
  if (T > 0) {
    auto fill = [&](auto& p, int d) {
      using Element = std::remove_cv_t<std::remove_pointer_t<decltype(p.weight)>>;
      p.weight = pointer<Element>(weight_hh[d]);
      p.bias = bias_hh.empty() ? nullptr : pointer<Element>(bias_hh[d]);
      p.state = state[d].data_ptr<float>();
      p.state_bf16 = state_bf16.numel() > 0 ? mutable_pointer<__nv_bfloat16>(state_bf16[d]) : nullptr;
      p.saved = lstm || layer.cell == CellKind::kGru ? saved[d].data_ptr<float>() : nullptr;
      p.cell_state = lstm ? cell_state[d].data_ptr<float>() : nullptr;
      p.out = nullptr;
      p.input_proj = pointer<Element>(input_proj) + d * gates * H;
    };
    dispatch(layer, Pass::kForward, static_cast<int>(T), fill);
    gather_sequence(layer, state, output, H, reverse);  // the output is the published h
  }
  at::Tensor h_n = state.select(1, T).narrow(2, 0, H).to(layer.dtype, /*non_blocking=*/false, /*copy=*/true);
  at::Tensor c_n = lstm ? cell_state.to(layer.dtype) : at::empty({0}, input_proj.options());
  return {output, h_n, c_n, state, saved};
}

// Returns (grad_input_proj (T, B, D*G*H), grad_hx (D, B, H) fp32, grad_cx (D, B, H) fp32 for LSTM else empty,
// grad_state (D, T+2, B, GS) fp32: [d][1 + q] is g of direction d's backward step q, i.e. of its forward processing
// step T-1-q; GS = G*H rounded up to 4).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    c10::string_view cell, const at::Tensor& grad_output, const at::Tensor& grad_h_n,
    const c10::optional<at::Tensor>& grad_c_n, const at::Tensor& forward_state, const at::Tensor& saved,
    at::TensorList weight_hh, const at::Tensor& lengths, bool reverse, at::Tensor& status, int64_t timeout_ns,
    bool poison) {
  const Layer layer = describe(cell, grad_output, 1, weight_hh, lengths, reverse, status, timeout_ns);
  const int64_t T = layer.seq_len, B = layer.batch, H = layer.hidden, D = layer.directions, G = layer.gates;
  check_tensor(grad_output, "grad_output", {T, B, D * H}, layer.dtype, layer.device);
  check_tensor(grad_h_n, "grad_h_n", {D, B, H}, layer.dtype, layer.device);
  check_tensor(forward_state, "forward_state", {D, T + 1, B, round_up_4(H)}, at::kFloat, layer.device);
  if (layer.saved_values() > 0) {
    check_tensor(saved, "saved", {D, T, B, layer.saved_values(), H}, at::kFloat, layer.device);
  }
  const bool lstm = layer.cell == CellKind::kLstm;
  const bool gathered = prnn::backward_publishes_grad_input(layer.cell);
  TORCH_CHECK(!lstm || grad_c_n, "persistent RNN kernel: an LSTM needs grad_c_n");
  if (lstm) check_tensor(*grad_c_n, "grad_c_n", {D, B, H}, layer.dtype, layer.device);
  const c10::cuda::CUDAGuard guard(layer.device);
  const at::TensorOptions fp32 = grad_output.options().dtype(at::kFloat);

  at::Tensor grad_input = at::empty({T, B, D * G * H}, grad_output.options());
  at::Tensor grad_hx = at::empty({D, B, H}, fp32);
  at::Tensor grad_state = at::empty({D, T + 2, B, round_up_4(G * H)}, fp32);
  at::Tensor grad_cell = lstm ? grad_c_n->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true) : at::empty({0}, fp32);
  if (poison) {
    for (at::Tensor* tensor : {&grad_input, &grad_hx, &grad_state}) {
      tensor->fill_(std::numeric_limits<float>::quiet_NaN());
    }
  }
  zero_row_padding(grad_state, G * H);
  grad_state.select(1, 0).zero_();
  const at::Tensor grad_state_bf16 = state_bf16_like(grad_state, G * H, layer.precision, poison);
  if (T == 0) {
    grad_hx.copy_(grad_h_n);
    return {grad_input, grad_hx, grad_cell, grad_state};
  }
  auto fill = [&](auto& p, int d) {
    using Element = std::remove_cv_t<std::remove_pointer_t<decltype(p.weight)>>;
    p.weight = pointer<Element>(weight_hh[d]);
    p.state = grad_state[d].data_ptr<float>();
    p.state_bf16 = grad_state_bf16.numel() > 0 ? mutable_pointer<__nv_bfloat16>(grad_state_bf16[d]) : nullptr;
    p.saved = layer.saved_values() > 0 ? saved[d].data_ptr<float>() : nullptr;
    p.cell_state = lstm ? grad_cell[d].data_ptr<float>() : nullptr;
    p.out = gathered ? nullptr : mutable_pointer<Element>(grad_input) + d * G * H;
    p.grad_output = pointer<Element>(grad_output) + d * H;
    p.grad_h_n = pointer<Element>(grad_h_n) + d * B * H;
    p.forward_state = forward_state[d].data_ptr<float>();
    p.forward_state_stride = static_cast<int>(round_up_4(H));
    p.grad_hx = grad_hx[d].data_ptr<float>();
  };
  dispatch(layer, Pass::kBackward, static_cast<int>(T) + 1, fill);
  // Backward step q runs time T-1-q (q where reversed).
  if (gathered) gather_sequence(layer, grad_state, grad_input, G * H, !reverse);
  return {grad_input, grad_hx, grad_cell, grad_state};
}

// (ok, reason): whether both passes of one direction can run this shape on the current device.
std::tuple<bool, std::string> support(const std::string& cell, int64_t hidden, int64_t batch, bool bf16) {
  const Precision precision = bf16 ? Precision::kBFloat16 : Precision::kFloat32;
  const CellKind kind = cell_of(cell);
  if (hidden < 1 || hidden > std::numeric_limits<int>::max() / 64) {
    return {false, "hidden size " + std::to_string(hidden) + " is out of range"};
  }
  for (const Pass pass : {Pass::kForward, Pass::kBackward}) {
    const prnn::LaunchPlan plan =
        prnn::plan_launch(precision, pass, kind, static_cast<int>(hidden), static_cast<int>(batch), 1);
    if (!plan.ok) return {false, (pass == Pass::kBackward ? "backward: " : "") + plan.reason};
  }
  return {true, ""};
}

// How each pass of a layer of `directions` directions launches on the current device (plan_pass, as
// launch_directions does it). One dict per pass (forward, backward): whether it runs and why not, and the tiling.
std::vector<py::dict> launch_plans(const std::string& cell, int64_t hidden, int64_t batch, bool bf16,
                                   int64_t directions) {
  TORCH_CHECK(directions == 1 || directions == 2, "persistent RNN kernel: one or two directions, got ", directions);
  TORCH_CHECK(hidden >= 1 && hidden <= std::numeric_limits<int>::max() / 64,
              "persistent RNN kernel: hidden size out of range (", hidden, ")");
  const Precision precision = bf16 ? Precision::kBFloat16 : Precision::kFloat32;
  std::vector<py::dict> result;
  for (const Pass pass : {Pass::kForward, Pass::kBackward}) {
    const PassPlan pass_plan = plan_pass(precision, pass, cell_of(cell), hidden, batch, static_cast<int>(directions));
    const prnn::LaunchPlan& plan = pass_plan.plan;
    py::dict entry;
    entry["pass"] = pass == Pass::kForward ? "forward" : "backward";
    entry["ok"] = plan.ok;
    entry["reason"] = plan.reason;
    entry["directions_in_one_launch"] = pass_plan.together && directions == 2;
    if (plan.ok) {
      entry["ctas_per_direction"] = plan.tiling.num_ctas;
      entry["threads"] = plan.tiling.threads;
      entry["cluster_size"] = plan.tiling.cluster_size;
      entry["units_per_cta"] = plan.tiling.units_per_cta;
      entry["smem_bytes"] = plan.tiling.smem_bytes;
      entry["weight_smem_bytes"] = plan.tiling.weight_smem_bytes;
      entry["weight_l2_bytes"] = plan.tiling.weight_l2_bytes;
      entry["chains"] = plan.tiling.chains;
      entry["one_cluster"] = plan.tiling.one_cluster != 0;
    }
    result.push_back(entry);
  }
  return result;
}

}  // namespace

// The operators are declared in prnn_kernels/persistent.py (with their shapes for tracing); these are their kernels.
TORCH_LIBRARY_IMPL(prnn_kernels, CUDA, m) {
  m.impl("persistent_forward", &forward);
  m.impl("persistent_backward", &backward);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Persistent RNN CUDA kernels (see prnn_kernels/persistent.py)";
  m.def("support", &support, "whether the persistent kernel can run (cell, hidden, batch, bf16) on the current device");
  m.def("launch_plans", &launch_plans,
        "how each pass of (cell, hidden, batch, bf16, directions) launches on the current device");
  m.def("load_product", &load_product, "loads the compiled fp32 product for a device (prnn_kernels/products.py)");
  m.def("product", &product, "a (M, K) @ b (N, K)^T [+ bias] in fp32 by the loaded product (prnn_kernels/products.py)",
        py::arg("a"), py::arg("b"), py::arg("bias"), py::arg("reverse_b_blocks_of"));
}
