// The GRU and LSTM cells, with torch.nn.GRU / torch.nn.LSTM's gate order and equations, forward and backward.
// The cell interface is described in cell_common.cuh. Every gate of a unit is finished by the thread that owns the
// unit, from the kRowGates recurrent products the engine hands it, so the cell update needs no trip through memory.
// The forward pass saves the gate activations the backward pass needs (saved_values_of in persistent_rnn.h).
#pragma once

#include "cell_common.cuh"

namespace prnn {

// torch.nn.GRU, gates (r, z, n):
//   r = sigmoid(x_r + U_r h + b_r), z = sigmoid(x_z + U_z h + b_z), n = tanh(x_n + r * (U_n h + b_n)),
//   h' = (1 - z) * n + z * h.
template <class Element_>
struct GruForward : ForwardCell<Element_, 3> {
  using typename ForwardCell<Element_, 3>::Element;
  using ForwardCell<Element_, 3>::inputs;
  using ForwardCell<Element_, 3>::h;
  using ForwardCell<Element_, 3>::length;
  static constexpr int kSaved = saved_values_of(CellKind::kGru);  // r, z, n, U_n h + b_n

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[3],
                         float (&published)[1]) {
    const int t = forward_time(p, step);
    float saved[kSaved] = {};  // zeros past the sample's length, so every output of a call is defined
    if (t < length) {
      saved[0] = sigmoid_for<Element>(inputs.pre_activation(0, recurrent[0]));  // r
      saved[1] = sigmoid_for<Element>(inputs.pre_activation(1, recurrent[1]));  // z
      saved[3] = recurrent[2] + inputs.bias[2];                  // U_n h + b_n
      saved[2] = tanh_for<Element>(inputs.input_at(2) + saved[0] * saved[3]);  // n
      h = (1.f - saved[1]) * saved[2] + saved[1] * h;
    }
    store_saved(p, saved, t, sample, unit);
    published[0] = h;
  }
};

// Publishes g = the gradient of (U_r h + b_r, U_z h + b_z, U_n h + b_n); U^T g plus the part of dL/dh' that flows
// through z * h (carried in a register) is the gradient reaching h. grad_input_proj is (dpre_r, dpre_z, dpre_n).
template <class Element_>
struct GruBackward {
  static_assert(!backward_publishes_grad_input(CellKind::kGru), "the GRU's backward stores grad_input_proj itself");
  using Element = Element_;
  static constexpr int kRowGates = 1;
  static constexpr int kVectorGates = 3;
  static constexpr int kSaved = saved_values_of(CellKind::kGru);
  OutsideGradient<Element> grad;  // dL/dh' from outside the recurrence
  float h_prev;  // h entering this step
  float saved[kSaved];  // r, z, n, U_n h + b_n of this step
  float direct;  // dL/dh' * z of the step after this one (later in time)
  int length;

  __device__ void init(const RnnParams<Element>& p, int unit, int sample) {
    length = sample_length(p, sample);
    direct = 0.f;
    init_grad_hx(p, unit, sample, length);
  }

  __device__ void load(const RnnParams<Element>& p, int step, int unit, int sample) {
    if (!backward_valid(p, step, length)) return;
    const int t = backward_time(p, step);
    grad.load(p, t, sample, unit, length);
    h_prev = forward_state_at(p, forward_step_of(p, t), sample, unit);
    load_saved(p, saved, t, sample, unit);
  }

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[1],
                         float (&published)[3]) {
    float grad_pre[3] = {0.f, 0.f, 0.f};  // (r, z, n) pre-activations
    published[0] = published[1] = published[2] = 0.f;
    if (backward_valid(p, step, length)) {
      const float reset = saved[0], update = saved[1], candidate = saved[2], hidden_n = saved[3];
      const float grad_h = grad.value() + recurrent[0] + direct;
      grad_pre[2] = grad_h * (1.f - update) * (1.f - candidate * candidate);
      grad_pre[1] = grad_h * (h_prev - candidate) * update * (1.f - update);
      grad_pre[0] = grad_pre[2] * hidden_n * reset * (1.f - reset);
      direct = grad_h * update;
      published[0] = grad_pre[0];
      published[1] = grad_pre[1];
      published[2] = grad_pre[2] * reset;
    } else {
      finish_grad_hx(p, step, unit, sample, length, recurrent[0] + direct);
    }
    if (step < p.seq_len) {
      const int t = backward_time(p, step);
#pragma unroll
      for (int gate = 0; gate < 3; ++gate) {
        p.out[gate_offset(p, t, sample, gate, unit)] = from_float<Element>(grad_pre[gate]);
      }
    }
  }

  __device__ void end(const RnnParams<Element>&, int, int) {}
};

