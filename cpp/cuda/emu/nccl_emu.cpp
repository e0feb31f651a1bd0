// cpp/cuda/emu/nccl_emu.cpp -- the emulated NCCL of nccl_emu.h: cliques of ranks in this process,
// collectives as stream work that meet the other ranks' calls, group calls, abort, asynchronous
// errors and the fault injection the header lists. A clique across processes meets through shared
// memory instead (nccl_shm.cpp); the cliques' types are in nccl_clique.h.
#include "cuda/emu/nccl_emu.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "cuda/emu/bf16.h"
#include "cuda/emu/internal.h"
#include "cuda/emu/nccl_clique.h"

using namespace mgpu::emu::nccl;

namespace {

using mgpu::emu::cat;

const char* api_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "ncclAllReduce";
    case Kind::Broadcast: return "ncclBroadcast";
    case Kind::AllGather: return "ncclAllGather";
  }
  return "?";
}

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int device = 0;
  std::atomic<uint64_t> next_seq{0};  // this rank's collectives, in host call order
  uint64_t next_round = 1;            // a clique across processes: this rank's next round
  // ncclCommAbort and ncclCommDestroy free the communicator, as NCCL does. The emulator keeps the
  // handle allocated but poisoned (the call that freed it), so that a later call on it fails
  // loudly instead of working; a call that another thread is inside while it is freed (in_call)
  // is reported too: on a GPU either one reads freed memory.
  std::atomic<const char*> freed_by{nullptr};
  std::atomic<int> in_call{0};
};

namespace {

// ---- Communicators used after they were freed -------------------------------------------------
std::atomic<uint64_t> g_freed_uses{0};

void report_freed_use(const std::string& what) {
  g_freed_uses.fetch_add(1);
  std::fprintf(stderr, "mgpu emulated NCCL: %s\n", what.c_str());
}

// Whether comm has been freed; a call on it is reported (and then fails with ncclInvalidUsage).
bool used_after_free(const ncclComm* comm, const char* call) {
  const char* by = comm->freed_by.load();
  if (by == nullptr) return false;
  report_freed_use(cat(call, " on a communicator that ", by,
                       " has freed (a use after free: on a GPU it reads freed memory)"));
  return true;
}

// A call's use of a communicator, from its first read of the handle to its last.
class InCall {
 public:
  explicit InCall(ncclComm* comm) : comm_(comm) { comm_->in_call.fetch_add(1); }
  ~InCall() { comm_->in_call.fetch_sub(1); }
  InCall(const InCall&) = delete;
  InCall& operator=(const InCall&) = delete;

