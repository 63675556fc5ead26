// Persistent recurrent kernels: the parameter struct, the tiling and the host entry points (torch-free).
//
// One launch runs one layer, in one direction or in both at once, for one pass over the whole sequence. With G gates
// per hidden unit (1 vanilla, 3 GRU, 4 LSTM) and U = weight_hh (G*H, H):
//   forward:  the cell turns input_proj_t (G values per unit), U h_{t-1} and its state into h_t;
//   backward: the cell turns the gradient reaching h_t and U^T g_{t+1} into g_t, the gradient of the G hidden-side
//             gate pre-activations, and publishes it; U^T g_t is then the gradient reaching h_{t-1}.
// Every CTA keeps its slice of rows of the matrix it multiplies by (U forward, U^T backward) on chip for the whole
// sequence (a matrix larger than the chip keeps what does not fit in L2, read again every step). Each step it
// waits for the vector the previous step published, multiplies, lets the cell finish its hidden units and publishes
// its slice of the next vector, then counts the step (see sync.cuh). The CTAs of the two directions of a bidirectional
// layer run side by side in one launch, each direction on its own vectors and step counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace prnn {

constexpr int kMaxBatch = 32;
// Steps x samples x directions of one call (persistent.py's MAX_SEQUENCE_ROWS): launch_sequence_gather runs a block
// per row, its grid counted in an int; half of int's range leaves room for the kernels' int step arithmetic (T + 2).
constexpr int64_t kMaxSequenceRows = int64_t{1} << 30;
constexpr int kMaxDirections = 2;
// The status word holds the first failure of a launch; kernels never clear it. A spin-wait ran out of time:
constexpr int kStatusTimedOut = 1;
// A sample's length lay outside [0, T]; the launch runs it clamped, and Python discards its outputs as it raises.
constexpr int kStatusLengthOutOfRange = 2;
// Each chain's step count sits alone in a 128-byte line (stride in unsigned words), so the other chain's traffic does
// not queue on the line every SM polls.
constexpr int kCountStride = 32;

enum class CellKind : int { kRelu = 0, kTanh = 1, kGru = 2, kLstm = 3 };
enum class Pass : int { kForward = 0, kBackward = 1 };
enum class Precision : int { kFloat32 = 0, kBFloat16 = 1 };

constexpr int gates_of(CellKind cell) { return cell == CellKind::kGru ? 3 : (cell == CellKind::kLstm ? 4 : 1); }
// fp32 values per (step, sample, unit) the forward pass keeps for the backward: GRU r, z, n, W_hn h + b_hn;
// LSTM i, f, g, o, c_{t-1}, tanh(c_t). Vanilla cells need only the published state.
constexpr int saved_values_of(CellKind cell) {
  return cell == CellKind::kGru ? 4 : (cell == CellKind::kLstm ? 6 : 0);
}
// Whether a cell's backward pass publishes exactly its grad_input_proj, which is then gathered after the launch
// (launch_sequence_gather) instead of stored by the cell. The GRU publishes its n gate's gradient scaled by r.
constexpr bool backward_publishes_grad_input(CellKind cell) { return cell != CellKind::kGru; }

// Where a kernel variant keeps the weights its registers cannot hold: nowhere (registers hold them all), in shared
// memory, or in shared memory and then L2, re-read every step (matrices larger than the chip: NOTES.md v23).
enum class WeightHome : int { kRegisters = 0, kShared = 1, kSharedAndL2 = 2 };

// The matrix-vector product one pass runs each step: `units` hidden units, each owning `row_gates` rows of the
// matrix (G forward, 1 backward), times a vector of `k_extent` entries per sample (H forward, G*H backward).
struct MatrixShape {
  int units;
  int row_gates;
  int k_extent;
  int batch;
  int smem_limit;  // bytes of dynamic shared memory a CTA may take on the device
};

