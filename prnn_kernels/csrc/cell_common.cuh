// What every cell shares: which time a step runs, where a (time, sample, gate, unit) value lives, and the gradient
// that enters a step from outside the recurrence.
//
// A cell is one object per (hidden unit, sample) element a thread owns; its members live in registers for the whole
// sequence. The engine (engine.cuh) calls, per element:
//   init(p, unit, sample)                           once, before the first step
//   load(p, step, unit, sample)                     after the step's wait and staging copies: starts loading the
//                                                   step's inputs, whose latency then hides behind staging and
//                                                   the multiply (the cluster engine: once the step before has
//                                                   handed off, so that the wait for the next vector hides it)
//   finish(p, step, unit, sample, recurrent, published)
//                                                   recurrent: the kRowGates products of the unit's matrix rows with
//                                                   the published vector; writes the step's outputs that differ
//                                                   from what it publishes (the gated forward cells' saved values,
//                                                   the GRU's grad_input_proj) and fills the kVectorGates values
//                                                   this element publishes for the next step. The forward output (h)
//                                                   and the vanilla and LSTM grad_input_proj are those values, and
//                                                   are gathered after the launch (sequence_gather.cu).
//   end(p, unit, sample)                            once, after the last step
//
// Masking: sample b updates only at t < length. Forward processing step s runs time t = s (t = T-1-s reversed);
// backward step q runs the forward steps in the opposite order, plus one extra step q = T that only collects grad_hx.
#pragma once

#include <type_traits>

#include "element.cuh"