 private:
  ncclComm* comm_;
};

ncclResult_t free_comm(ncclComm* comm, const char* by) {
  const char* none = nullptr;
  if (!comm->freed_by.compare_exchange_strong(none, by)) {
    report_freed_use(cat(by, " on a communicator that ", none, " has freed already (a double free)"));
    return ncclInvalidUsage;
  }
  if (int n = comm->in_call.load(); n > 0)
    report_freed_use(cat(by, " freed a communicator while ", n, " other call(s) on it were still "
                         "running (a use after free: on a GPU they read freed memory)"));
  return ncclSuccess;
}


// ---- Fault injection --------------------------------------------------------------------------
std::vector<std::string> fault_items() {
  std::vector<std::string> items;
  const char* v = std::getenv("MGPU_EMU_NCCL_FAIL");
  if (v == nullptr) return items;
  std::string s(v);
  size_t at = 0;
  while (at <= s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    if (comma > at) items.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}
bool call_fails(const char* name, int rank) {
  for (const std::string& item : fault_items())
    if (item == name || item == cat(name, ":", rank)) return true;
  return false;
}
bool async_fault() {
  for (const std::string& item : fault_items())
    if (item == "async") return true;
  return false;
}
int stalled_rank() {
  const char* v = std::getenv("MGPU_EMU_NCCL_STALL");
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  long r = std::strtol(v, &end, 10);
  return *end == '\0' ? int(r) : -1;
}

// ---- The collective itself -------------------------------------------------------------------
// The last rank to arrive computes every rank's result; sums go in rank order 0..n-1.
void complete(Clique& c, Meet& m) {
  const int n = c.nranks;
  if (m.async_fault) {
    c.async_error = ncclRemoteError;
    return;
  }
  const size_t bytes = m.count * m.elem;
  std::vector<char> result;
  switch (m.kind) {
    case Kind::AllReduce: {
      result.resize(bytes);
      if (m.elem == 2) {  // ncclBfloat16 (nccl_emu.h): float32 sums in rank order, one rounding
        unsigned short* out = reinterpret_cast<unsigned short*>(result.data());
        auto widen = [&](int r, size_t i) {
          return __bfloat162float(
              __ushort_as_bfloat16(static_cast<const unsigned short*>(m.send[r])[i]));
        };
        for (size_t i = 0; i < m.count; ++i) {
          float acc = widen(0, i);
          for (int r = 1; r < n; ++r) acc += widen(r, i);
          out[i] = mgpu::emu::bf16_bits_rn(acc);
        }
        break;
      }
      std::vector<float> acc(m.count);
      std::memcpy(acc.data(), m.send[0], bytes);
      for (int r = 1; r < n; ++r) {
        const float* x = static_cast<const float*>(m.send[r]);
        for (size_t i = 0; i < m.count; ++i) acc[i] += x[i];
      }
      std::memcpy(result.data(), acc.data(), bytes);
      break;
    }
    case Kind::Broadcast:
      result.assign(static_cast<const char*>(m.send[m.root]),
                    static_cast<const char*>(m.send[m.root]) + bytes);
      break;
    case Kind::AllGather:
      result.resize(bytes * size_t(n));
      for (int r = 0; r < n; ++r) std::memcpy(result.data() + bytes * size_t(r), m.send[r], bytes);
      break;
  }
  if (result.empty()) return;
  for (int r = 0; r < n; ++r) std::memcpy(m.recv[r], result.data(), result.size());
}

cudaError_t aborted_error(const Clique& c, int rank, uint64_t seq, const Meet* m) {
  std::string missing;
  if (m != nullptr) {
    for (int r = 0; r < c.nranks; ++r)
      if (!m->arrived[size_t(r)]) missing += cat(missing.empty() ? "" : ", ", r);
  }
  return mgpu::emu::fail(
      cudaErrorLaunchFailure,
      cat("NCCL collective #", seq, " of rank ", rank, " ended by ncclCommAbort",
          missing.empty() ? std::string() : cat(" while waiting for rank(s) ", missing)));
}

// A rank's arrival at meet `seq`: its buffers are recorded; the last rank to arrive computes
// every rank's result. Caller holds c.mu.
void arrive(Clique& c, Meet& m, int rank, const void* send, void* recv) {
  m.send[size_t(rank)] = send;
  m.recv[size_t(rank)] = recv;
  m.arrived[size_t(rank)] = 1;
  if (++m.n_arrived == c.nranks) {
    if (m.error.empty()) complete(c, m);
    m.done = true;
    c.cv.notify_all();
  }
}

// A rank leaves a completed meet; the last one to leave erases it. Caller holds c.mu.
cudaError_t leave(Clique& c, Meet& m, uint64_t seq) {
  std::string error = m.error;
  if (++m.n_left == c.nranks) c.meets.erase(seq);
  if (!error.empty()) return mgpu::emu::fail(cudaErrorLaunchFailure, error);
  return cudaSuccess;
}

// What a rank's blocked collective waits for: the streams of the ranks that have not arrived
// (those whose collective is queued already). Empty once the meet is done or the clique aborted.
std::vector<mgpu::emu::Need> meet_needs(Clique& c, uint64_t seq) {
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.meets.find(seq);
  if (c.aborted || it == c.meets.end() || it->second.done) return {};
  const Meet& m = it->second;
  std::vector<mgpu::emu::Need> needs;
  for (int r = 0; r < c.nranks; ++r)
    if (!m.arrived[size_t(r)] && m.stream[size_t(r)] != nullptr)
      needs.push_back({m.stream[size_t(r)],
                       cat("rank ", r, "'s NCCL ", kind_name(m.kind), " #", seq, " queued")});
  return needs;
}

// A deadlock found through meet `seq`: it can never complete, so every rank's collective fails
// with the report (those that arrive later too).
void break_meet(Clique& c, uint64_t seq, const std::string& report) {
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.meets.find(seq);
  if (it == c.meets.end() || it->second.done) return;
  it->second.error = cat("NCCL ", kind_name(it->second.kind), " #", seq, ": ", report);
  it->second.done = true;
  c.cv.notify_all();
}

// Strict mode: waits until meet `seq` is done or the clique aborted (a stalled rank: until the
// abort). Meanwhile it runs the queued work of the ranks that have not arrived, whose collective
// may be waiting in a stream that nothing synchronises with yet (their host threads may be
// waiting for this one), and the work those streams wait for. It holds no stream while it waits,
// and takes a stream only where no other thread runs it (whoever runs it makes the same
// progress). While nothing moves it looks for a deadlock through this rank's stream (a cycle of
// streams each waiting for the next, e.g. a rank's stream waiting on an event recorded after
// another rank's collective): then the meet fails with the report instead of waiting for ever.
void wait_meet(const std::shared_ptr<Clique>& cp, uint64_t seq, int rank, bool stalled) {
  Clique& c = *cp;
  mgpu::emu::DeadlockCheck check;
  auto idle_since = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(c.mu);
  for (;;) {
    if (c.aborted) return;
    std::vector<CUstream_st*> behind;
    CUstream_st* mine = nullptr;
    if (!stalled) {
      auto it = c.meets.find(seq);
      if (it == c.meets.end() || it->second.done) return;
      const Meet& m = it->second;
      mine = m.stream[size_t(rank)];
      for (int r = 0; r < c.nranks; ++r)
        if (!m.arrived[size_t(r)] && m.stream[size_t(r)] != nullptr)
          behind.push_back(m.stream[size_t(r)]);
    }
    bool ran = false;
    if (!behind.empty()) {
      lock.unlock();
      ran = mgpu::emu::help_along(behind);
      lock.lock();
    }
    const auto now = std::chrono::steady_clock::now();
    if (ran) {
      idle_since = now;
      continue;
    }
    if (mine != nullptr && now - idle_since > std::chrono::milliseconds(20)) {
      idle_since = now;
      lock.unlock();
      const bool found = !mgpu::emu::check_deadlock(mine, &check).empty();
      lock.lock();
      if (found) continue;  // the meet has failed with the report
    }
    c.cv.wait_for(lock, std::chrono::milliseconds(1));
  }
}

// Lenient mode, graph replays and the legacy default stream: the collective waits where it runs
// until every rank has arrived (strict mode helps the missing ranks along, as wait_meet).
cudaError_t run_collective(const std::shared_ptr<Clique>& cp, int rank, uint64_t seq, bool stall,
                           const void* send, void* recv) {
  Clique& c = *cp;
  std::unique_lock<std::mutex> lock(c.mu);
  if (stall) {  // this rank never arrives: its stream hangs as a stuck kernel would
    c.cv.wait(lock, [&] { return c.aborted; });
    return aborted_error(c, rank, seq, nullptr);
  }
  if (c.aborted) return aborted_error(c, rank, seq, nullptr);
  Meet& m = c.meets[seq];
  arrive(c, m, rank, send, recv);
  if (!m.done) {
    if (mgpu::emu::g_strict.load()) {
      lock.unlock();
      wait_meet(cp, seq, rank, false);
      lock.lock();
    } else {
      c.cv.wait(lock, [&] { return m.done || c.aborted; });
    }
    if (!m.done) return aborted_error(c, rank, seq, &m);
  }
  return leave(c, m, seq);
}

// Strict mode: a rank's collective as an item of its stream that never waits while it holds the
// stream. Its first run arrives; until the meet is done it blocks the stream (block_stream) with
// a wait that helps the missing ranks; the run after completion leaves the meet.
struct Arrival {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  uint64_t seq = 0;
  bool stall = false;
  const void* send = nullptr;
  void* recv = nullptr;
  bool arrived = false;
};

cudaError_t step_collective(Arrival& a) {
  Clique& c = *a.clique;
  std::unique_lock<std::mutex> lock(c.mu);
  if (a.stall) {
    if (c.aborted) return aborted_error(c, a.rank, a.seq, nullptr);
    mgpu::emu::block_stream(
        [cp = a.clique, seq = a.seq, rank = a.rank] { wait_meet(cp, seq, rank, true); });
    return cudaSuccess;
  }
  if (!a.arrived && c.aborted) return aborted_error(c, a.rank, a.seq, nullptr);
  Meet& m = c.meets[a.seq];
  if (!a.arrived) {
    a.arrived = true;
    arrive(c, m, a.rank, a.send, a.recv);
  }
  if (!m.done) {
    if (c.aborted) return aborted_error(c, a.rank, a.seq, &m);
    mgpu::emu::block_stream(
        [cp = a.clique, seq = a.seq, rank = a.rank] { wait_meet(cp, seq, rank, false); },
        [cp = a.clique, seq = a.seq] { return meet_needs(*cp, seq); },
        [cp = a.clique, seq = a.seq](const std::string& report) { break_meet(*cp, seq, report); });
    return cudaSuccess;
  }
  return leave(c, m, a.seq);
}

// A collective checked and ready to issue on its stream.
struct Op {
  ncclComm* comm;
  Kind kind;
  const void* send;
  void* recv;
  size_t count, elem;
  int root;
  CUstream_st* stream;
  bool stall, async_fault;
  std::shared_ptr<RemoteOp> remote = nullptr;  // set by issue_ops for a clique across processes
  std::shared_ptr<Clique> clique = nullptr;     // comm's, read by issue_ops before it issues
  int rank = 0;
};

// Issues ops in order: each takes its rank's next sequence number, then its work goes on its
// stream. Ops on different streams are issued from threads of their own (a lenient stream runs
// the work at once, and it waits there for the other ranks' ops of the same call).
ncclResult_t issue_ops(std::vector<Op>& ops, const char* api) {
  std::vector<std::pair<CUstream_st*, std::vector<std::pair<Op, uint64_t>>>> by_stream;
  // The communicators are read (and must be live) until each op has its sequence number; the
  // work then issued holds their cliques, not them (a lenient stream runs it here, and it may
  // wait there until an abort of the communicator ends it).
  std::vector<std::unique_ptr<InCall>> using_comms;
  for (Op& op : ops) {
    if (used_after_free(op.comm, api)) return ncclInvalidUsage;
    using_comms.push_back(std::make_unique<InCall>(op.comm));
    op.clique = op.comm->clique;
    op.rank = op.comm->rank;
  }
  for (Op& op : ops) {
    uint64_t seq = op.comm->next_seq.fetch_add(1);
    Clique& c = *op.comm->clique;
    if (c.link) {
      auto r = std::make_shared<RemoteOp>();
      r->clique = op.comm->clique;
      r->rank = op.comm->rank;
      r->kind = op.kind;
      r->send = op.send;
      r->recv = op.recv;
      r->count = op.count;
      r->elem = op.elem;
      r->root = op.root;
      r->stall = op.stall;
      r->async_fault = op.async_fault;
      const size_t bytes = op.count * op.elem;
      r->rounds = std::max<uint64_t>(1, (bytes + kSlotBytes - 1) / kSlotBytes);
      r->first_round = op.comm->next_round;
      op.comm->next_round += r->rounds;
      op.remote = r;
    } else {
      std::lock_guard<std::mutex> lock(c.mu);
      Meet& m = c.meets[seq];
      if (m.stream.empty()) {
        m.kind = op.kind;
        m.count = op.count;
        m.elem = op.elem;
        m.root = op.root;
        m.send.assign(size_t(c.nranks), nullptr);
        m.recv.assign(size_t(c.nranks), nullptr);
        m.stream.assign(size_t(c.nranks), nullptr);
        m.arrived.assign(size_t(c.nranks), 0);
      } else if (m.kind != op.kind || m.count != op.count || m.elem != op.elem ||
                 m.root != op.root) {
        m.error = cat("NCCL collective #", seq, ": rank ", op.comm->rank, " called ",
                      kind_name(op.kind), " of ", op.count, " elements where another rank called ",
                      kind_name(m.kind), " of ", m.count);
      }
      m.stream[size_t(op.comm->rank)] = op.stream;
      m.async_fault = m.async_fault || op.async_fault;
    }
    auto it = std::find_if(by_stream.begin(), by_stream.end(),
                           [&](const auto& e) { return e.first == op.stream; });
    if (it == by_stream.end()) {
      by_stream.push_back({op.stream, {}});
      it = by_stream.end() - 1;
    }
    it->second.push_back({op, seq});
  }
  using_comms.clear();
  std::vector<cudaError_t> results(by_stream.size(), cudaSuccess);
  auto issue_stream = [&](size_t i) {
    CUstream_st* s = by_stream[i].first;
    mgpu::emu::tls.device = s->device;
    for (auto& [op, seq] : by_stream[i].second) {
      cudaError_t e = cudaSuccess;
      if (op.remote) {
        if (mgpu::emu::g_strict.load() && !s->capturing && !s->is_default) {
          mgpu::emu::push_pending(s, remote_work(op.remote));
        } else {
          e = mgpu::emu::issue(kind_name(op.kind), s, s->is_default, remote_work(op.remote));
        }
      } else if (mgpu::emu::g_strict.load() && !s->capturing && !s->is_default) {
        // Strict mode: queued like any work, never run here at random (issue() runs a stream
        // one time in four): the item is the non-waiting step_collective.
        auto a = std::make_shared<Arrival>();
        a->clique = op.clique;
        a->rank = op.rank;
        a->seq = seq;
        a->stall = op.stall;
        a->send = op.send;
        a->recv = op.recv;
        mgpu::emu::push_pending(s, [a] { return step_collective(*a); });
      } else {
        Work work = [clique = op.clique, rank = op.rank, seq = seq, stall = op.stall,
                     send = op.send, recv = op.recv] {
          return run_collective(clique, rank, seq, stall, send, recv);
        };
        e = mgpu::emu::issue(kind_name(op.kind), s, s->is_default, std::move(work));
      }
      if (e != cudaSuccess && results[i] == cudaSuccess) results[i] = e;
    }
  };
  if (by_stream.size() == 1) {
    issue_stream(0);
  } else {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < by_stream.size(); ++i) threads.emplace_back(issue_stream, i);
    for (std::thread& t : threads) t.join();
  }
  for (cudaError_t e : results)
    if (e != cudaSuccess) return ncclUnhandledCudaError;
  return ncclSuccess;
}

thread_local int t_group_depth = 0;
thread_local std::vector<Op> t_group_ops;
thread_local ncclResult_t t_group_error = ncclSuccess;

ncclResult_t enqueue(Kind kind, const void* send, void* recv, size_t count, size_t elem, int root,
                     ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t r = [&]() -> ncclResult_t {
    if (comm == nullptr || send == nullptr || recv == nullptr) return ncclInvalidArgument;
    if (used_after_free(comm, api_name(kind))) return ncclInvalidUsage;
    std::vector<Op> ops;
    {
      InCall in_call(comm);
      if (comm->clique->aborted) return ncclInvalidUsage;
      if (call_fails(kind_name(kind), comm->rank)) return ncclUnhandledCudaError;
      CUstream_st* s = nullptr;
      if (mgpu::emu::resolve_stream(kind_name(kind), stream, &s) != cudaSuccess)
        return ncclInvalidArgument;
      if (s->device != comm->device) return ncclInvalidArgument;
      const size_t in_bytes = count * elem;
      const size_t out_bytes =
          kind == Kind::AllGather ? in_bytes * size_t(comm->clique->nranks) : in_bytes;
      if (in_bytes > 0 && (mgpu::emu::check_side(kind_name(kind), "sendbuff", send, in_bytes,
                                                 "device", comm->device) != cudaSuccess ||
                           mgpu::emu::check_side(kind_name(kind), "recvbuff", recv, out_bytes,
                                                 "device", comm->device) != cudaSuccess))
        return ncclInvalidArgument;
      Op op{comm, kind, send, recv, count, elem, root, s, stalled_rank() == comm->rank,
            async_fault()};
      // Strict mode: a launch takes a while (on a GPU, microseconds to milliseconds), so an
      // abort from another thread can land inside it; here it then shows.
      if (mgpu::emu::g_strict.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (const char* by = comm->freed_by.load(); by != nullptr) {
        report_freed_use(cat(api_name(kind), " was still using a communicator when ", by,
                             " freed it (a use after free: on a GPU it reads freed memory)"));
        return ncclInvalidUsage;
      }
      if (t_group_depth > 0) {
        t_group_ops.push_back(op);
        return ncclSuccess;
      }
      ops.push_back(op);
    }
    return issue_ops(ops, api_name(kind));
  }();
  if (r != ncclSuccess && t_group_depth > 0 && t_group_error == ncclSuccess) t_group_error = r;
  return r;
}

size_t elem_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
  }
  return 0;
}

