// Staging each step's published vector in shared memory with bulk copies, shared within a thread-block cluster.
//
// Every CTA multiplies by the whole published vector, so each step every CTA used to read the same bytes from L2 with
// its own loads (72-128 SMs x up to 32 KB a step, near the L2's bandwidth). Now the CTAs of a cluster of
// `cluster_size` split each row of the vector into that many slices; a CTA copies its slice with one bulk copy per
// row (the copy engine, not the threads) and multicasts it into the shared memory of every CTA of its cluster, so L2
// serves each byte once per cluster. Each CTA counts the bytes landing in its own shared memory on an mbarrier (the
// whole vector, from all slices) and its threads wait for that before the multiply.
//
// Two mbarriers alternate by step (two per chain in the chained engine, each chain its own rows): a CTA waits for every
// slice of step s before it finishes step s, so a peer can run at most one step ahead and its copies of step s + 1 are
// counted on the other mbarrier. A step's staged buffer is rewritten only after every CTA published the step before
// (the count's wait), i.e. after this CTA's multiply read it. The copies move whole 16-byte chunks: a row's entries
// past the vector's length must be zero in global memory.
#pragma once

#include <cstdint>

namespace prnn {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ int cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return static_cast<int>(rank);
}

// Every thread of every CTA of the cluster arrives; shared-memory writes before it are visible to the cluster after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// This CTA's share of a row of `chunks` 16-byte chunks split among the cluster's `cluster_size` CTAs: chunks [first,
// first + count). Cluster sizes are powers of two (cluster_sizes, plan.cpp), so shifts do what divisions would, at a
// few instructions instead of a reciprocal and a dozen multiplies on the way from a step's wait to its copies.
struct RowSlice {
  int first;
  int count;
};
__device__ __forceinline__ RowSlice row_slice(int chunks, int cluster_size) {
  const int rank = cluster_rank();
  const int log2_cluster_size = __ffs(cluster_size) - 1;
  const int first = (rank * chunks) >> log2_cluster_size;
  return {first, (((rank + 1) * chunks) >> log2_cluster_size) - first};
}

// Initialises this CTA's `count` staging mbarriers (one arrival each: the thread that sets the step's byte count)
// and makes them, and the shared memory zeroed before, ready for the peers' copies. Call with the whole CTA, before
// any copy of the launch.
__device__ __forceinline__ void init_staging(uint64_t* barriers, int count) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < count; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barriers + i)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the zeroing before, then the copies' writes
  cluster_sync();
}

// Issues the bulk copy of one row's slice (`bytes` from `from`) into `to` in every CTA of the cluster, counted on the
// mbarrier at `barrier_address` of each.
__device__ __forceinline__ void copy_slice(uint32_t to, const char* from, int bytes, uint32_t barrier_address,
                                           int cluster_size) {
  if (cluster_size == 1) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(to), "l"(from), "r"(bytes), "r"(barrier_address)
                 : "memory");
  } else {
    const uint16_t all_ctas = static_cast<uint16_t>((1u << cluster_size) - 1);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
        "%4;" ::"r"(to), "l"(from), "r"(bytes), "r"(barrier_address), "h"(all_ctas)
        : "memory");
  }
}

