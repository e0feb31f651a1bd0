// cpp/cuda/emu/nccl_clique.h -- the emulated NCCL's cliques (private to nccl_emu.cpp and
// nccl_shm.cpp): a clique's ranks and their meets in this process, and the shared-memory segment
// through which the ranks of a clique across processes meet instead.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/emu/internal.h"
#include "cuda/emu/nccl_emu.h"

namespace mgpu::emu::nccl {

enum class Kind { AllReduce, Broadcast, AllGather };
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "allreduce";
    case Kind::Broadcast: return "broadcast";
    case Kind::AllGather: return "allgather";
  }
  return "?";
}

// One collective as every rank sees it: the n-th call of each rank of a clique.
struct Meet {
  Kind kind = Kind::AllReduce;
  size_t count = 0;  // elements per rank (all-gather: sent per rank)
  size_t elem = 0;   // bytes per element
  int root = 0;
  bool async_fault = false;           // some rank was issued under MGPU_EMU_NCCL_FAIL=async
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<CUstream_st*> stream;   // each rank's stream, known once that rank has issued
  std::vector<char> arrived;
  int n_arrived = 0, n_left = 0;
  bool done = false;
  std::string error;                  // a mismatched call: every rank fails with it
};

// ---- Ranks in several processes: the shared-memory segment of a clique -----------------------
constexpr int kMaxShmRanks = 64;
constexpr size_t kSlotBytes = size_t(1) << 20;  // one rank's part of a round

// A rank's row of the segment. A round r of the clique (every rank's collectives cut into rounds
// of at most kSlotBytes, numbered alike on every rank) goes: wait until every rank has consumed
// round r-1 (read every slot), write this rank's part and the call's description into its slot,
// posted = r; wait until every rank has posted r, compute this rank's result, consumed = r.
struct ShmRank {
  std::atomic<uint64_t> posted;
  std::atomic<uint64_t> consumed;
  int64_t kind, count, elem, root;  // the call of the round last posted, compared by every rank
  int32_t pid;
  int32_t pad;
};
struct ShmHeader {
  std::atomic<int> joined;   // ranks registered (ncclCommInitRank)
  std::atomic<int> checked;  // ranks that have seen everyone's pid; the last one unlinks the name
  std::atomic<int> aborted;  // some rank called ncclCommAbort: every wait fails
  int32_t nranks;
  ShmRank rank[kMaxShmRanks];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "the segment's atomics must work across processes");

struct ShmLink {
  ShmHeader* header = nullptr;
  char* slots = nullptr;  // nranks slots of kSlotBytes after the header
  size_t bytes = 0;
  ~ShmLink() {
    if (header != nullptr) munmap(header, bytes);
  }
  char* slot(int r) const { return slots + size_t(r) * kSlotBytes; }
};

struct Clique {
  explicit Clique(int n) : nranks(n) {}
  const int nranks;
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int joined = 0;  // ncclCommInitRank: ranks that have joined so far
  std::map<uint64_t, Meet> meets;
  std::atomic<int> async_error{ncclSuccess};
  std::unique_ptr<ShmLink> link;  // set when the ranks run in several processes
};

// ---- A collective of a clique across processes ------------------------------------------------
// One rank's collective, cut into the clique's rounds (reserved when it is issued, so the rounds
// follow each rank's host call order, as the collectives must on every rank).
struct RemoteOp {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  Kind kind = Kind::AllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0, elem = 0;
  int root = 0;
  bool stall = false, async_fault = false;
  uint64_t first_round = 0, rounds = 1, done_rounds = 0;
  bool posted = false;  // this rank's part of the current round is in its slot
};

// The work a rank's collective across processes puts on its stream (nccl_shm.cpp).
Work remote_work(const std::shared_ptr<RemoteOp>& op);
// Registers `rank` in the segment named by the id and waits until every rank has. Returns the
// mapping with *local = whether every rank runs in this process (then it is unmapped: the ranks
// meet in this process's registry) or an error.
ncclResult_t join_segment(const std::string& key, int nranks, int rank,
                          std::unique_ptr<ShmLink>* out, bool* local);

}  // namespace mgpu::emu::nccl
