// cpp/comm/nccl_bootstrap.cpp -- NcclWorld: the NCCL unique id broadcast over MPI, then
// ncclCommInitRankConfig in nonblocking mode so every wait can be bounded by a deadline; after
// any NCCL call returns ncclInProgress, ncclCommGetAsyncError is polled until ncclSuccess before
// the next NCCL call (NCCL's rule for nonblocking communicators).
#include "comm/nccl_bootstrap.h"

#include <cstdint>

#include "core/error.h"

namespace mgpu::comm {
namespace {

std::string mpi_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

// What rank 0 broadcasts: the id, or (ok == 0) word that it could not make one, so the other
// ranks fail with it instead of waiting for an id that never comes.
struct IdMessage {
  ncclUniqueId id;
  int32_t ok;
  int32_t error;
};

}  // namespace

int nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return v;
}

NcclWorld::NcclWorld(MPI_Comm comm, int gpu, double timeout_s) : gpu_(gpu), timeout_s_(timeout_s) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  const Deadline until = deadline();
  // The id names the communicator: rank 0 makes it, everyone else receives it over MPI. Rank 0
  // takes part in the broadcast even when ncclGetUniqueId fails, so nobody waits for it. The
  // broadcast is nonblocking and polled: its buffer stays allocated if it never completes.
  auto* msg = new IdMessage{};
  if (rank_ == 0) {
    // The current device first, as for every NCCL call that may touch a GPU.
    cudaError_t ce = cudaSetDevice(gpu_);
    ncclResult_t r = ce == cudaSuccess ? ncclGetUniqueId(&msg->id) : ncclUnhandledCudaError;
    msg->ok = r == ncclSuccess;
    msg->error = static_cast<int32_t>(r);
  }
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Ibcast(msg, static_cast<int>(sizeof(IdMessage)), MPI_BYTE, 0, comm, &req);
  if (rc != MPI_SUCCESS) fail("MPI_Ibcast of the NCCL unique id: " + mpi_text(rc));
  for (int done = 0;;) {
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) fail("MPI_Ibcast of the NCCL unique id: " + mpi_text(rc));
    if (done) break;
    if (std::chrono::steady_clock::now() > until)
      fail("the broadcast of the NCCL unique id from rank 0 timed out (a rank never got there); "
           "MGPU_DIST_TIMEOUT sets the limit");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  const IdMessage got = *msg;
  delete msg;
  if (!got.ok)
    fail(std::string("rank 0 could not make the NCCL unique id (ncclGetUniqueId: ") +
         ncclGetErrorString(static_cast<ncclResult_t>(got.error)) + ")");
  // NCCL binds the communicator to the calling thread's current device.
  use_gpu("ncclCommInitRankConfig");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls may return ncclInProgress; wait_ready polls under the deadline
  ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, got.id, rank_, &config);
  // On failure fail() aborts whatever part of the communicator exists: a throwing constructor
  // runs no destructor, and NCCL's threads must not outlive us.
  if (r != ncclSuccess && r != ncclInProgress)
    fail(std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r));
  wait_ready("ncclCommInitRankConfig", until);
  watchdog_ = std::thread([this] { watch(); });
}

NcclWorld::~NcclWorld() { close(); }

NcclWorld::Deadline NcclWorld::deadline() const {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(timeout_s_));
}

void NcclWorld::use_gpu(const char* what) {
  cudaError_t ce = cudaSetDevice(gpu_);
  if (ce != cudaSuccess)
    fail(std::string(what) + ": cannot make gpu(" + std::to_string(gpu_) + ") current: " +
         cudaGetErrorString(ce));
}

void NcclWorld::abort_locked() noexcept {
  if (!comm_) return;
  cudaSetDevice(gpu_);   // the calling thread may be the watchdog
  ncclCommAbort(comm_);  // frees the communicator and ends what it still runs on the GPU
  comm_ = nullptr;
}

void NcclWorld::abort_now() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked();
}

void NcclWorld::fail(const std::string& why) {
  const std::string text = "nccl: rank " + std::to_string(rank_) + " on gpu(" +
                           std::to_string(gpu_) + "): " + why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_.empty()) broken_ = text;
    abort_locked();
  }
  throw DeviceError(text);
}

ncclResult_t NcclWorld::poll_state(Deadline until, bool* timed_out) {
  *timed_out = false;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!comm_) return ncclInvalidUsage;  // aborted (by the watchdog) meanwhile
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return r;
    }
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() > until) {
      *timed_out = true;
      return ncclInProgress;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void NcclWorld::wait_ready(const char* what, Deadline until) {
  bool timed_out = false;
  ncclResult_t state = poll_state(until, &timed_out);
  if (timed_out)
    fail(std::string(what) + " timed out: a rank never joined (dead, hung, or a mismatched "
         "collective); MGPU_DIST_TIMEOUT sets the limit");
  if (state != ncclSuccess) fail(std::string(what) + ": " + ncclGetErrorString(state));
}

void NcclWorld::arm(Deadline until, const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = true;
    ++armed_seq_;
    armed_until_ = until;
    armed_what_ = what;
  }
  cv_.notify_all();
}