// How one launch spreads the hidden units over CTAs and threads; chosen per shape on the host (plan.cpp).
struct Tiling {
  int num_ctas;       // persistent CTAs per direction, all co-resident; a multiple of cluster_size (CTAs past the
                      //   hidden units own none but still stage and publish)
  int cluster_size;   // CTAs per thread-block cluster, which share each step's staging (stage.cuh)
  int threads;        // per CTA
  int units_per_cta;  // hidden units a CTA owns; the last CTA may own fewer
  int rows_per_cta;   // matrix rows a CTA holds: units_per_cta * row_gates, gate-major (row = gate * units + unit),
                      //   then padding rows (zero weights) up to the math's row count
  int padded_k;       // K extent covered by the thread tiles (>= k_extent; weights beyond it are zero)
  int row_groups;     // fp32: lanes along rows (G); bf16: 16-row MMA tiles per CTA
  int k_splits;       // fp32: threads along K per row group; bf16: warps along K per row tile
  int num_partials;   // partial sums per output, reduced through shared memory
  int shared_chunks;  // fp32: 16-byte chunks of weights per thread and row kept in shared memory, after its registers'
  int l2_chunks;      // read again from L2 every step, after the shared ones: fp32 chunks per thread and row, bf16
                      //   k-tiles per warp
  int weight_smem_bytes;  // the CTA's weights kept in shared memory (0: all in registers)
  int weight_l2_bytes;    // the CTA's weights read from L2 every step (0: all on chip)
  int smem_bytes;     // dynamic shared memory per CTA, weight_smem_bytes included
  int chains;         // fp32: 0 for the plain engine; else the chained engine (engine.cuh) with this many chains of
                      //   samples (1 or kChains), handed off by its sync warpgroup while the compute warps multiply
  int partial_stride;  // floats from one warp's partial sums to the next's: B * R, padded in the chained engine
  int one_cluster;     // bf16: 1 for the cluster engine (engine.cuh), whose direction is one thread-block cluster of
                       //   cluster_size = num_ctas CTAs handing each step off through distributed shared memory
};

// Sample chains of the chained engine, and the threads a launch of a tiling starts: the chained engine rounds the
// compute threads up to whole warpgroups and adds one warpgroup for the hand-off (setmaxnreg moves registers
// between warpgroups only).
constexpr int kChains = 2;
inline int launch_threads(const Tiling& tiling) {
  return tiling.chains > 0 ? (tiling.threads + 127) / 128 * 128 + 128 : tiling.threads;
}

// One direction of a layer. Shapes: T = seq_len, B = batch, H = hidden, G = gates, D = directions in the launch,
// K = vector_length (H forward, G*H backward), VS = state_stride (K rounded up to 4 floats so rows are 16-byte
// aligned). Sequence tensors are (T, B, D, ...) with this direction's slice at its pointer: "gate" tensors
// (input_proj, grad_input_proj) hold G*H values per (t, b, direction), "hidden" tensors (output, grad_output) H.
// Element is float or __nv_bfloat16: the dtype of the weights and of the sequence tensors.
template <class Element>
struct RnnParams {
  int seq_len;
  int batch;
  int hidden;
  int gates;
  int vector_length;
  int state_stride;
  int directions;
  int num_steps;  // T forward; T + 1 backward (the extra step yields grad_hx of runs that end at the last step)
  bool reverse;   // this direction runs t = T-1 .. 0
  CellKind cell;
  Tiling tiling;