// Starts staging `batch` rows of `row_bytes` (a multiple of 16) from `source` (rows back to back) into `staged` (rows
// `staged_row_bytes` apart) in every CTA of the cluster. Call with the whole CTA after the step's wait. Lane 0 of warp
// w issues the copies of rows w, w + warps, ...: a bulk copy takes its operands from uniform registers, so the lanes
// of one warp would issue theirs one after another (~60 ns each on an H100, NOTES.md v18).
__device__ __forceinline__ void start_staging(const void* source, int row_bytes, void* staged, int staged_row_bytes,
                                              int batch, int cluster_size, uint64_t* barrier) {
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0 || warp >= batch) return;
  const uint32_t barrier_address = shared_address(barrier);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier_address),
                 "r"(batch * row_bytes)
                 : "memory");
  }
  const RowSlice slice = row_slice(row_bytes / 16, cluster_size);
  const int bytes = slice.count * 16;
  if (bytes == 0) return;
  // The wait's acquire (generic proxy) before the copy engine's reads (async proxy) of what other SMs published.
  asm volatile("fence.proxy.async.global;" ::: "memory");
  for (int sample = warp; sample < batch; sample += blockDim.x / 32) {
    const char* from = static_cast<const char*>(source) + static_cast<size_t>(sample) * row_bytes + 16 * slice.first;
    const uint32_t to = shared_address(static_cast<char*>(staged) + sample * staged_row_bytes + 16 * slice.first);
    copy_slice(to, from, bytes, barrier_address, cluster_size);
  }
}

// The same for one chain's `rows` rows (at most 32: chains_for gives a chain at most 16 samples), by one warp (the
// chained engine's staging warp): lane r issues row r. What stays the same from step to step (the slice, the
// addresses, the byte counts) is worked out once, before the steps: the warp runs in 32 registers, and that arithmetic
// and the long-lived operands around it, redone every step, had ptxas spill to local memory between the warp seeing
// the step's count and issuing its copies (NOTES.md v26). Apart from start_staging: one
// function for both callers, with the issuing lanes as parameters, changed the plain engine's machine code and cost
// the bidirectional fp32 ReLU at 1152 3-5 % (NOTES.md v24).
class ChainStaging {
 public:
  // source: the chain's first row at step 0, rows `row_bytes` apart, the next step's `step_bytes` further on;
  // staged: the chain's first row in shared memory, rows `staged_row_bytes` apart; barriers: the chain's two
  // mbarriers, used by step parity.
  __device__ ChainStaging(const void* source, long long step_bytes, int row_bytes, void* staged, int staged_row_bytes,
                          int rows, int cluster_size, uint64_t* barriers)
      : step_bytes_(step_bytes), barriers_(shared_address(barriers)), expected_bytes_(rows * row_bytes),
        cluster_size_(cluster_size) {
    const int lane = threadIdx.x % 32;
    const RowSlice slice = row_slice(row_bytes / 16, cluster_size);
    bytes_ = lane < rows ? slice.count * 16 : 0;
    source_ = static_cast<const char*>(source) + static_cast<size_t>(lane) * row_bytes + 16 * slice.first;
    to_ = shared_address(static_cast<char*>(staged) + lane * staged_row_bytes + 16 * slice.first);
  }

  // Starts staging step `step`'s rows into every CTA of the cluster. Call with the whole warp after the step's wait.
  __device__ void start(int step) const {
    const uint32_t barrier = barriers_ + 8 * (step % 2);
    if (threadIdx.x % 32 == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(expected_bytes_)
                   : "memory");
    }
    if (bytes_ == 0) return;
    // The wait's acquire (generic proxy) before the copy engine's reads (async proxy) of what other SMs published.
    asm volatile("fence.proxy.async.global;" ::: "memory");
    copy_slice(to_, source_ + step * step_bytes_, bytes_, barrier, cluster_size_);
  }

 private:
  const char* source_;
  long long step_bytes_;
  uint32_t to_;
  uint32_t barriers_;
  int bytes_;
  int expected_bytes_;
  int cluster_size_;
};

// Waits until the whole vector started for this mbarrier's current phase (`parity`) has landed. Not bounded by the
// timeout: it waits only for the CTAs of this cluster, which are resident together and never stop staging (a CTA
// whose wait timed out goes on without waiting, see engine.cuh).
__device__ __forceinline__ void finish_staging(uint64_t* barrier, uint32_t parity) {
  const uint32_t barrier_address = shared_address(barrier);
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred ready;\n\tmbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n\t"
        "selp.b32 %0, 1, 0, ready;\n\t}"
        : "=r"(done)
        : "r"(barrier_address), "r"(parity)
        : "memory");
  }
}

}  // namespace prnn
