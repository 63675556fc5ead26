// Step-counted publication between persistent CTAs, and the bounded wait for it.
//
// After finishing step s a CTA adds one to its direction's step count with a release (one count per chain of samples,
// in a 128-byte line of its own). A CTA about to run step s needs the whole vector published by step s - 1, so it
// waits until the count reaches s x num_ctas. A CTA counts step s + 1 only after seeing s x num_ctas, so no CTA gets
// two steps ahead of another and the count reaches s x num_ctas only once every CTA counted s steps (a failing CTA of
// the plain engine, below, counts without waiting; one of the chained engine stops counting). Vectors of different
// steps live in different rows of the state buffer, so a fast CTA never overwrites what a slow one still reads, and
// nothing is reset between steps. One count polled by one thread (one warp in the chained engine) of each CTA
// replaced one flag per CTA polled by all of them: every SM polling every CTA's flag loaded the L2 enough to cost up
// to 0.45 us a step (NOTES.md v25). Every wait is bounded by %globaltimer: past the bound the CTA records
// kStatusTimedOut and stops waiting, and a CTA that sees a nonzero status stops waiting too, so a launch that cannot
// make progress ends (with outputs that Python discards as it raises) instead of hanging.
#pragma once

#include "persistent_rnn.h"

namespace prnn {

__device__ __forceinline__ int load_relaxed(const int* address) {
  int value;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ unsigned load_relaxed(const unsigned* address) {
  unsigned value;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Polls with relaxed loads until `count` reaches `target`, then one acquire fence (CCTL.IVALL, no MEMBAR) orders what
// the thread reads next after the counted CTAs' stores. Returns false once the launch is failing (this wait ran out
// of time, or another did).
template <class Element>
__device__ bool wait_for_count(const RnnParams<Element>& p, const unsigned* count, unsigned target) {
  const unsigned long long start = global_ns();
  unsigned polls = 0;
  bool failed = false;
  while (load_relaxed(count) < target) {
    // The clock is checked on every miss (a zero timeout fails at once; the tests use that); the status word,
    // which every SM would otherwise hammer, only every 256 misses.
    if (global_ns() - start >= p.timeout_ns || ((++polls & 255) == 0 && load_relaxed(p.status) != 0)) {
      atomicCAS(p.status, 0, kStatusTimedOut);  // keeps the first cause if another CTA already failed
      failed = true;
      break;
    }
  }
  asm volatile("fence.acquire.gpu;" ::: "memory");
  return !failed;
}

// The plain engine's wait: thread 0 polls, then the CTA meets at a barrier, which carries the acquire on to the whole
// CTA's reads of the published vector. Returns false, for every thread of the CTA, when the launch is failing and the
// CTA must wait no more.
template <class Element>
__device__ bool wait_for_step(const RnnParams<Element>& p, unsigned step, int* abort_s) {
  if (threadIdx.x == 0 && !wait_for_count(p, p.step_counts, step * p.tiling.num_ctas)) *abort_s = 1;
  __syncthreads();
  return *abort_s == 0;
}

// Counts this CTA's step, by one thread after a barrier that follows the step's stores (a release after a barrier is
// cumulative over the CTA's stores).
__device__ __forceinline__ void count_step(unsigned* step_count) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(step_count) : "memory");
}

}  // namespace prnn
