// cpp/comm/nccl_bootstrap.h -- NCCL across processes, bootstrapped over MPI: rank 0 makes the
// NCCL unique id, MPI broadcasts it, every rank joins the NCCL communicator on its own GPU.
// mgpu.distributed's all-reduce of GPU tensors runs over it (allreduce_mpi.cpp) wherever the engine
// has MPI and an NCCL: run on the emulator's (cpp/cuda/emu/nccl_emu.h, ranks in several processes
// meet in shared memory), compiled and linked against the toolkit's in the real CUDA build.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#if MGPU_CUDA_EMULATION_BUILD
#include "cuda/emu/nccl_emu.h"
#else
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace mgpu::comm {

// A communicator over every rank of `comm`, one GPU per rank (`gpu` on this rank, usually the
// local rank). NCCL runs in nonblocking mode so every wait is polled against `timeout_s`: a rank
// that never joins, or a collective that never completes, aborts the communicator
// (ncclCommAbort, which also ends a collective still running on the GPU) and throws DeviceError
// naming the rank and the operation instead of hanging. A watchdog thread aborts a collective
// past its deadline too, for the waits no poll returns from (the emulator runs a collective in
// the call that enqueues or queries it). A failed world stays failed.
class NcclWorld {
 public:
  NcclWorld(MPI_Comm comm, int gpu, double timeout_s);
  ~NcclWorld();  // close(); never throws
  NcclWorld(const NcclWorld&) = delete;
  NcclWorld& operator=(const NcclWorld&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int gpu() const { return gpu_; }
  // In-place sum of `count` elements at device pointer `data` across ranks, enqueued on
  // `stream` after the work already there, and waited for (under the timeout): float32, or with
  // bf16 bfloat16 bits (ncclBfloat16: NCCL's sums, see comm::dist::allreduce).
  void allreduce_sum(void* data, size_t count, cudaStream_t stream, bool bf16 = false);
  // Ends the communicator: ncclCommFinalize, polled until every rank's is done (under the
  // timeout), then ncclCommDestroy; ncclCommAbort instead after a failure or when finalizing
  // fails or times out. Every rank calls it (finalizing waits for the others). Returns "" or why
  // it aborted; idempotent; never throws.
  std::string close() noexcept;
  // ncclCommAbort now (finalize() after another failure: the ranks may not all be there).
  void abort() noexcept { abort_now(); }

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  Deadline deadline() const;
  // Polls the communicator's state until it leaves ncclInProgress or the deadline passes
  // (then *timed_out). Returns the state, or the error of ncclCommGetAsyncError itself.
  ncclResult_t poll_state(Deadline until, bool* timed_out);
  void wait_ready(const char* what, Deadline until);
  void use_gpu(const char* what);
  void abort_locked() noexcept;  // needs mutex_
  void abort_now() noexcept;
  [[noreturn]] void fail(const std::string& why);
  // The watchdog: arm() before a collective, disarm() after; past the deadline it aborts.
  void arm(Deadline until, const std::string& what);
  bool disarm();  // true when the watchdog fired (the communicator is aborted)
  void watch();
  void stop_watchdog() noexcept;

  std::mutex mutex_;  // comm_ and broken_ against the watchdog; the watchdog's state
  std::condition_variable cv_;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1, gpu_ = 0;
  double timeout_s_;
  std::string broken_;  // why the communicator was aborted ("" while usable)
  bool armed_ = false, fired_ = false, stop_ = false;
  uint64_t armed_seq_ = 0;
  Deadline armed_until_{};
  std::string armed_what_;
  std::thread watchdog_;
};

// NCCL's version code (e.g. 22809 for 2.28.9); needs no GPU.
int nccl_version();

}  // namespace mgpu::comm