  const Element* weight;   // (G*H, H) weight_hh, row-major
  int weight_row_stride;   // element (r, k) of the matrix this pass multiplies by is weight[r * row + k * col]:
  int weight_col_stride;   //   forward U: (H, 1); backward U^T: (1, H)
  const int64_t* lengths;  // (B,) valid steps per sample; one outside [0, T] sets the status, runs clamped
  float* state;            // published vectors; forward (T+1, B, VS): h after each processing step, [0] = hx;
                           //   backward (T+2, B, VS): g of each backward step, [0] = 0
  __nv_bfloat16* state_bf16;  // bf16 launches: the published vectors again in bf16 (same rows, row stride
  int state_bf16_stride;      //   state_bf16_stride = K rounded up to 8), which the bf16 engine stages: it multiplies
                              //   in bf16 anyway, and every CTA reads each vector, so half the bytes; else nullptr
  float* saved;            // (T, B, saved_values_of(cell), H) fp32: written forward, read backward; or nullptr
  float* cell_state;       // LSTM (B, H): forward c0 in, c_n out; backward grad_c_n in, grad_cx out
  Element* out;            // backward where !backward_publishes_grad_input: grad_input_proj (gate tensor); else
                           //   nullptr: the forward output and the other cells' grad_input_proj equal the published
                           //   vectors and are gathered from `state` after the launch (launch_sequence_gather)

  const Element* input_proj;  // forward: gate tensor
  const Element* bias;        // forward: (G*H,) or nullptr

  const Element* grad_output;  // backward: hidden tensor
  const Element* grad_h_n;     // backward: (B, H)
  const float* forward_state;  // backward: (T+1, B, H rounded up to 4), the forward pass's state
  int forward_state_stride;    // backward: its row stride
  float* grad_hx;              // backward: (B, H)

  float* l2_weights;  // (num_ctas, weight_l2_bytes) of this direction, written and read by the kernel alone: the
                     //   weights that registers and shared memory cannot hold; nullptr where they hold all
  unsigned* step_counts;  // (kChains * kCountStride,) zero before launch; step_counts[chain * kCountStride] = steps
                         //   published of that chain, summed over the direction's CTAs (the plain engine has one chain)
  int* status;      // (1,) 0, or the first kStatus* failure of the launch
  unsigned long long timeout_ns;  // bound on every spin-wait
};

// What one launch runs: D directions of a layer (the same shape and tiling), CTAs [d * num_ctas, (d+1) * num_ctas)
// on direction d.
template <class Element>
struct LayerParams {
  RnnParams<Element> direction[kMaxDirections];
};

// A compiled kernel and the tilings its register/shared-memory layout can take for a shape.
struct KernelVariant {
  const void* kernel;  // __global__ void(LayerParams<Element>)
  int max_threads;     // its __launch_bounds__
  std::vector<Tiling> (*tilings)(const MatrixShape& shape);
};

// The compiled variants of a cell, one file per precision and pass (fp32_forward.cu, ...) so they build in parallel.
std::vector<KernelVariant> fp32_forward_variants(CellKind cell);
std::vector<KernelVariant> fp32_backward_variants(CellKind cell);
std::vector<KernelVariant> bf16_forward_variants(CellKind cell);
std::vector<KernelVariant> bf16_backward_variants(CellKind cell);

struct LaunchPlan {
  bool ok;
  std::string reason;  // why not, when !ok
  Tiling tiling;
  const void* kernel;
};

// The tiling for this shape with `directions` directions co-resident on the current device, or the reason there is
// none. Cached per device and shape.
LaunchPlan plan_launch(Precision precision, Pass pass, CellKind cell, int hidden, int batch, int directions);

// Cooperative launch (co-residency guaranteed by the driver, or an error) of the plan's CTAs for each of
// `directions` directions on `stream`, in clusters of the tiling's cluster_size.
template <class Element>
cudaError_t launch(const LaunchPlan& plan, const LayerParams<Element>& params, int directions, cudaStream_t stream);

// After a pass's launches: out (T, B, D, width) in the layer's dtype, direction d's published vector for time t where
// t < lengths[b], else 0. `vectors` (D, vectors_per_direction, B, vector_stride) is the passes' RnnParams::state;
// vector 1 + s of direction 0 holds time s, or T-1-s where `reversed`, and direction 1's the other way round
// (sequence_gather.cu).
template <class Element>
cudaError_t launch_sequence_gather(const float* vectors, Element* out, const int64_t* lengths, int seq_len,
                                   int batch, int width, int vector_stride, int vectors_per_direction, int directions,
                                   bool reversed, cudaStream_t stream);

}  // namespace prnn