namespace prnn {

__device__ __forceinline__ int clamp_length(int64_t length, int seq_len) {
  return length < 0 ? 0 : (length > seq_len ? seq_len : static_cast<int>(length));
}

// A sample's valid steps, clamped to [0, T]; a length outside it is recorded in the status word for Python to raise,
// since checking GPU lengths on the host would wait for the GPU and break a graph's capture.
template <class Element>
__device__ __forceinline__ int sample_length(const RnnParams<Element>& p, int sample) {
  const int64_t length = p.lengths[sample];
  if (length < 0 || length > p.seq_len) atomicCAS(p.status, 0, kStatusLengthOutOfRange);
  return clamp_length(length, p.seq_len);
}

// The cells' activations at their layer's precision. fp32 layers take CUDA's accurate expf, division and tanhf, which
// their tests hold to 1e-5 of float64. bf16 layers, whose weights, inputs and published values are rounded to 2^-9
// anyway, take the special-function unit's approximations: ex2 and rcp for the sigmoid (about 2 ulp), tanh.approx for
// tanh (at most 2^-10.99 relative). Besides being shorter, they have no branch: the accurate division's slow-path
// branch kept a GRU's two sigmoids from overlapping, so its finish ran them one after the other.
template <class Element>
__device__ __forceinline__ float sigmoid_for(float x) {
  if constexpr (std::is_same_v<Element, float>) {
    return 1.f / (1.f + expf(-x));
  } else {
    return __fdividef(1.f, 1.f + __expf(-x));
  }
}

template <class Element>
__device__ __forceinline__ float tanh_for(float x) {
  if constexpr (std::is_same_v<Element, float>) {
    return tanhf(x);
  } else {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
}

template <class Element>
__device__ __forceinline__ int forward_time(const RnnParams<Element>& p, int step) {
  return p.reverse ? p.seq_len - 1 - step : step;
}

// The time backward step q < T runs; forward_time(p, backward_time(p, q)) == T - 1 - q.
template <class Element>
__device__ __forceinline__ int backward_time(const RnnParams<Element>& p, int step) {
  return p.reverse ? step : p.seq_len - 1 - step;
}

// The forward processing step that ran time t.
template <class Element>
__device__ __forceinline__ int forward_step_of(const RnnParams<Element>& p, int t) {
  return p.reverse ? p.seq_len - 1 - t : t;
}

template <class Element>
__device__ __forceinline__ bool backward_valid(const RnnParams<Element>& p, int step, int length) {
  return step < p.seq_len && backward_time(p, step) < length;
}

// Offsets of (t, sample, gate, unit) in this direction's slice of a gate tensor (T, B, D, G*H), of (t, sample, unit)
// in a hidden tensor (T, B, D, H), and of (t, sample, value, unit) in the saved values (T, B, V, H).
template <class Element>
__device__ __forceinline__ size_t gate_offset(const RnnParams<Element>& p, int t, int sample, int gate, int unit) {
  return (static_cast<size_t>(t) * p.batch + sample) * p.directions * p.gates * p.hidden +
         static_cast<size_t>(gate) * p.hidden + unit;
}

template <class Element>
__device__ __forceinline__ size_t hidden_offset(const RnnParams<Element>& p, int t, int sample, int unit) {
  return (static_cast<size_t>(t) * p.batch + sample) * p.directions * p.hidden + unit;
}

template <class Element>
__device__ __forceinline__ size_t saved_offset(const RnnParams<Element>& p, int num_values, int t, int sample,
                                               int unit) {
  return (static_cast<size_t>(t) * p.batch + sample) * num_values * p.hidden + unit;
}

template <class Element, int kValues>
__device__ __forceinline__ void store_saved(const RnnParams<Element>& p, const float (&values)[kValues], int t,
                                            int sample, int unit) {
  float* saved = p.saved + saved_offset(p, kValues, t, sample, unit);
#pragma unroll
  for (int v = 0; v < kValues; ++v) saved[v * p.hidden] = values[v];
}

template <class Element, int kValues>
__device__ __forceinline__ void load_saved(const RnnParams<Element>& p, float (&values)[kValues], int t, int sample,
                                           int unit) {
  const float* saved = p.saved + saved_offset(p, kValues, t, sample, unit);
#pragma unroll
  for (int v = 0; v < kValues; ++v) values[v] = saved[v * p.hidden];
}

// The forward pass's state entering processing step `step` (step + 1: leaving it).
template <class Element>
__device__ __forceinline__ float forward_state_at(const RnnParams<Element>& p, int step, int sample, int unit) {
  return p.forward_state[(static_cast<size_t>(step) * p.batch + sample) * p.forward_state_stride + unit];
}

// The kGates gate inputs of one forward element: its bias_hh entries, fixed for the sequence, and input_proj at the
// step being run. input_proj is kept as loaded and converted only when used: converting it in load() would stall the
// thread there until the load returns, instead of letting it return behind the staging and the multiply.
template <class Element, int kGates>
struct GateInputs {
  float bias[kGates];
  Element input[kGates];

  __device__ void init(const RnnParams<Element>& p, int unit) {
#pragma unroll
    for (int gate = 0; gate < kGates; ++gate) {
      bias[gate] = p.bias != nullptr ? to_float(p.bias[gate * p.hidden + unit]) : 0.f;
    }
  }

  // Every step loads, valid or not (t < T always): the cells read the inputs only at the sample's valid steps.
  __device__ void load(const RnnParams<Element>& p, int t, int sample, int unit) {
#pragma unroll
    for (int gate = 0; gate < kGates; ++gate) input[gate] = p.input_proj[gate_offset(p, t, sample, gate, unit)];
  }

  __device__ float input_at(int gate) const { return to_float(input[gate]); }

  // input + (recurrent + bias) of one gate: the pre-activation, less what a GRU's reset gate scales.
  __device__ float pre_activation(int gate, float recurrent) const {
    return input_at(gate) + (recurrent + bias[gate]);
  }
};

// What the forward cells share: each element's gate inputs, its sample's length, and h after the sample's last valid
// step so far (hx before the first), which it publishes every step. A forward cell derives from it and adds its
// update in finish().
template <class Element_, int kGates>
struct ForwardCell {
  using Element = Element_;
  static constexpr int kRowGates = kGates;
  static constexpr int kVectorGates = 1;
  GateInputs<Element, kGates> inputs;
  float h;
  int length;

  __device__ void init(const RnnParams<Element>& p, int unit, int sample) {
    inputs.init(p, unit);
    length = sample_length(p, sample);
    h = p.state[sample * p.state_stride + unit];  // hx, written before the launch
  }

  __device__ void load(const RnnParams<Element>& p, int step, int unit, int sample) {
    inputs.load(p, forward_time(p, step), sample, unit);
  }

  __device__ void end(const RnnParams<Element>&, int, int) {}
};

// dL/dh_t from outside the recurrence: the layer's output gradient, plus grad_h_n at the sample's last forward step
// (its first backward step: before it the sample published zeros, so the recurrent term there is 0). Loaded in a
// backward cell's load() and summed in its finish(), as GateInputs is, so the thread does not wait for the loads.
template <class Element>
struct OutsideGradient {
  Element output;       // grad_output at t
  Element final_state;  // grad_h_n, which counts only at the sample's last forward step
  bool at_last_step;

  __device__ void load(const RnnParams<Element>& p, int t, int sample, int unit, int length) {
    output = p.grad_output[hidden_offset(p, t, sample, unit)];
    final_state = p.grad_h_n[sample * p.hidden + unit];
    at_last_step = p.reverse ? t == 0 : t == length - 1;
  }

  __device__ float value() const { return to_float(output) + (at_last_step ? to_float(final_state) : 0.f); }
};

// grad_hx of a sample that runs no step is grad_h_n (h_n = hx); the others get theirs at the step after their last
// backward step, from `hidden_gradient` (the recurrent product there, plus what the cell carries past the matrix).
template <class Element>
__device__ __forceinline__ void init_grad_hx(const RnnParams<Element>& p, int unit, int sample, int length) {
  if (length == 0) p.grad_hx[sample * p.hidden + unit] = to_float(p.grad_h_n[sample * p.hidden + unit]);
}

template <class Element>
__device__ __forceinline__ void finish_grad_hx(const RnnParams<Element>& p, int step, int unit, int sample, int length,
                                               float hidden_gradient) {
  if (step > 0 && backward_valid(p, step - 1, length)) p.grad_hx[sample * p.hidden + unit] = hidden_gradient;
}

}  // namespace prnn