// torch.nn.LSTM, gates (i, f, g, o): c' = sigmoid(f) * c + sigmoid(i) * tanh(g), h' = sigmoid(o) * tanh(c'), each
// gate's pre-activation x + U h + b.
template <class Element_>
struct LstmForward : ForwardCell<Element_, 4> {
  using typename ForwardCell<Element_, 4>::Element;
  using ForwardCell<Element_, 4>::inputs;
  using ForwardCell<Element_, 4>::h;
  using ForwardCell<Element_, 4>::length;
  static constexpr int kSaved = saved_values_of(CellKind::kLstm);  // i, f, g, o, c, tanh(c')
  float c;  // after this sample's last valid step so far (cx before the first)

  __device__ void init(const RnnParams<Element>& p, int unit, int sample) {
    ForwardCell<Element_, 4>::init(p, unit, sample);
    c = p.cell_state[sample * p.hidden + unit];
  }

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[4],
                         float (&published)[1]) {
    const int t = forward_time(p, step);
    float saved[kSaved] = {};  // zeros past the sample's length, so every output of a call is defined
    if (t < length) {
      saved[0] = sigmoid_for<Element>(inputs.pre_activation(0, recurrent[0]));  // i
      saved[1] = sigmoid_for<Element>(inputs.pre_activation(1, recurrent[1]));  // f
      saved[2] = tanh_for<Element>(inputs.pre_activation(2, recurrent[2]));     // g
      saved[3] = sigmoid_for<Element>(inputs.pre_activation(3, recurrent[3]));  // o
      saved[4] = c;
      c = saved[1] * c + saved[0] * saved[2];
      saved[5] = tanh_for<Element>(c);
      h = saved[3] * saved[5];
    }
    store_saved(p, saved, t, sample, unit);
    published[0] = h;
  }

  __device__ void end(const RnnParams<Element>& p, int unit, int sample) { p.cell_state[sample * p.hidden + unit] = c; }
};

// Publishes the gradient of the four gate pre-activations, which is also grad_input_proj; the gradient reaching c
// is carried in a register from step to step.
template <class Element_>
struct LstmBackward {
  static_assert(backward_publishes_grad_input(CellKind::kLstm), "the LSTM's grad_input_proj is gathered");
  using Element = Element_;
  static constexpr int kRowGates = 1;
  static constexpr int kVectorGates = 4;
  static constexpr int kSaved = saved_values_of(CellKind::kLstm);
  OutsideGradient<Element> grad;  // dL/dh' from outside the recurrence
  float saved[kSaved];  // i, f, g, o, c, tanh(c') of this step
  float grad_c;  // dL/dc' reaching this step from the step after it (grad_c_n before the sample's first)
  int length;

  __device__ void init(const RnnParams<Element>& p, int unit, int sample) {
    length = sample_length(p, sample);
    grad_c = p.cell_state[sample * p.hidden + unit];
    init_grad_hx(p, unit, sample, length);
  }

  __device__ void load(const RnnParams<Element>& p, int step, int unit, int sample) {
    if (!backward_valid(p, step, length)) return;
    const int t = backward_time(p, step);
    grad.load(p, t, sample, unit, length);
    load_saved(p, saved, t, sample, unit);
  }

  __device__ void finish(const RnnParams<Element>& p, int step, int unit, int sample, const float (&recurrent)[1],
                         float (&published)[4]) {
    published[0] = published[1] = published[2] = published[3] = 0.f;
    if (backward_valid(p, step, length)) {
      const float in = saved[0], forget = saved[1], cell = saved[2], out = saved[3], c_prev = saved[4];
      const float tanh_c = saved[5];
      const float grad_h = grad.value() + recurrent[0];
      grad_c += grad_h * out * (1.f - tanh_c * tanh_c);
      published[0] = grad_c * cell * in * (1.f - in);
      published[1] = grad_c * c_prev * forget * (1.f - forget);
      published[2] = grad_c * in * (1.f - cell * cell);
      published[3] = grad_h * tanh_c * out * (1.f - out);
      grad_c *= forget;
    } else {
      finish_grad_hx(p, step, unit, sample, length, recurrent[0]);
    }
  }

  __device__ void end(const RnnParams<Element>& p, int unit, int sample) {
    p.cell_state[sample * p.hidden + unit] = grad_c;  // grad_cx
  }
};

}  // namespace prnn
