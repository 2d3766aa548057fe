// parallel_for over XLA's own intra-op thread pool, for the native CPU kernels (cpu_*.cc).
//
// Why not std::thread per call: a decode step calls the kernels ~40 times, and a fresh thread
// also competes for the cores with XLA's pool threads, which spin for a while after each op.
// Borrowing the pool's threads costs a task hand-off instead.
//
// Work is split into `n` chunks claimed from a shared counter by the calling thread and by up
// to `workers - 1` pool tasks. The caller keeps claiming until none are left and then waits
// only for chunks already claimed by running tasks, so it never waits on a task that has not
// started (no deadlock when the pool is busy or has no threads). A task that starts after the
// work is done finds the counter exhausted and returns without touching `fn`; the counters
// live in a shared_ptr, so such a late task never reads freed memory.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace quicserve {

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t workers, const F& fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  const F* body = &fn;
  auto drain = [state, body, n] {
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      (*body)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>({workers, pool.num_threads() + 1, n}) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(drain)(drain));  // a copy: Schedule takes F&&
  drain();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace quicserve
