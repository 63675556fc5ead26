// A forward layer's output, gathered after its launch from the vectors the persistent kernel published: the kernel
// publishes h every step (RnnParams::state) for the next step and for the backward pass, and a second store of the
// same h into the output sat before each step's release, 0.13 us of the fp32 ReLU 2048's 2.80 us step at 4 utterances
// (NOTES.md v29). One pass over the sequence afterwards costs each step far less.
#include "cell_common.cuh"

namespace prnn {
namespace {

// Block r fills output row r = (t, b, d) of (T, B, D, H): direction d's h at time t where t < length[b], else 0.
template <class Element>
__global__ void layer_output_kernel(const float* __restrict__ state, Element* __restrict__ out,
                                    const int64_t* __restrict__ lengths, int seq_len, int batch, int hidden,
                                    int state_stride, int directions, bool reverse) {
  const int row = blockIdx.x;
  const int direction = row % directions;
  const int sample = row / directions % batch;
  const int t = row / (directions * batch);
  const bool valid = t < clamp_length(lengths[sample], seq_len);
  const int step = reverse != (direction == 1) ? seq_len - 1 - t : t;  // the processing step that ran time t
  // Row step + 1 of this direction's (T+1, B, VS) vectors: h after that step.
  const size_t vector = static_cast<size_t>(direction) * (seq_len + 1) + step + 1;
  const float* h = state + (vector * batch + sample) * state_stride;
  Element* out_row = out + static_cast<size_t>(row) * hidden;
  for (int unit = threadIdx.x; unit < hidden; unit += blockDim.x) {
    out_row[unit] = from_float<Element>(valid ? h[unit] : 0.f);
  }
}

}  // namespace

template <class Element>
cudaError_t launch_layer_output(const float* state, Element* out, const int64_t* lengths, int seq_len, int batch,
                                int hidden, int state_stride, int directions, bool reverse, cudaStream_t stream) {
  const int rows = seq_len * batch * directions;
  layer_output_kernel<Element><<<rows, 256, 0, stream>>>(state, out, lengths, seq_len, batch, hidden, state_stride,
                                                         directions, reverse);
  return cudaGetLastError();
}

template cudaError_t launch_layer_output<float>(const float*, float*, const int64_t*, int, int, int, int, int, bool,
                                                cudaStream_t);
template cudaError_t launch_layer_output<__nv_bfloat16>(const float*, __nv_bfloat16*, const int64_t*, int, int, int,
                                                        int, int, bool, cudaStream_t);

}  // namespace prnn
