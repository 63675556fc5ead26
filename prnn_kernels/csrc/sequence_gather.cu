// Sequence tensors gathered, after a pass's launch, from the vectors its persistent kernel published. A kernel
// publishes each step's vector (RnnParams::state) for the next step to stage; where a sequence output equals it (the
// forward output is h, the vanilla and LSTM grad_input_proj is the published gradient), storing it a second time sat
// before each step's release: the output's store took 0.13 us of the fp32 ReLU 2048's 2.80 us forward step at 4
// utterances (NOTES.md v29). One pass over the sequence afterwards costs each step far less.
#include "cell_common.cuh"

namespace prnn {
namespace {

// Block r fills row r = (t, b, d) of out (T, B, D, width): direction d's vector for time t where t < length[b], else 0.
template <class Element>
__global__ void sequence_gather_kernel(const float* __restrict__ vectors, Element* __restrict__ out,
                                       const int64_t* __restrict__ lengths, int seq_len, int batch, int width,
                                       int vector_stride, int vectors_per_direction, int directions, bool reversed) {
  const int row = blockIdx.x;
  const int direction = row % directions;
  const int sample = row / directions % batch;
  const int t = row / (directions * batch);
  const bool valid = t < clamp_length(lengths[sample], seq_len);
  const int step = reversed != (direction == 1) ? seq_len - 1 - t : t;  // the step whose vector holds time t
  const size_t vector = static_cast<size_t>(direction) * vectors_per_direction + 1 + step;
  const float* source = vectors + (vector * batch + sample) * vector_stride;
  Element* out_row = out + static_cast<size_t>(row) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) out_row[i] = from_float<Element>(valid ? source[i] : 0.f);
}

}  // namespace

template <class Element>
cudaError_t launch_sequence_gather(const float* vectors, Element* out, const int64_t* lengths, int seq_len,
                                   int batch, int width, int vector_stride, int vectors_per_direction, int directions,
                                   bool reversed, cudaStream_t stream) {
  sequence_gather_kernel<Element><<<seq_len * batch * directions, 256, 0, stream>>>(
      vectors, out, lengths, seq_len, batch, width, vector_stride, vectors_per_direction, directions, reversed);
  return cudaGetLastError();
}

template cudaError_t launch_sequence_gather<float>(const float*, float*, const int64_t*, int, int, int, int, int, int,
                                                   bool, cudaStream_t);
template cudaError_t launch_sequence_gather<__nv_bfloat16>(const float*, __nv_bfloat16*, const int64_t*, int, int, int,
                                                           int, int, int, bool, cudaStream_t);

}  // namespace prnn