std::mutex g_registry_mu;
std::map<std::string, std::shared_ptr<Clique>>& registry() {
  static auto* m = new std::map<std::string, std::shared_ptr<Clique>>;
  return *m;
}

}  // namespace

namespace mgpu::emu {
uint64_t nccl_freed_uses() { return g_freed_uses.load(); }
}  // namespace mgpu::emu

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  static std::atomic<unsigned long long> counter{0};
  if (uniqueId == nullptr) return ncclInvalidArgument;
  std::memset(uniqueId->internal, 0, sizeof uniqueId->internal);
  // The random part keeps a segment left behind by a dead run (same pid) from being joined.
  static const unsigned long long nonce = std::random_device{}();
  std::snprintf(uniqueId->internal, sizeof uniqueId->internal, "mgpu-emu-nccl-%ld-%llx-%llu",
                static_cast<long>(getpid()), nonce, counter.fetch_add(1));
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (comms == nullptr || ndev < 1) return ncclInvalidArgument;
  if (call_fails("init", 0)) return ncclUnhandledCudaError;
  for (int i = 0; i < ndev; ++i) {
    int d = devlist ? devlist[i] : i;
    if (!mgpu::emu::valid_device(d)) return ncclInvalidArgument;
    for (int j = 0; j < i; ++j)
      if ((devlist ? devlist[j] : j) == d) return ncclInvalidUsage;  // one rank per device
  }
  auto clique = std::make_shared<Clique>(ndev);
  clique->joined = ndev;
  for (int i = 0; i < ndev; ++i) {
    comms[i] = new ncclComm;
    comms[i]->clique = clique;
    comms[i]->rank = i;
    comms[i]->device = devlist ? devlist[i] : i;
  }
  return ncclSuccess;
}


ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  if (nranks > kMaxShmRanks) return ncclInvalidArgument;
  if (call_fails("init", rank)) return ncclUnhandledCudaError;
  const std::string key(commId.internal, strnlen(commId.internal, sizeof commId.internal));
  if (key.empty()) return ncclInvalidArgument;
  std::unique_ptr<ShmLink> link;
  bool local = true;
  if (ncclResult_t r = join_segment(key, nranks, rank, &link, &local); r != ncclSuccess) return r;
  if (!local) {
    auto clique = std::make_shared<Clique>(nranks);
    clique->joined = nranks;
    clique->link = std::move(link);
    *comm = new ncclComm;
    (*comm)->clique = clique;
    (*comm)->rank = rank;
    (*comm)->device = mgpu::emu::tls.device;
    return ncclSuccess;
  }
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto& c = registry()[key];
    if (!c) c = std::make_shared<Clique>(nranks);
    if (c->nranks != nranks) return ncclInvalidArgument;
    clique = c;
  }
  {
    // As NCCL's blocking init: every rank waits until all have joined.
    std::unique_lock<std::mutex> lock(clique->mu);
    if (++clique->joined == nranks) {
      clique->cv.notify_all();
      std::lock_guard<std::mutex> reg(g_registry_mu);
      registry().erase(key);
    }
    clique->cv.wait(lock, [&] { return clique->joined >= nranks || clique->aborted; });
  }
  *comm = new ncclComm;
  (*comm)->clique = clique;
  (*comm)->rank = rank;
  (*comm)->device = mgpu::emu::tls.device;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  (void)config;  // blocking in every case: it returns once every rank has joined
  return ncclCommInitRank(comm, nranks, commId, rank);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  return used_after_free(comm, "ncclCommFinalize") ? ncclInvalidUsage : ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  // Work already on streams holds the clique, so it still completes.
  return free_comm(comm, "ncclCommDestroy");
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  if (used_after_free(comm, "ncclCommAbort")) return ncclInvalidUsage;
  {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->clique->aborted = true;
    comm->clique->cv.notify_all();
  }
  // Across processes the other ranks' waits fail too (a real NCCL peer sees a remote error).
  if (comm->clique->link) comm->clique->link->header->aborted.store(1);
  // Freed, as NCCL frees it: a collective it ended fails on its stream; a call on the handle
  // later, or one another thread is still inside, is a use after free (reported).
  return free_comm(comm, "ncclCommAbort");
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (comm == nullptr || asyncError == nullptr) return ncclInvalidArgument;
  if (used_after_free(comm, "ncclCommGetAsyncError")) return ncclInvalidUsage;
  *asyncError = static_cast<ncclResult_t>(comm->clique->async_error.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  if (used_after_free(comm, "ncclCommCount")) return ncclInvalidUsage;
  *count = comm->clique->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  if (used_after_free(comm, "ncclCommUserRank")) return ncclInvalidUsage;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<Op> ops = std::move(t_group_ops);
  t_group_ops.clear();
  ncclResult_t error = t_group_error;
  t_group_error = ncclSuccess;
  if (error != ncclSuccess) return error;  // a failed call in the group: nothing is launched
  // A communicator of the group freed since its call was made is a use after free.
  return issue_ops(ops, "ncclGroupEnd");
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  if ((datatype != ncclFloat && datatype != ncclBfloat16) || op != ncclSum)
    return ncclInvalidArgument;
  return enqueue(Kind::AllReduce, sendbuff, recvbuff, count, elem_size(datatype), 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  if (comm == nullptr) return ncclInvalidArgument;
  if (used_after_free(comm, "ncclBroadcast")) return ncclInvalidUsage;
  if (root < 0 || root >= comm->clique->nranks || elem_size(datatype) == 0)
    return ncclInvalidArgument;
  // Only the root's send buffer is read; the others may pass their receive buffer.
  return enqueue(Kind::Broadcast, comm->rank == root ? sendbuff : recvbuff, recvbuff, count,
                 elem_size(datatype), root, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  if (elem_size(datatype) == 0) return ncclInvalidArgument;
  return enqueue(Kind::AllGather, sendbuff, recvbuff, sendcount, elem_size(datatype), 0, comm,
                 stream);
}
