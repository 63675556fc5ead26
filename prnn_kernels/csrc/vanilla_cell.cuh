// The vanilla (ReLU / tanh) cell: what each step does with one (row, sample) output once the engine has reduced the
// recurrent product y = (M v)[row] for it. One object per output a thread owns; its members live in registers for
// the whole sequence. The engine calls init once (which starts loading step 0's inputs), then per step prefetch
// (this step's inputs become current and the next step's start loading, so their latency hides behind a whole step)
// and finish, which writes the step's outputs and returns the value to publish for the next step.
//
// Masking: sample b updates only at t < length. Forward processing step s runs time t = s (t = T-1-s reversed);
// backward step q runs the forward steps in the opposite order.
#pragma once

#include "element.cuh"

namespace prnn {

__device__ __forceinline__ int clamp_length(int64_t length, int seq_len) {
  return length < 0 ? 0 : (length > seq_len ? seq_len : static_cast<int>(length));
}

__device__ __forceinline__ float activate(Activation activation, float pre) {
  return activation == Activation::kRelu ? fmaxf(pre, 0.f) : tanhf(pre);
}

// d act / d pre, from the activation's output h.
__device__ __forceinline__ float activation_slope(Activation activation, float h) {
  return activation == Activation::kRelu ? (h > 0.f ? 1.f : 0.f) : 1.f - h * h;
}

template <class Element>
__device__ __forceinline__ size_t sequence_index(const RnnParams<Element>& p, int t, int sample, int row) {
  return (static_cast<size_t>(t) * p.batch + sample) * p.hidden + row;
}

template <class Element_>
struct VanillaForward {
  using Element = Element_;
  float bias;
  float carry;     // h after this sample's last valid step so far (hx before the first)
  float input;     // input_proj at this step
  float upcoming;  // input_proj at the next step
  int length;

  __device__ static int time(const RnnParams<Element>& p, int step) { return p.reverse ? p.seq_len - 1 - step : step; }

  __device__ float load_input(const RnnParams<Element>& p, int step, int row, int sample) const {
    if (step >= p.num_steps || time(p, step) >= length) return 0.f;
    return to_float(p.input_proj[sequence_index(p, time(p, step), sample, row)]);
  }

  __device__ void init(const RnnParams<Element>& p, int row, int sample) {
    bias = p.bias != nullptr ? to_float(p.bias[row]) : 0.f;
    length = clamp_length(p.lengths[sample], p.seq_len);
    carry = p.state[sample * p.state_stride + row];  // hx, written before the launch
    upcoming = load_input(p, 0, row, sample);
  }

  __device__ void prefetch(const RnnParams<Element>& p, int step, int row, int sample) {
    input = upcoming;
    upcoming = load_input(p, step + 1, row, sample);
  }

  __device__ float finish(const RnnParams<Element>& p, int step, int row, int sample, float recurrent) {
    const int t = time(p, step);
    float output = 0.f;
    if (t < length) {
      carry = activate(p.activation, input + (recurrent + bias));
      output = carry;
    }
    p.out[sequence_index(p, t, sample, row)] = from_float<Element>(output);
    return carry;
  }
};

// Publishes dpre_t = dL/d(pre-activation at t) each step; the engine's product with U^T is then the gradient that
// reaches h_{t-1}. The extra step q = T only collects grad_hx.
template <class Element_>
struct VanillaBackward {
  using Element = Element_;
  float grad;           // grad_output at this step, plus grad_h_n at the sample's first backward step
  float h;              // forward output at this step
  float upcoming_grad;  // the same for the next step
  float upcoming_h;
  int length;

  // Time of backward step q < T; forward processing step of time t.
  __device__ static int time(const RnnParams<Element>& p, int step) { return p.reverse ? step : p.seq_len - 1 - step; }
  __device__ static int forward_step(const RnnParams<Element>& p, int t) { return p.reverse ? p.seq_len - 1 - t : t; }
  __device__ bool valid(const RnnParams<Element>& p, int step) const {
    return step < p.seq_len && time(p, step) < length;
  }

  __device__ void load_inputs(const RnnParams<Element>& p, int step, int row, int sample) {
    if (!valid(p, step)) return;
    const int t = time(p, step);
    upcoming_grad = to_float(p.grad_output[sequence_index(p, t, sample, row)]);
    // The sample's first backward step is its last forward step: grad_h_n enters there. Before it this sample
    // published zeros, so the recurrent term is 0 at that step.
    if (p.reverse ? t == 0 : t == length - 1) upcoming_grad += to_float(p.grad_h_n[sample * p.hidden + row]);
    const size_t forward_row = static_cast<size_t>(forward_step(p, t) + 1) * p.batch + sample;
    upcoming_h = p.forward_state[forward_row * p.state_stride + row];
  }

  __device__ void init(const RnnParams<Element>& p, int row, int sample) {
    length = clamp_length(p.lengths[sample], p.seq_len);
    if (length == 0) p.grad_hx[sample * p.hidden + row] = to_float(p.grad_h_n[sample * p.hidden + row]);  // h_n = hx
    load_inputs(p, 0, row, sample);
  }

  __device__ void prefetch(const RnnParams<Element>& p, int step, int row, int sample) {
    grad = upcoming_grad;
    h = upcoming_h;
    load_inputs(p, step + 1, row, sample);
  }

  __device__ float finish(const RnnParams<Element>& p, int step, int row, int sample, float recurrent) {
    float grad_pre = 0.f;
    if (valid(p, step)) {
      grad_pre = (grad + recurrent) * activation_slope(p.activation, h);
    } else if (step > 0 && valid(p, step - 1)) {
      p.grad_hx[sample * p.hidden + row] = recurrent;  // U^T dpre of the sample's first forward step
    }
    if (step < p.seq_len) p.out[sequence_index(p, time(p, step), sample, row)] = from_float<Element>(grad_pre);
    return grad_pre;
  }
};

}  // namespace prnn
