// Persistent recurrent kernels: the parameter struct, the tiling and the host entry points (torch-free).
//
// One launch runs one layer in one direction for one pass over the whole sequence:
//   forward:  h_t = act(input_proj_t + bias + U h_{t-1})          (U = weight_hh)
//   backward: dpre_t = (grad_output_t + grad carried from t+1) * act'(h_t), carried grad = U^T dpre_t
// Every CTA keeps its slice of rows of the matrix it multiplies by (U forward, U^T backward) on chip for the whole
// sequence. Each step it waits for the vector the previous step published, multiplies, finishes its outputs and
// publishes its slice of the next vector with a step stamp (see sync.cuh).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace prnn {

constexpr int kMaxBatch = 16;
// (row, sample) outputs each thread finishes per step; tilings keep rows_per_cta * batch <= this * threads.
constexpr int kElementsPerThread = 2;
// Written to the status word when a spin-wait ran out of time; kernels never clear it.
constexpr int kStatusTimedOut = 1;
// Each CTA's flag sits alone in a 128-byte line (stride in unsigned words), so the many SMs polling different flags
// spread over L2 slices instead of queueing on a few lines.
constexpr int kFlagStride = 32;

enum class Activation : int { kRelu = 0, kTanh = 1 };
enum class Pass : int { kForward = 0, kBackward = 1 };
enum class Precision : int { kFloat32 = 0, kBFloat16 = 1 };

// How one launch spreads the hidden units over CTAs and threads; chosen per shape on the host (plan.cpp).
struct Tiling {
  int num_ctas;      // persistent CTAs, all co-resident
  int threads;       // per CTA
  int rows_per_cta;  // R: hidden units (matrix rows) a CTA owns; the last CTA may own fewer
  int padded_k;      // K extent covered by the thread tiles (>= hidden; weights beyond hidden are zero)
  int row_groups;    // fp32: lanes along rows (G); bf16: 8-row MMA tiles per CTA
  int k_splits;      // fp32: threads along K per row group; bf16: warps along K per row tile
  int num_partials;  // partial sums per output, reduced through shared memory
  int smem_bytes;    // dynamic shared memory per CTA
};

// Shapes: T = seq_len, B = batch, H = hidden, HS = state_stride (H rounded up to 4 floats so rows are 16-byte aligned).
// Element is float or __nv_bfloat16: the dtype of the weights, input_proj, outputs and their gradients.
template <class Element>
struct RnnParams {
  int seq_len;
  int batch;
  int hidden;
  int state_stride;
  int num_steps;  // T forward; T + 1 backward (the extra step yields grad_hx of runs that end at the last step)
  bool reverse;   // the layer runs t = T-1 .. 0
  Activation activation;
  Tiling tiling;

  const Element* weight;  // (H, H) weight_hh, row-major
  int weight_row_stride;  // element (r, k) of the matrix this pass multiplies by is weight[r * row + k * col]:
  int weight_col_stride;  //   forward U: (H, 1); backward U^T: (1, H)
  const int64_t* lengths;  // (B,) valid steps per sample, clamped to [0, T]
  float* state;            // published vectors; forward (T+1, B, HS): h after each processing step, [0] = hx;
                           //   backward (T+2, B, HS): dpre of each backward step, [0] = 0
  Element* out;            // (T, B, H): forward output (0 at t >= length); backward grad of input_proj

  const Element* input_proj;  // forward: (T, B, H)
  const Element* bias;        // forward: (H,) or nullptr

  const Element* grad_output;  // backward: (T, B, H)
  const Element* grad_h_n;     // backward: (B, H)
  const float* forward_state;  // backward: (T+1, B, HS), the forward pass's state
  float* grad_hx;              // backward: (B, H)

  unsigned* flags;  // (num_ctas * kFlagStride,) zero before launch; flags[c * kFlagStride] = steps CTA c published
  int* status;      // (1,) 0, or kStatusTimedOut once any wait ran out of time
  unsigned long long timeout_ns;  // bound on every spin-wait
};

// A compiled kernel and the tilings its register/shared-memory layout can take for a shape.
struct KernelVariant {
  const void* kernel;  // __global__ void(RnnParams<Element>)
  int max_threads;     // its __launch_bounds__
  std::vector<Tiling> (*tilings)(int hidden, int batch);
};

// The compiled variants, one file per precision and pass (fp32_forward.cu, ...) so they build in parallel.
std::vector<KernelVariant> fp32_forward_variants();
std::vector<KernelVariant> fp32_backward_variants();
std::vector<KernelVariant> bf16_forward_variants();
std::vector<KernelVariant> bf16_backward_variants();

struct LaunchPlan {
  bool ok;
  std::string reason;  // why not, when !ok
  Tiling tiling;
  const void* kernel;
};

// The tiling for this shape on the current device, or the reason there is none. Cached per device and shape.
LaunchPlan plan_launch(Precision precision, Pass pass, int hidden, int batch);

// Cooperative launch (co-residency guaranteed by the driver, or an error) on `stream`.
template <class Element>
cudaError_t launch(const LaunchPlan& plan, const RnnParams<Element>& params, cudaStream_t stream);

}  // namespace prnn
