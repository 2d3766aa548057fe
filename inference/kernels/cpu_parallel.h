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

// parallel_for of `first` over [0, n1), then of `second` over [0, n2), in one hand-off: the helpers
// are scheduled before the first phase, so one that wakes late still arrives while the first
// phase runs (a decode step's projections pack x on one thread for ~5-20 us, long enough for
// an idle pool thread to fall asleep, and waking it again cost more than the pack). A thread
// starts the second phase once every first-phase item is done; it waits only on items other
// running threads have claimed. A task that starts after all is done touches neither function.
template <typename F1, typename F2>
void parallel_two_phase(xla::ffi::ThreadPool& pool, int64_t n1, int64_t n2, int64_t workers, const F1& first,
                        const F2& second) {
  struct State {
    std::atomic<int64_t> next1{0}, done1{0}, next2{0}, done2{0};
  };
  auto state = std::make_shared<State>();
  const F1* f1 = &first;
  const F2* f2 = &second;
  auto drain = [state, f1, f2, n1, n2] {
    for (int64_t i; (i = state->next1.fetch_add(1, std::memory_order_relaxed)) < n1;) {
      (*f1)(i);
      state->done1.fetch_add(1, std::memory_order_release);
    }
    while (state->done1.load(std::memory_order_acquire) < n1) std::this_thread::yield();
    for (int64_t i; (i = state->next2.fetch_add(1, std::memory_order_relaxed)) < n2;) {
      (*f2)(i);
      state->done2.fetch_add(1, std::memory_order_release);
    }
  };
  if (n1 <= 0 && n2 <= 0) return;
  const int64_t most = std::max<int64_t>(n1, n2);
  const int64_t helpers = std::min<int64_t>({workers, pool.num_threads() + 1, most}) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(drain)(drain));
  drain();
  while (state->done2.load(std::memory_order_acquire) < n2) std::this_thread::yield();
}

// `fn` over [0, n) as described at the top.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t workers, const F& fn) {
  parallel_two_phase(pool, 0, n, workers, [](int64_t) {}, fn);
}

}  // namespace quicserve
