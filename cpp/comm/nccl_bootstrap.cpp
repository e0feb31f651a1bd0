// cpp/comm/nccl_bootstrap.cpp -- NcclWorld: the NCCL unique id broadcast over MPI, then
// ncclCommInitRankConfig in nonblocking mode so every wait can be bounded by a deadline.
// Run by mgpu.distributed on the emulated build (see the header).
#include "comm/nccl_bootstrap.h"

#include <chrono>
#include <thread>

#include "core/error.h"

namespace mgpu::comm {
namespace {

std::string mpi_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

}  // namespace

int nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return v;
}

NcclWorld::NcclWorld(MPI_Comm comm, int gpu, double timeout_s) : gpu_(gpu), timeout_s_(timeout_s) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  cudaError_t ce = cudaSetDevice(gpu_);
  if (ce != cudaSuccess)
    throw DeviceError("nccl bootstrap: rank " + std::to_string(rank_) + " cannot use gpu(" +
                      std::to_string(gpu_) + "): " + cudaGetErrorString(ce));
  // The id names the communicator: rank 0 makes it, everyone else receives it over MPI.
  ncclUniqueId id{};
  if (rank_ == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) fail(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  }
  int rc = MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, comm);
  if (rc != MPI_SUCCESS) fail("MPI_Bcast of the NCCL unique id: " + mpi_text(rc));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // returns ncclInProgress; wait_ready polls it under the deadline
  ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    fail(std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r));
  try {
    wait_ready("ncclCommInitRankConfig");
  } catch (...) {
    // A throwing constructor runs no destructor: abort here, or NCCL's proxy threads and the
    // half-made communicator outlive us.
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    throw;
  }
}

NcclWorld::~NcclWorld() {
  if (!comm_) return;
  if (broken_) {
    ncclCommAbort(comm_);
  } else {
    ncclCommDestroy(comm_);
  }
}

void NcclWorld::fail(const std::string& why) {
  broken_ = true;
  throw DeviceError("nccl: rank " + std::to_string(rank_) + " on gpu(" + std::to_string(gpu_) +
                    "): " + why);
}

void NcclWorld::wait_ready(const char* what) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s_));
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(std::string(what) + ": " + ncclGetErrorString(state));
    if (std::chrono::steady_clock::now() > deadline)
      fail(std::string(what) + " timed out: a rank never joined (dead, hung, or a mismatched "
           "collective); MGPU_DIST_TIMEOUT sets the limit");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void NcclWorld::allreduce_sum(float* data, size_t count, cudaStream_t stream) {
  if (broken_) fail("the communicator was aborted by an earlier failure");
  ncclResult_t r = ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, stream);
  if (r != ncclSuccess && r != ncclInProgress)
    fail(std::string("ncclAllReduce: ") + ncclGetErrorString(r));
  wait_ready("ncclAllReduce (enqueue)");
  // The kernel runs on the stream; poll it so a peer that never arrives cannot hang us.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s_));
  for (;;) {
    cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) fail(std::string("ncclAllReduce: ") + cudaGetErrorString(q));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress)
      fail(std::string("ncclAllReduce: ") + ncclGetErrorString(state));
    if (std::chrono::steady_clock::now() > deadline)
      fail("ncclAllReduce of " + std::to_string(count) + " float32 timed out");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace mgpu::comm
