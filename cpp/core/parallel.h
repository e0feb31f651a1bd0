// cpp/core/parallel.h -- intra-op parallelism for CPU kernels.
// A CPU device runs its queue on one worker thread; a kernel running there may fan out over
// the device's share of the machine's cores with parallel_for. Cores are shared fairly: when k
// CPU devices are busy at once, each gets cores/k, so k devices never oversubscribe the machine.
#pragma once

#include <cstdint>
#include <functional>

namespace mgpu {

// Calls fn(i) for every i in [0, n), possibly concurrently on several threads, and returns when
// all calls have finished. fn must be safe to run concurrently for different i, and a kernel's
// result must not depend on which thread runs which i or in which order: reductions across i
// are done by the caller afterwards, in index order, so results are deterministic.
// Exceptions thrown by fn are rethrown (the first one) on the calling thread.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

// Total worker threads mgpu uses for CPU compute (default: hardware cores; env MGPU_NUM_THREADS).
int num_threads();
void set_num_threads(int n);

// Blocks the asynchronous signals (SIGINT, SIGTERM, SIGUSR1, ...; not the synchronous faults) in
// the calling thread. Every thread mgpu starts calls it first, so that a signal sent to the
// process reaches Python's main thread, whose handlers act on it, and never interrupts a
// worker's wait.
void block_async_signals();

}  // namespace mgpu