bool NcclWorld::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  const bool fired = fired_;
  fired_ = false;
  return fired;
}

void NcclWorld::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || armed_; });
    if (stop_) return;
    const uint64_t seq = armed_seq_;
    const Deadline until = armed_until_;
    if (cv_.wait_until(lock, until, [&] { return stop_ || !armed_ || armed_seq_ != seq; }))
      continue;  // finished (or stopping) in time
    // Past the deadline and still running: abort, which ends the wait wherever it is.
    fired_ = true;
    armed_ = false;
    if (broken_.empty())
      broken_ = "nccl: rank " + std::to_string(rank_) + " on gpu(" + std::to_string(gpu_) +
                "): " + armed_what_ + " timed out (a rank never arrived); the communicator was "
                "aborted; MGPU_DIST_TIMEOUT sets the limit";
    abort_locked();
  }
}

void NcclWorld::stop_watchdog() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void NcclWorld::allreduce_sum(void* data, size_t count, cudaStream_t stream, bool bf16) {
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty() || !comm_)
      throw DeviceError("nccl: rank " + std::to_string(rank_) + ": the communicator across "
                        "ranks was aborted by an earlier failure (" +
                        (broken_.empty() ? std::string("it was closed") : broken_) + ")");
    comm = comm_;
  }
  use_gpu("ncclAllReduce");  // the stream and the communicator belong to gpu_
  const Deadline until = deadline();
  const std::string what =
      "ncclAllReduce of " + std::to_string(count) + (bf16 ? " bfloat16" : " float32");
  arm(until, what);
  std::string error;
  // Outside the lock: the call may wait for the other ranks (the emulator runs it here), and
  // the watchdog's abort is what ends such a wait.
  ncclResult_t r = ncclAllReduce(data, data, count, bf16 ? ncclBfloat16 : ncclFloat, ncclSum,
                                 comm, stream);
  if (r != ncclSuccess && r != ncclInProgress) error = what + ": " + ncclGetErrorString(r);
  // Nonblocking: the collective may still be on its way onto the stream; nothing else may be
  // called or launched there before the communicator's state is ncclSuccess.
  bool timed_out = false;
  if (error.empty()) {
    ncclResult_t state = poll_state(until, &timed_out);
    if (state != ncclSuccess && !timed_out)
      error = what + " (enqueue): " + ncclGetErrorString(state);
  }
  // It runs on the stream after the work queued there before it (the gradients' producers).
  // Poll the stream, not block on it, so a peer that never arrives ends in an abort, not a hang.
  while (error.empty() && !timed_out) {
    cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      error = what + ": " + cudaGetErrorString(q);
      break;
    }
    ncclResult_t state = poll_state(until, &timed_out);
    if (state != ncclSuccess && !timed_out) error = what + ": " + ncclGetErrorString(state);
    if (std::chrono::steady_clock::now() > until) timed_out = true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (disarm()) {  // the watchdog aborted it: its reason, not the symptom it left behind
    std::lock_guard<std::mutex> lock(mutex_);
    throw DeviceError(broken_);
  }
  if (timed_out)
    fail(what + " timed out (a rank never arrived); MGPU_DIST_TIMEOUT sets the limit");
  if (!error.empty()) fail(error);
}

std::string NcclWorld::close() noexcept {
  stop_watchdog();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!comm_) return broken_;
  // Called from the host thread: the communicator's device for NCCL, then the caller's again.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  struct Restore {
    int device;
    ~Restore() {
      if (device >= 0) cudaSetDevice(device);
    }
  } restore{previous};
  cudaSetDevice(gpu_);
  ncclResult_t r = ncclCommFinalize(comm_);
  // Polled here rather than by poll_state, which takes the lock this holds.
  bool timed_out = false;
  const Deadline until = deadline();
  while (r == ncclSuccess || r == ncclInProgress) {
    ncclResult_t state = ncclSuccess;
    r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) break;
    r = state;
    if (state != ncclInProgress) break;
    if (std::chrono::steady_clock::now() > until) {
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (r == ncclSuccess && !timed_out) {
    ncclCommDestroy(comm_);
    comm_ = nullptr;
    return "";
  }
  broken_ = "nccl: rank " + std::to_string(rank_) + ": ncclCommFinalize " +
            (timed_out ? std::string("timed out") : std::string("failed: ") +
                                                        ncclGetErrorString(r)) +
            "; the communicator was aborted";
  abort_locked();
  return broken_;
}

}  // namespace mgpu::comm
