// The fp32 kernels compiled for a cell: the cell's register-only variants (fp32_forward.cu, fp32_backward.cu), then
// three that keep what the registers cannot hold in shared memory, tried by the planner only where no register-only
// variant runs the launch (plan.cpp): 2 rows x 8 chunks in up to 512 threads, 3 x 8 and 5 x 6 in up to 384. Between
// them they cover the row counts per CTA that larger matrices need (NOTES.md v21). Last, two that keep what shared
// memory cannot hold either in L2, for matrices larger than the chip, tried only where nothing else runs one direction:
// 2 x 8 (16 units of an LSTM, or 16 or more of one row each in the backward) and 3 x 8 (16 GRU units) (NOTES.md v23).
//
// Variants whose weights and cell state fit the chained engine's registers (add_variant) come in both engines
// (engine.cuh): the chained one proposes the tilings chains_for gives chains, the plain one the others, so the planner
// sees each tiling once.
#pragma once

#include <vector>

#include "engine.cuh"
#include "fp32_math.cuh"

namespace prnn {

// How many chains of samples the chained engine runs a tiling with, or 0 where the plain engine runs it faster.
// Measured kernel-only beside the plain engine (NOTES.md v24):
// - Two chains pay from about 2^17 multiply-adds per CTA and step (rows x padded K x samples), each chain adding a
//   barrier, a reduction and the cell's pass over its elements: the ReLU at 2048 with 4 utterances (2^17) 5 % faster,
//   with 8 and 16 13-15 %, both directions with 4 9 %, the GRU at 1152 with 4-16 5-14 % forward (H200); the ReLU at
//   1152 with 4 (73 728) 2-4 % slower, the ReLU at 512 and the GRU at 256 with 4 (2^15) 3-20 %.
// - With one or two utterances one chain, which only moves the hand-off off the compute warps, paid in the 512-thread
//   variants from 2^14 multiply-adds per utterance (ReLU 1152-2048 3-8 %, both directions of the ReLU at 2048 17 %, the
//   GRU's forward at 800 4 %; H100) and cost the 384-thread ones 6-8 % (GRU 1152, ReLU 3072), whose compute warps
//   have 160 registers instead of 168.
inline int chains_for(const Tiling& tiling, int batch, int max_threads) {
  const long long work = static_cast<long long>(tiling.rows_per_cta) * tiling.padded_k;
  if (batch <= 2) return max_threads == 512 && work >= (1 << 14) ? 1 : 0;
  return work * batch >= (1 << 17) ? kChains : 0;
}

template <class Math>
std::vector<Tiling> plain_tilings(const MatrixShape& shape) {
  std::vector<Tiling> result;
  for (const Tiling& t : Math::tilings(shape)) {
    if (chains_for(t, shape.batch, Math::kMaxThreads) == 0) result.push_back(t);
  }
  return result;
}

// The chained engine's tilings. Where four lanes reduce each element's partials together (the gated cells, Elements in
// engine.cuh), the partials' stride is padded to 8 modulo 32 floats if shared memory has room, so that the four read
// different banks.
template <class Math, class Cell>
std::vector<Tiling> chained_tilings(const MatrixShape& shape) {
  std::vector<Tiling> result;
  for (Tiling t : Math::tilings(shape)) {
    t.chains = chains_for(t, shape.batch, Math::kMaxThreads);
    if (t.chains == 0) continue;
    if (Elements<Math, Cell>::kMostLanes == 1) {
      result.push_back(t);
      continue;
    }
    Tiling padded = t;
    padded.partial_stride = round_up(t.partial_stride, 32) + 8;
    padded.smem_bytes = cta_shared_bytes(Math::staged_bytes(t, shape.batch), partial_floats(padded)) +
                        t.weight_smem_bytes;
    result.push_back(padded.smem_bytes <= shape.smem_limit ? padded : t);
  }
  return result;
}

// In the chained engine the 512-thread variants' compute warps have 112 registers, not 128 (engine.cuh): 2 x 8 chunks
// of weights (64 registers) beside two elements of a gated cell then spilled 24-148 bytes, and the LSTM at 1024 ran
// 46-49 % slower a forward step than in the plain engine, so there only the vanilla cells chain. The 5 x 6 variant
// (the LSTM's at 1152, 160 registers instead of 168) ran 1-8 % slower chained, and re-reading the L2 weights once per
// chain cost the LSTM at 2048 22 % (NOTES.md v24): those run in the plain engine alone (vanilla_cell, engine.cuh).

// Math for Cell in the plain engine, and in the chained engine too where `chained`.
template <class Math, class Cell, bool chained = true>
void add_variant(std::vector<KernelVariant>& variants) {
  if constexpr (chained) {
    variants.push_back(kernel_variant<Math, Cell>(&plain_tilings<Math>));
    variants.push_back(chained_kernel_variant<Math, Cell>(&chained_tilings<Math, Cell>));
  } else {
    variants.push_back(kernel_variant<Math, Cell>());
  }
}

template <class Cell>
std::vector<KernelVariant> fp32_variants(std::vector<KernelVariant> in_registers) {
  constexpr WeightHome kShared = WeightHome::kShared;
  constexpr WeightHome kL2 = WeightHome::kSharedAndL2;
  add_variant<Fp32Math<2, 8, 512, kShared>, Cell, vanilla_cell<Cell>>(in_registers);
  add_variant<Fp32Math<3, 8, 384, kShared>, Cell>(in_registers);
  add_variant<Fp32Math<5, 6, 384, kShared>, Cell, false>(in_registers);
  add_variant<Fp32Math<2, 8, 512, kL2>, Cell, false>(in_registers);
  add_variant<Fp32Math<3, 8, 384, kL2>, Cell, false>(in_registers);
  return in_registers;
}

}  // namespace prnn
