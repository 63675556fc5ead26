// Step-stamped publication between persistent CTAs, and the bounded wait for it.
//
// After finishing step s a CTA stores s + 1 into its own flag (one 128-byte line per flag). A CTA about to run step
// s needs the whole vector published by step s - 1, so it waits until every flag reads >= s. Vectors of different
// steps live in different rows of the state buffer, so a fast CTA never overwrites what a slow one still reads, and
// nothing is reset between steps. The chained engine keeps one such set of flags per chain of samples. Every wait is
// bounded by %globaltimer: past the bound the CTA records kStatusTimedOut and stops waiting, and a CTA that sees a
// nonzero status stops waiting too, so a launch that cannot make progress ends (with outputs that Python discards as
// it raises) instead of hanging.
#pragma once

#include "persistent_rnn.h"

namespace prnn {

// An acquire load, not a relaxed load plus fence.acq_rel: that fence (MEMBAR.ALL.GPU) also waits for every memory
// operation the thread still has in flight, such as the next step's input loads from HBM.
__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ int load_relaxed(const int* address) {
  int value;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Waits until every CTA of p's direction has published `stamp` steps: thread t polls the flag of CTA t (and
// t + blockDim, ...), so all flags are read in parallel, then the CTA meets at a barrier. Returns false, for every
// thread of the CTA, when the launch is failing and the CTA must wait no more.
template <class Element>
__device__ bool wait_for_step(const RnnParams<Element>& p, unsigned stamp, int* abort_s) {
  const unsigned long long start = global_ns();
  bool failed = false;
  for (int cta = threadIdx.x; cta < p.tiling.num_ctas && !failed; cta += blockDim.x) {
    const unsigned* flag = p.flags + static_cast<size_t>(cta) * kFlagStride;
    unsigned polls = 0;
    while (load_acquire(flag) < stamp) {
      // The clock is checked on every miss (a zero timeout fails at once; the tests use that); the status word,
      // which every SM would otherwise hammer, only every 256 misses.
      if (global_ns() - start >= p.timeout_ns || ((++polls & 255) == 0 && load_relaxed(p.status) != 0)) {
        failed = true;
        break;
      }
    }
  }
  if (failed) {
    atomicCAS(p.status, 0, kStatusTimedOut);  // keeps the first cause if another CTA already failed
    *abort_s = 1;
  }
  __syncthreads();  // carries each polling thread's acquire on to the whole CTA's reads of the published vector
  return *abort_s == 0;
}

// The chained engine's wait, by one warp for one chain's `flags`: each lane loads its flags (CTAs lane, lane + 32,
// ...) with relaxed loads issued together, then the warp checks them; once all are set an acquire fence (CCTL.IVALL,
// no MEMBAR) orders what the warp does next after the producers' stores. One acquire load per flag instead would make
// a lane's loads wait for each other, and one warp polls up to four flags a lane: 8 % of the fp32 ReLU 2048's step
// (H200, NOTES.md v24). Returns false when the launch is failing; the caller then stops waiting.
template <class Element>
__device__ bool warp_wait_for_step(const RnnParams<Element>& p, const unsigned* flags, unsigned stamp) {
  constexpr int kFlagsPerLoad = 4;  // loads in flight per lane
  const unsigned long long start = global_ns();
  const int lane = threadIdx.x % 32;
  unsigned polls = 0;
  bool failed = false;
  for (;;) {
    bool ready = true;
    for (int group = 0; group < p.tiling.num_ctas; group += 32 * kFlagsPerLoad) {
      unsigned published[kFlagsPerLoad];
#pragma unroll
      for (int i = 0; i < kFlagsPerLoad; ++i) {
        const int cta = group + lane + 32 * i;
        published[i] = stamp;
        if (cta < p.tiling.num_ctas) {
          asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];"
                       : "=r"(published[i])
                       : "l"(flags + static_cast<size_t>(cta) * kFlagStride));
        }
      }
#pragma unroll
      for (int i = 0; i < kFlagsPerLoad; ++i) ready = ready && published[i] >= stamp;
    }
    if (__all_sync(0xffffffffu, ready)) break;
    const bool out_of_time =
        global_ns() - start >= p.timeout_ns || ((++polls & 255) == 0 && load_relaxed(p.status) != 0);
    if (__any_sync(0xffffffffu, out_of_time)) {
      failed = true;
      break;
    }
  }
  asm volatile("fence.acquire.gpu;" ::: "memory");
  __syncwarp();  // carries each lane's acquire on to the lanes that issue the staging copies
  if (failed && lane == 0) atomicCAS(p.status, 0, kStatusTimedOut);
  return !failed;
}

// Orders every store the CTA made before the last barrier GPU-wide before `stamp` lands in `flag` (a release store
// after a barrier is cumulative over the CTA's stores). One thread calls it.
__device__ __forceinline__ void release_stamp(unsigned* flag, unsigned stamp) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(stamp) : "memory");
}

// Call after a barrier that follows every thread's stores of this step. The CTA's last thread stores the stamp: it
// rarely owns outputs, so no input loads of its own delay the release.
__device__ __forceinline__ void publish(unsigned* flags, int cta, unsigned stamp) {
  if (threadIdx.x == blockDim.x - 1) release_stamp(flags + static_cast<size_t>(cta) * kFlagStride, stamp);
}

}  // namespace prnn
