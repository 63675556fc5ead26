// The vanilla cells, h_t = act(input_proj_t + U h_{t-1} + b) with act ReLU or tanh (p.cell), forward and backward.
// The cell interface is described in cell_common.cuh.
#pragma once

#include "cell_common.cuh"

namespace prnn {

template <class Element>
__device__ __forceinline__ float activate(CellKind cell, float pre) {
  return cell == CellKind::kRelu ? fmaxf(pre, 0.f) : tanh_for<Element>(pre);
}

// d act / d pre, from the activation's output h.
__device__ __forceinline__ float activation_slope(CellKind cell, float h) {
  return cell == CellKind::kRelu ? (h > 0.f ? 1.f : 0.f) : 1.f - h * h;
}

template <class Element_>
struct VanillaForward : ForwardCell<Element_, 1> {
  using typename ForwardCell<Element_, 1>::Element;
  using ForwardCell<Element_, 1>::inputs;
  using ForwardCell<Element_, 1>::h;
  using ForwardCell<Element_, 1>::length;

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[1],
                         float (&published)[1]) {
    if (forward_time(p, step) < length) h = activate<Element>(p.cell, inputs.pre_activation(0, recurrent[0]));
    published[0] = h;
  }
};

// Publishes dpre_t = dL/d(pre-activation at t) each step; the engine's product with U^T is then the gradient that
// reaches h_{t-1}.
template <class Element_>
struct VanillaBackward {
  static_assert(backward_publishes_grad_input(CellKind::kRelu) && backward_publishes_grad_input(CellKind::kTanh),
                "the vanilla grad_input_proj is gathered");
  using Element = Element_;
  static constexpr int kRowGates = 1;
  static constexpr int kVectorGates = 1;
  OutsideGradient<Element> grad;
  float h;     // forward output at this step
  int length;

  __device__ void init(const RnnParams<Element>& p, int unit, int sample) {
    length = sample_length(p, sample);
    init_grad_hx(p, unit, sample, length);
  }

  __device__ void load(const RnnParams<Element>& p, int step, int unit, int sample) {
    if (!backward_valid(p, step, length)) return;
    const int t = backward_time(p, step);
    grad.load(p, t, sample, unit, length);
    h = forward_state_at(p, forward_step_of(p, t) + 1, sample, unit);
  }

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[1],
                         float (&published)[1]) {
    float grad_pre = 0.f;
    if (backward_valid(p, step, length)) {
      grad_pre = (grad.value() + recurrent[0]) * activation_slope(p.cell, h);
    } else {
      finish_grad_hx(p, step, unit, sample, length, recurrent[0]);
    }
    published[0] = grad_pre;
  }

  __device__ void end(const RnnParams<Element>&, int, int) {}
};

}  // namespace prnn
