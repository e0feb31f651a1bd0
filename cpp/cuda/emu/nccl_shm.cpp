// cpp/cuda/emu/nccl_shm.cpp -- the emulated NCCL across processes: a clique's ranks meet in a
// POSIX shared-memory segment (join_segment), and each collective goes through it in rounds of
// at most kSlotBytes per rank (remote_work), summed in rank order as the in-process clique sums.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "cuda/emu/bf16.h"
#include "cuda/emu/nccl_clique.h"

namespace mgpu::emu::nccl {
namespace {

// This rank's result for bytes [off, off + len) of every rank's input, from all slots.
void compute_round(const RemoteOp& op, size_t off, size_t len) {
  const ShmLink& link = *op.clique->link;
  const int n = op.clique->nranks;
  char* recv = static_cast<char*>(op.recv);
  switch (op.kind) {
    case Kind::AllReduce: {
      // Rank order 0..n-1, element by element: the in-process clique's sums, bit for bit.
      if (op.elem == 2) {  // ncclBfloat16 (nccl_emu.h): float32 sums, rounded once
        unsigned short* out = reinterpret_cast<unsigned short*>(recv + off);
        auto widen = [&](int r, size_t i) {
          return __bfloat162float(
              __ushort_as_bfloat16(reinterpret_cast<const unsigned short*>(link.slot(r))[i]));
        };
        for (size_t i = 0; i < len / 2; ++i) {
          float acc = widen(0, i);
          for (int r = 1; r < n; ++r) acc += widen(r, i);
          out[i] = mgpu::emu::bf16_bits_rn(acc);
        }
        break;
      }
      float* out = reinterpret_cast<float*>(recv + off);
      const size_t m = len / sizeof(float);
      for (size_t i = 0; i < m; ++i) {
        float acc = reinterpret_cast<const float*>(link.slot(0))[i];
        for (int r = 1; r < n; ++r) acc += reinterpret_cast<const float*>(link.slot(r))[i];
        out[i] = acc;
      }
      break;
    }
    case Kind::Broadcast:
      std::memcpy(recv + off, link.slot(op.root), len);
      break;
    case Kind::AllGather:
      for (int r = 0; r < n; ++r)
        std::memcpy(recv + op.count * op.elem * size_t(r) + off, link.slot(r), len);
      break;
  }
}

// Advances op as far as it can without waiting: cudaSuccess once it has finished,
// cudaErrorNotReady while it waits for another rank (nothing recorded), else the error.
cudaError_t advance_remote(RemoteOp& op) {
  Clique& c = *op.clique;
  ShmHeader& h = *c.link->header;
  const int n = c.nranks;
  const size_t in_bytes = op.count * op.elem;
  while (op.done_rounds < op.rounds) {
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      aborted = c.aborted;
    }
    if (aborted || h.aborted.load(std::memory_order_acquire) != 0) {
      op.done_rounds = op.rounds;
      return mgpu::emu::fail(
          cudaErrorLaunchFailure,
          cat("NCCL ", kind_name(op.kind), " of rank ", op.rank, " ended by ncclCommAbort",
              aborted ? "" : " of another rank (another process)"));
    }
    if (op.stall) return cudaErrorNotReady;  // this rank never arrives
    const uint64_t round = op.first_round + op.done_rounds;
    const size_t off = size_t(op.done_rounds) * kSlotBytes;
    const size_t len = in_bytes > off ? std::min(kSlotBytes, in_bytes - off) : 0;
    ShmRank& me = h.rank[op.rank];
    if (!op.posted) {
      for (int r = 0; r < n; ++r)  // every rank has read the slots of the round before
        if (h.rank[r].consumed.load(std::memory_order_acquire) + 1 < round)
          return cudaErrorNotReady;
      me.kind = int64_t(op.kind);
      me.count = int64_t(op.count);
      me.elem = int64_t(op.elem);
      me.root = op.root;
      if (len > 0) std::memcpy(c.link->slot(op.rank), static_cast<const char*>(op.send) + off, len);
      me.posted.store(round, std::memory_order_release);
      op.posted = true;
    }
    for (int r = 0; r < n; ++r)
      if (h.rank[r].posted.load(std::memory_order_acquire) < round) return cudaErrorNotReady;
    std::string error;
    for (int r = 0; r < n && error.empty(); ++r) {
      const ShmRank& o = h.rank[r];
      if (o.kind != me.kind || o.count != me.count || o.elem != me.elem || o.root != me.root)
        error = cat("NCCL round ", round, ": rank ", op.rank, " called ", kind_name(op.kind),
                    " of ", op.count, " elements where rank ", r, " called ",
                    kind_name(Kind(o.kind)), " of ", o.count);
    }
    if (!error.empty()) {
      me.consumed.store(round, std::memory_order_release);
      op.done_rounds = op.rounds;
      return mgpu::emu::fail(cudaErrorLaunchFailure, error);
    }
    if (op.async_fault) c.async_error = ncclRemoteError;
    else compute_round(op, off, len);
    me.consumed.store(round, std::memory_order_release);
    op.posted = false;
    ++op.done_rounds;
  }
  return cudaSuccess;
}

}  // namespace

// Strict mode: a run that must wait for another process blocks the stream (block_stream) and
// polls; lenient mode: it waits where it runs, as a kernel spinning on a flag in host memory
// would.
Work remote_work(const std::shared_ptr<RemoteOp>& op) {
  return [op] {
    for (;;) {
      cudaError_t e = advance_remote(*op);
      if (e != cudaErrorNotReady) return e;
      if (mgpu::emu::g_strict.load()) {
        mgpu::emu::block_stream(
            [] { std::this_thread::sleep_for(std::chrono::microseconds(100)); });
        return cudaSuccess;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };
}

ncclResult_t join_segment(const std::string& key, int nranks, int rank,
                          std::unique_ptr<ShmLink>* out, bool* local) {
  std::string name = "/" + key;  // a name of POSIX shared memory has one '/', at its start
  std::replace(name.begin() + 1, name.end(), '/', '-');
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return ncclSystemError;
  auto link = std::make_unique<ShmLink>();
  link->bytes = sizeof(ShmHeader) + size_t(nranks) * kSlotBytes;
  void* p = MAP_FAILED;
  if (ftruncate(fd, off_t(link->bytes)) == 0)
    p = mmap(nullptr, link->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return ncclSystemError;
  }
  link->header = static_cast<ShmHeader*>(p);
  link->slots = static_cast<char*>(p) + sizeof(ShmHeader);
  ShmHeader& h = *link->header;
  h.rank[rank].pid = int32_t(getpid());
  h.joined.fetch_add(1);
  // As NCCL's blocking init: every rank waits until all have joined (10 minutes at most).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  while (h.joined.load() < nranks) {
    if (std::chrono::steady_clock::now() > deadline) {
      shm_unlink(name.c_str());
      return ncclSystemError;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  int here = 0;
  for (int r = 0; r < nranks; ++r) here += h.rank[r].pid == int32_t(getpid());
  if (h.checked.fetch_add(1) + 1 == nranks) shm_unlink(name.c_str());  // mappings stay valid
  *local = here == nranks;
  // Ranks in several processes: one per process (no rank could run another's queued work).
  if (!*local && here != 1) return ncclInvalidUsage;
  if (!*local) *out = std::move(link);
  return ncclSuccess;
}

}  // namespace mgpu::emu::nccl
