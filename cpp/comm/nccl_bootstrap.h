// cpp/comm/nccl_bootstrap.h -- NCCL across processes, bootstrapped over MPI: rank 0 makes the
// NCCL unique id, MPI broadcasts it, every rank joins the NCCL communicator on its own GPU.
// mgpu.distributed's all-reduce of GPU tensors runs over it (allreduce_mpi.cpp) in the emulated
// build with MPI, on the emulator's NCCL (cpp/cuda/emu/nccl_emu.h: its ranks in several
// processes meet in shared memory). In a real CUDA build it is compiled and linked where MPI,
// CUDA and NCCL are found (tests/cpp/nccl_bootstrap_check.cpp), not yet called by mgpu.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#if MGPU_CUDA_EMULATION_BUILD
#include "cuda/emu/nccl_emu.h"
#else
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include <cstddef>
#include <string>

namespace mgpu::comm {

// A communicator over every rank of `comm`, one GPU per rank (`gpu` on this rank, usually the
// local rank). Initialisation and collectives are nonblocking in NCCL and polled against
// `timeout_s`: a rank that never joins, or a collective that never completes, aborts the
// communicator and throws DeviceError naming the rank and the operation instead of hanging.
class NcclWorld {
 public:
  NcclWorld(MPI_Comm comm, int gpu, double timeout_s);
  ~NcclWorld();  // ncclCommDestroy (ncclCommAbort if a collective failed); never throws
  NcclWorld(const NcclWorld&) = delete;
  NcclWorld& operator=(const NcclWorld&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // In-place float32 sum of `count` elements at device pointer `data` across ranks, enqueued on
  // `stream` and waited for (under the timeout).
  void allreduce_sum(float* data, size_t count, cudaStream_t stream);

 private:
  void wait_ready(const char* what);
  [[noreturn]] void fail(const std::string& why);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1, gpu_ = 0;
  double timeout_s_;
  bool broken_ = false;
};

// NCCL's version code (e.g. 22809 for 2.28.9); needs no GPU.
int nccl_version();

}  // namespace mgpu::comm
