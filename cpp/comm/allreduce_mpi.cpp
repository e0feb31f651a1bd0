// cpp/comm/allreduce_mpi.cpp -- collectives across processes over MPI (Open MPI on Debian), run
// on the device queues' threads under MPI_THREAD_SERIALIZED: each collective takes a ticket when
// the host enqueues it, so MPI sees one call at a time in host order, the same on every rank.
// Every wait polls nonblocking requests against a deadline: a dead or diverging peer becomes an
// exception naming the rank and the operation, never a hang.
#include "comm/allreduce_mpi.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/collective_counts.h"
#include "core/parallel.h"
#include "core/queue.h"
#include "ops/elementwise.h"

#if MGPU_BUILT_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif
#if MGPU_BUILT_MPI && MGPU_NCCL_WORLD
#include "comm/nccl_bootstrap.h"
#include "core/gpu.h"
#endif

namespace mgpu::comm::dist {
namespace {

struct State {
  std::mutex mutex;  // init / finalize, and taking tickets in enqueue order
  bool initialized = false, use_mpi = false, finalized = false;
  // Written once by init (before any collective), read from any thread.
  std::atomic<int> rank{0}, size{1}, local_rank{0}, local_size{1};
  std::atomic<double> timeout{60.0};
  std::atomic<bool> check{false};
  std::atomic<bool> ordered{true};
  std::atomic<bool> nccl_required{false};  // init(backend="nccl"): GPU tensors on NCCL, always
  uint64_t next_ticket = 1;
  // The turn of collectives (tickets), and the first error that broke the world.
  std::mutex turn_mutex;
  std::condition_variable turn_cv;
  uint64_t serving = 1;
  std::string broken;
#if MGPU_BUILT_MPI
  MPI_Comm comm = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: user MPI traffic stays apart
#endif
};

State& state() {
  static State* s = new State;  // never destroyed: queue threads may use it during exit
  return *s;
}

// One collective as every rank describes it; ranks compare these before the data moves.
struct Call {
  int64_t op = 0, count = 0, dtype = 0, root = -1, seq = 0, tag = 0;
  Device device;
};
constexpr int kFingerprintLen = 6;
constexpr int64_t kMixedDtypes = 99;

#if MGPU_BUILT_MPI  // the collectives that report these run over MPI only
std::string describe(const Call& c) {
  std::ostringstream out;
  switch (static_cast<Op>(c.op)) {
    case Op::Allreduce:
      out << "allreduce of " << c.count << " " << dtype_name(static_cast<DType>(c.dtype));
      break;
    case Op::Broadcast:
      out << "broadcast of " << c.count << " bytes from root " << c.root << ", "
          << (c.dtype == kMixedDtypes ? "mixed dtypes" : dtype_name(static_cast<DType>(c.dtype)));
      break;
    case Op::Barrier: out << "barrier"; break;
    case Op::TrainStep:
      out << "train_batch gradient all-reduce of " << c.count << " "
          << dtype_name(static_cast<DType>(c.dtype)) << " (global batch "
          << (c.tag >> 8) << ", " << (c.tag & 255) << " device(s) per process)";
      break;
    default: out << "unknown collective " << c.op;
  }
  out << " (collective #" << c.seq << ")";
  return out.str();
}
#endif

// Waits for the turn of ticket `seq`; the next ticket's turn comes when this object dies, also
// when the collective failed, so one failure never stalls the collectives queued behind it.
class Turn {
 public:
  explicit Turn(uint64_t seq) : seq_(seq) {
    State& s = state();
    std::unique_lock<std::mutex> lock(s.turn_mutex);
    s.turn_cv.wait(lock, [&] { return s.serving == seq_; });
  }
  ~Turn() {
    State& s = state();
    {
      std::lock_guard<std::mutex> lock(s.turn_mutex);
      s.serving = seq_ + 1;
    }
    s.turn_cv.notify_all();
  }
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  uint64_t seq_;
};

#if MGPU_BUILT_MPI
std::string broken_reason() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.turn_mutex);
  return s.broken;
}

void mark_broken(const std::string& why) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.turn_mutex);
  if (s.broken.empty()) s.broken = why;
}

std::string prefix() { return "mgpu.distributed: rank " + std::to_string(state().rank) + ": "; }
#endif

void validate(const char* op, const std::vector<Tensor>& tensors, bool float_only) {
  MGPU_CHECK_VALUE(!tensors.empty(), op, ": got no tensors; pass a tensor or a list of tensors");
  Device dev = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    MGPU_CHECK_VALUE(t.defined(), op, ": tensor ", i, " is None");
    if (float_only) require_dtype(op, "every tensor", t, DType::F32);
    MGPU_CHECK_VALUE(t.device() == dev, op, ": tensors live on ", dev, " and ", t.device(),
                     "; one call reduces the tensors of one device (sum devices with "
                     "mgpu.allreduce first)");
  }
}

// GPU tensors cross processes through host memory (where no NCCL communicator across ranks
// carries them, see nccl_for_gpus): copied to cpu(0), reduced (or broadcast) there, copied back;
// every copy is ordered by the queues.
template <typename Fn>
bool staged_through_host(const std::vector<Tensor>& tensors, Fn&& collective) {
  if (tensors.empty() || tensors[0].device().is_cpu()) return false;
  std::vector<Tensor> host;
  for (const Tensor& t : tensors) host.push_back(ops::to_device(t, Device{DeviceKind::CPU, 0}));
  collective(host);
  for (size_t i = 0; i < tensors.size(); ++i) ops::copy(tensors[i], host[i]);
  return true;
}

#if MGPU_BUILT_MPI
int64_t total_elements(const std::vector<Tensor>& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += t.numel();
  return n;
}


std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

#define MGPU_MPI_CHECK(call, what)                                                       \
  do {                                                                                   \
    int mgpu_rc_ = (call);                                                               \
    if (mgpu_rc_ != MPI_SUCCESS)                                                         \
      throw ::mgpu::DeviceError(prefix() + (what) + ": " + mpi_error_string(mgpu_rc_)); \
  } while (0)

enum Tag : int { kTagFingerprint = 101, kTagReduce = 102, kTagGather = 103, kTagBroadcast = 104 };

// Scratch memory that a failed exchange may still have handed to MPI: kept for the rest of the
// process rather than freed under a request that might yet complete.
void bury(std::shared_ptr<void> scratch) {
  static std::mutex* m = new std::mutex;
  static auto* graveyard = new std::vector<std::shared_ptr<void>>;
  std::lock_guard<std::mutex> lock(*m);
  graveyard->push_back(std::move(scratch));
}

// A set of point-to-point messages with the peers, completed together under the deadline.
class Exchange {
 public:
  Exchange(const Call& call, const char* phase) : call_(call), phase_(phase) {}
  ~Exchange() { abandon(); }
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  void recv(void* buf, int64_t count, MPI_Datatype type, int from, int tag) {
    check_count(count);
    reqs_.push_back(MPI_REQUEST_NULL);
    MGPU_MPI_CHECK(MPI_Irecv(buf, static_cast<int>(count), type, from, tag, state().comm,
                             &reqs_.back()), std::string("MPI_Irecv in ") + phase_);
    info_.push_back({from, true, count, type});
  }
  void send(const void* buf, int64_t count, MPI_Datatype type, int to, int tag) {
    check_count(count);
    reqs_.push_back(MPI_REQUEST_NULL);
    MGPU_MPI_CHECK(MPI_Isend(buf, static_cast<int>(count), type, to, tag, state().comm,
                             &reqs_.back()), std::string("MPI_Isend in ") + phase_);
    info_.push_back({to, false, count, type});
  }
  // A request the whole world completes together (MPI_Iallreduce); peer -1.
  MPI_Request* collective() {
    reqs_.push_back(MPI_REQUEST_NULL);
    info_.push_back({-1, false, 0, MPI_DATATYPE_NULL});
    return &reqs_.back();
  }
  // Holds scratch buffers alive past a failure (see bury).
  void keep(std::shared_ptr<void> scratch) { scratch_.push_back(std::move(scratch)); }

  // Completes every request, or throws (naming the peers still missing) at the deadline.
  void wait() {
    using clock = std::chrono::steady_clock;
    const size_t n = reqs_.size();
    std::vector<int> index(n);
    std::vector<MPI_Status> status(n);
    std::vector<bool> done(n, false);
    size_t remaining = n;
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                      std::chrono::duration<double>(state().timeout.load()));
    while (remaining > 0) {
      int outcount = 0;
      int rc = MPI_Testsome(static_cast<int>(n), reqs_.data(), &outcount, index.data(),
                            status.data());
      if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) fail(prefix() + phase_ + " of " +
          describe(call_) + " failed: " + mpi_error_string(rc));
      if (outcount == MPI_UNDEFINED) break;
      for (int k = 0; k < outcount; ++k) {
        const size_t i = static_cast<size_t>(index[static_cast<size_t>(k)]);
        const MPI_Status& st = status[static_cast<size_t>(k)];
        done[i] = true;
        --remaining;
        if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS)
          fail(prefix() + phase_ + " of " + describe(call_) + " failed with rank " +
               std::to_string(info_[i].peer) + ": " + mpi_error_string(st.MPI_ERROR) +
               "; the ranks disagree on this collective's size");
        if (info_[i].is_recv) {
          int got = 0;
          MPI_Get_count(&st, info_[i].type, &got);
          if (got != info_[i].count)
            fail(prefix() + "ranks disagree on " + describe(call_) + ": rank " +
                 std::to_string(info_[i].peer) + " sent " + std::to_string(got) +
                 " elements where this rank expects " + std::to_string(info_[i].count) +
                 " (different sizes on different ranks)");
        }
      }
      if (remaining == 0) break;
      const auto now = clock::now();
      if (now > deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < n; ++i)
          if (!done[i] && std::find(missing.begin(), missing.end(), info_[i].peer) == missing.end())
            missing.push_back(info_[i].peer);
        std::sort(missing.begin(), missing.end());
        std::ostringstream who;
        if (missing.size() == 1 && missing[0] < 0) {
          who << "not every rank joined";
        } else {
          who << "still waiting for rank" << (missing.size() > 1 ? "s " : " ");
          for (size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << missing[i];
        }
        fail(prefix() + "timed out after " + format_seconds(state().timeout.load()) + " in " +
             phase_ + " of " + describe(call_) + " on " + call_.device.str() + ": " + who.str() +
             ". A rank has died or hangs, or the ranks called different collectives "
             "(MGPU_DIST_CHECK=1 compares every collective first; MGPU_DIST_TIMEOUT=seconds "
             "sets this limit)");
      }
      // Open MPI progresses messages only inside MPI calls, so poll hot while a reply is
      // likely soon, then yield the core, then back off to sleeping (a long wait is a slow peer).
      const auto waited = now - start;
      if (waited > std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      else if (waited > std::chrono::milliseconds(1))
        sched_yield();
    }
    reqs_.clear();
    info_.clear();
    scratch_.clear();
  }

 private:
  struct Info {
    int peer;
    bool is_recv;
    int64_t count;
    MPI_Datatype type;
  };

  static std::string format_seconds(double s) {
    std::ostringstream out;
    out << s << " s";
    return out.str();
  }
  void check_count(int64_t count) {
    if (count > INT_MAX)
      throw ValueError(prefix() + describe(call_) + " moves " + std::to_string(count) +
                       " elements in one message; MPI counts stop at 2^31 - 1: split the tensor");
  }
  [[noreturn]] void fail(const std::string& why) {
    mark_broken(why);
    throw DeviceError(why);
  }
  // Cancels what is still pending and keeps its buffers; the world is broken by then.
  void abandon() {
    bool pending = false;
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      pending = true;
      if (info_[i].is_recv) MPI_Cancel(&reqs_[i]);
      MPI_Request_free(&reqs_[i]);
    }
    if (pending)
      for (auto& s : scratch_) bury(std::move(s));
  }

  Call call_;
  const char* phase_;
  std::vector<MPI_Request> reqs_;
  std::vector<Info> info_;
  std::vector<std::shared_ptr<void>> scratch_;
};

template <typename T>
std::shared_ptr<std::vector<T>> scratch(int64_t n) {
  return std::make_shared<std::vector<T>>(static_cast<size_t>(n));
}

// Two reusable, uninitialised buffers for packing and receiving. Collectives run one at a time
// (tickets), so two suffice; they grow to the largest collective and stay, which spares a large
// all-reduce the page faults of fresh memory on every call. Used only by the turn's holder.
template <typename T>
T* reusable(int which, int64_t n, Exchange& ex) {
  static std::shared_ptr<char[]> mem[2];
  static size_t size[2] = {0, 0};
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  if (size[which] < bytes) {
    mem[which].reset(new char[bytes]);
    size[which] = bytes;
  }
  ex.keep(mem[which]);
  return reinterpret_cast<T*>(mem[which].get());
}

// The tensors' bytes as one flat buffer: the tensor's own memory when there is one tensor (no
// copies), else packed into a reusable buffer. `unpack` copies results back.
template <typename T>
T* flat_view(const std::vector<Tensor>& tensors, int64_t n, Exchange& ex) {
  if (tensors.size() == 1) {
    ex.keep(tensors[0].storage());
    return static_cast<T*>(tensors[0].raw());
  }
  T* flat = reusable<T>(0, n, ex);
  char* at = reinterpret_cast<char*>(flat);
  for (const Tensor& t : tensors) {
    std::memcpy(at, t.raw(), t.nbytes());
    at += t.nbytes();
  }
  return flat;
}

void unpack(const std::vector<Tensor>& tensors, const void* flat) {
  if (tensors.size() == 1) return;
  const char* at = static_cast<const char*>(flat);
  for (const Tensor& t : tensors) {
    std::memcpy(t.raw(), at, t.nbytes());
    at += t.nbytes();
  }
}

// Every rank sends its fingerprint to every other; all ranks then hold the same table, so on a
// mismatch all of them raise the same error together and nobody is left waiting. Also a barrier.
void compare_fingerprints(const Call& call) {
  State& s = state();
  const int64_t mine[kFingerprintLen] = {call.op, call.count, call.dtype, call.root, call.seq,
                                         call.tag};
  auto table = scratch<int64_t>(int64_t{kFingerprintLen} * s.size);
  std::copy(mine, mine + kFingerprintLen, table->data() + kFingerprintLen * s.rank);
  Exchange ex(call, "the fingerprint check");
  ex.keep(table);
  for (int p = 0; p < s.size; ++p) {
    if (p == s.rank) continue;
    ex.recv(table->data() + kFingerprintLen * p, kFingerprintLen, MPI_INT64_T, p,
            kTagFingerprint);
    ex.send(mine, kFingerprintLen, MPI_INT64_T, p, kTagFingerprint);
  }
  ex.wait();
  auto row = [&](int p) {
    const int64_t* f = table->data() + kFingerprintLen * p;
    Call c;
    c.op = f[0], c.count = f[1], c.dtype = f[2], c.root = f[3], c.seq = f[4], c.tag = f[5];
    return c;
  };
  auto key = [&](int p) {
    const int64_t* f = table->data() + kFingerprintLen * p;
    return std::vector<int64_t>(f, f + kFingerprintLen);
  };
  bool same = true;
  for (int p = 1; p < s.size; ++p) same = same && key(p) == key(0);
  if (same) return;
  // Group the ranks by what they called: "ranks 0, 2 call X; rank 1 calls Y".
  std::map<std::vector<int64_t>, std::vector<int>> groups;
  for (int p = 0; p < s.size; ++p) groups[key(p)].push_back(p);
  std::ostringstream out;
  out << prefix() << "the ranks called different collectives: ";
  bool first = true;
  for (auto& [k, ranks] : groups) {
    out << (first ? "" : "; ") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
    out << " called " << describe(row(ranks[0]));
    first = false;
  }
  out << ". Every rank must make the same collectives with the same sizes and dtypes, in the "
         "same order";
  throw DeviceError(out.str());  // every rank raises this at once: the world stays usable
}

// Rank-ordered sum: reduce-scatter (rank j sums chunk j of every rank's buffer, in rank order),
// then all-gather. Each rank sends and receives 2(W-1)/W of the buffer, the optimum.
void allreduce_ordered(float* flat, int64_t n, Exchange& reduce, Exchange& gather) {
  State& s = state();
  const int W = s.size, me = s.rank;
  auto begin = [&](int j) { return n * j / W; };
  const int64_t b = begin(me), len = begin(me + 1) - b;
  float* slots = reusable<float>(1, len * W, reduce);
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    reduce.recv(slots + len * p, len, MPI_FLOAT, p, kTagReduce);
    reduce.send(flat + begin(p), begin(p + 1) - begin(p), MPI_FLOAT, p, kTagReduce);
  }
  reduce.wait();
  // Element i gets ((x0 + x1) + x2) + ..., the order of the in-process all-reduce; my own
  // chunk stays in place, so rank 0 adds into it directly, others first swap in slot 0's.
  float* acc = flat + b;
  if (me != 0) {
    std::memcpy(slots + len * me, acc, static_cast<size_t>(len) * sizeof(float));
    std::memcpy(acc, slots, static_cast<size_t>(len) * sizeof(float));
  }
  for (int p = 1; p < W; ++p) {
    const float* x = slots + len * p;
    for (int64_t i = 0; i < len; ++i) acc[i] += x[i];
  }
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    gather.recv(flat + begin(p), begin(p + 1) - begin(p), MPI_FLOAT, p, kTagGather);
    gather.send(acc, len, MPI_FLOAT, p, kTagGather);
  }
  gather.wait();
}

// allreduce_ordered in bfloat16 (allreduce_mpi.h's wire BF16): the bfloat16 bits travel as
// MPI_UINT16_T (MPI has no bfloat16 type), each rank's own values rounded before they leave,
// each sum added in float32 in rank order from the widened values and rounded once, and the
// all-gather carries those rounded sums; flat ends with them widened.
void allreduce_ordered_bf16(float* flat, int64_t n, Exchange& reduce, Exchange& gather) {
  State& s = state();
  const int W = s.size, me = s.rank;
  auto begin = [&](int j) { return n * j / W; };
  const int64_t b = begin(me), len = begin(me + 1) - b;
  BFloat16* half = reusable<BFloat16>(1, n + len * W, reduce);
  BFloat16* slots = half + n;
  for (int64_t i = 0; i < n; ++i) half[i] = BFloat16(flat[i]);
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    reduce.recv(slots + len * p, len, MPI_UINT16_T, p, kTagReduce);
    reduce.send(half + begin(p), begin(p + 1) - begin(p), MPI_UINT16_T, p, kTagReduce);
  }
  reduce.wait();
  std::memcpy(slots + len * me, half + b, static_cast<size_t>(len) * sizeof(BFloat16));
  for (int64_t i = 0; i < len; ++i) {
    float acc = static_cast<float>(slots[i]);
    for (int p = 1; p < W; ++p) acc += static_cast<float>(slots[len * p + i]);
    half[b + i] = BFloat16(acc);
  }
  reusable<BFloat16>(1, n + len * W, gather);  // the same buffer, kept by the gather's requests
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    gather.recv(half + begin(p), begin(p + 1) - begin(p), MPI_UINT16_T, p, kTagGather);
    gather.send(half + b, len, MPI_UINT16_T, p, kTagGather);
  }
  gather.wait();
  for (int64_t i = 0; i < n; ++i) flat[i] = static_cast<float>(half[i]);
}

// MPI_Iallreduce's sum of bfloat16 bits (the "mpi" algorithm): inout = bf16(in + inout), the two
// widened and added in float32, so every partial sum of the library's order is rounded.
void sum_bf16_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const BFloat16* a = static_cast<const BFloat16*>(in);
  BFloat16* b = static_cast<BFloat16*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = BFloat16(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

void run_allreduce(const Call& call, const std::vector<Tensor>& tensors) {
  const int64_t n = call.count;
  Exchange reduce(call, "the reduce-scatter"), gather(call, "the all-gather");
  float* flat = flat_view<float>(tensors, n, reduce);
  gather.keep(tensors[0].storage());
  const bool bf16 = call.dtype == static_cast<int64_t>(DType::BF16);
  if (state().ordered.load()) {
    (bf16 ? allreduce_ordered_bf16 : allreduce_ordered)(flat, n, reduce, gather);
  } else if (n > INT_MAX) {
    throw ValueError(prefix() + describe(call) + ": more than 2^31 - 1 elements");
  } else if (bf16) {
    static MPI_Op op = MPI_OP_NULL;  // made once, under the collective's turn
    if (op == MPI_OP_NULL) MGPU_MPI_CHECK(MPI_Op_create(sum_bf16_op, 1, &op), "MPI_Op_create");
    BFloat16* half = reusable<BFloat16>(1, n, reduce);
    for (int64_t i = 0; i < n; ++i) half[i] = BFloat16(flat[i]);
    MGPU_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, half, static_cast<int>(n), MPI_UINT16_T, op,
                                  state().comm, reduce.collective()), "MPI_Iallreduce");
    reduce.wait();
    for (int64_t i = 0; i < n; ++i) flat[i] = static_cast<float>(half[i]);
  } else {
    MGPU_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, flat, static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                                  state().comm, reduce.collective()), "MPI_Iallreduce");
    reduce.wait();
  }
  unpack(tensors, flat);
}

void run_broadcast(const Call& call, const std::vector<Tensor>& tensors) {
  State& s = state();
  Exchange ex(call, "the transfer");
  char* bytes = flat_view<char>(tensors, call.count, ex);  // packed on every rank: cheap
  // The tag carries the dtype: ranks that disagree on it (the same byte count of int32 and
  // float32, say) never match, so the receiver fails at the timeout instead of reinterpreting
  // bytes (with MGPU_DIST_CHECK=1 the fingerprints catch it at once).
  const int tag = kTagBroadcast + 16 * static_cast<int>(call.dtype + 1);
  if (s.rank == call.root) {
    for (int p = 0; p < s.size; ++p)
      if (p != s.rank) ex.send(bytes, call.count, MPI_BYTE, p, tag);
  } else {
    ex.recv(bytes, call.count, MPI_BYTE, static_cast<int>(call.root), tag);
  }
  ex.wait();
  if (s.rank != call.root) unpack(tensors, bytes);
}

// Enqueues one collective on `device`, numbered in host order (see the top of this file).
template <typename Body>
void enqueue_collective(const char* name, Call call, std::vector<Tensor> keep, Body body) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  MGPU_CHECK_VALUE(!s.finalized, name, ": mgpu.distributed.finalize() was called already");
  call.seq = static_cast<int64_t>(s.next_ticket++);
  queue_of(call.device).enqueue(name, [call, keep = std::move(keep), body]() {
    Turn turn(static_cast<uint64_t>(call.seq));
    std::string broken = broken_reason();
    if (!broken.empty())
      throw DeviceError(prefix() + describe(call) + " cannot run: an earlier collective failed "
                        "and the ranks are out of step (" + broken + ")");
    if (call.op == static_cast<int64_t>(Op::Barrier) || state().check.load())
      compare_fingerprints(call);
    body(call, keep);
  });
}

#if MGPU_NCCL_WORLD
// GPU tensors across processes on an NCCL communicator over every rank (one GPU per rank), made
// at the first such all-reduce: its unique id is broadcast over MPI inside the collective's turn,
// so MPI still sees one call at a time. MGPU_DIST_GPU=host stages through host memory instead,
// unless init(backend="nccl") asked for NCCL.
bool nccl_for_gpus() {
  if (state().nccl_required.load()) return true;
  const char* v = std::getenv("MGPU_DIST_GPU");
  if (v == nullptr || *v == '\0' || std::string(v) == "nccl") return true;
  MGPU_CHECK_VALUE(std::string(v) == "host", "MGPU_DIST_GPU must be 'nccl' or 'host', got '", v,
                   "'");
  return false;
}

// The communicator, made once by the first GPU all-reduce (under its turn) and ended by
// finalize(); never freed (a queue thread could still be inside a call on it at exit).
NcclWorld*& nccl_world_ptr() {
  static NcclWorld* world = nullptr;
  return world;
}

NcclWorld& nccl_world(int gpu) {
  NcclWorld*& world = nccl_world_ptr();
  if (world == nullptr) world = new NcclWorld(state().comm, gpu, state().timeout.load());
  MGPU_CHECK_VALUE(world->gpu() == gpu, prefix(), "the NCCL communicator across ranks is on gpu(",
                   world->gpu(), "); this all-reduce is on gpu(", gpu, "): one GPU per rank");
  return *world;
}

// On the device's queue, under the collective's turn: an in-place NCCL sum of each tensor on the
// device's compute stream (after the work that made them), waited for under the timeout. A
// failure (the communicator is aborted by then) breaks the world: the ranks are out of step.
// In bfloat16 (call.dtype) the last tensor is a bfloat16 scratch as long as the largest: each
// tensor is rounded into it (dtype.h's rounding, ops::cuda::convert), summed as ncclBfloat16 and
// widened back, all on the compute stream.
void run_nccl_allreduce(const Call& call, const std::vector<Tensor>& tensors) {
  try {
    NcclWorld& world = nccl_world(call.device.index);
    cudaStream_t stream = gpu::compute_stream(call.device.index);
    if (call.dtype == static_cast<int64_t>(DType::BF16)) {
      BFloat16* half = tensors.back().data<BFloat16>();
      for (size_t i = 0; i + 1 < tensors.size(); ++i) {
        const Tensor& t = tensors[i];
        ops::cuda::convert(t.numel(), t.f32(), half, stream);
        world.allreduce_sum(half, static_cast<size_t>(t.numel()), stream, true);
        ops::cuda::convert(t.numel(), half, t.f32(), stream);
      }
      return;
    }
    for (const Tensor& t : tensors)
      world.allreduce_sum(t.f32(), static_cast<size_t>(t.numel()), stream);
  } catch (const DeviceError& e) {
    mark_broken(e.what());
    throw DeviceError(prefix() + describe(call) + " over NCCL failed: " + e.what());
  }
}

// finalize(): every rank ends the communicator (finalize, then destroy), or with `ok` false
// (another failure: the ranks may not all be there) aborts it at once. True when it ended cleanly.
bool close_nccl_world(bool ok) {
  NcclWorld* world = nccl_world_ptr();
  if (world == nullptr) return ok;
  if (ok) return world->close().empty();
  world->abort();
  return false;
}
#endif

#endif  // MGPU_BUILT_MPI

// True when collectives must reach other processes; raises once the world has been finalized.
bool multi_process(const char* op) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  bool multi = s.initialized && s.use_mpi && s.size > 1;
  // Also in a one-process world: a program that collects after finalize is wrong at any size.
  MGPU_CHECK_VALUE(!s.finalized, op, ": mgpu.distributed.finalize() was called already; no "
                   "collective can run after it");
  return multi;
}

}  // namespace

bool built() { return MGPU_BUILT_MPI != 0; }

bool nccl_world_built() { return MGPU_BUILT_MPI && MGPU_NCCL_WORLD; }

std::string gpu_transport() {
#if MGPU_BUILT_MPI && MGPU_NCCL_WORLD
  if (nccl_for_gpus()) return "nccl";
#endif
  return "host";
}

bool launched() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(var)) return true;
  return false;
}

void init(bool use_mpi, bool nccl) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (nccl && !(use_mpi && nccl_world_built()))
    throw DeviceError("mgpu.distributed.init: NCCL across processes needs MPI and this build's "
                      "NCCL world (build_info()['dist_gpu_transport'])");
  if (s.initialized) {
    MGPU_CHECK_VALUE(s.use_mpi == use_mpi && s.nccl_required.load() == nccl,
                     "mgpu.distributed.init: already initialised ",
                     !s.use_mpi ? "as a single process"
                     : s.nccl_required.load() ? "over MPI with NCCL for GPU tensors"
                                              : "over MPI", "; call init once");
    MGPU_CHECK_VALUE(!s.finalized, "mgpu.distributed.init: the world was finalized already; MPI "
                     "cannot start twice in one process");
    return;
  }
  if (!use_mpi) {
    s.initialized = true;
    return;
  }
#if MGPU_BUILT_MPI
  int already = 0, provided = 0;
  MPI_Initialized(&already);
  if (!already) {
    MGPU_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
                   "MPI_Init_thread");
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED)
    throw DeviceError("mgpu.distributed.init: this MPI gives thread level " +
                      std::to_string(provided) + ", but mgpu calls MPI from its device threads "
                      "(one at a time) and needs MPI_THREAD_SERIALIZED or better");
  MGPU_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s.comm), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN);
  int r = 0, n = 1, lr = 0, ln = 1;
  MPI_Comm_rank(s.comm, &r);
  MPI_Comm_size(s.comm, &n);
  MPI_Comm node = MPI_COMM_NULL;
  MGPU_MPI_CHECK(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &node),
                 "MPI_Comm_split_type");
  MPI_Comm_rank(node, &lr);
  MPI_Comm_size(node, &ln);
  MPI_Comm_free(&node);
  s.rank = r, s.size = n, s.local_rank = lr, s.local_size = ln;
  s.use_mpi = true;
  s.nccl_required.store(nccl);
  s.initialized = true;
  if (!std::getenv("MGPU_NUM_THREADS")) {
    // Each process gets its share of the cores: the launcher's binding if it bound us to fewer
    // cores than the machine has, else cores / (processes on this machine).
    cpu_set_t set;
    int mine = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    set_num_threads(mine < all ? mine : std::max(1, all / s.local_size));
  }
#else
  throw DeviceError("mgpu.distributed.init: this build has no MPI back end; install Open MPI "
                    "(apt-get install openmpi-bin libopenmpi-dev) and reinstall mgpu");
#endif
}

bool initialized() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().initialized;
}
bool uses_mpi() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().use_mpi;
}
bool finalized() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().finalized;
}
int rank() { return state().rank; }
int world_size() { return state().size; }
int local_rank() { return state().local_rank; }
int local_size() { return state().local_size; }

void set_timeout(double seconds) {
  MGPU_CHECK_VALUE(seconds > 0, "mgpu.distributed: the timeout must be > 0 seconds, got ",
                   seconds);
  state().timeout.store(seconds);
}
double timeout() { return state().timeout.load(); }
void set_check(bool on) { state().check.store(on); }
bool check() { return state().check.load(); }
void set_algorithm(const std::string& name) {
  MGPU_CHECK_VALUE(name == "ordered" || name == "mpi", "mgpu.distributed: unknown all-reduce "
                   "algorithm '", name, "'; use 'ordered' or 'mpi'");
  state().ordered.store(name == "ordered");
}
std::string algorithm() { return state().ordered.load() ? "ordered" : "mpi"; }

void allreduce(const std::vector<Tensor>& tensors, Op op, int64_t tag, DType wire) {
  validate("allreduce", tensors, true);
  MGPU_ASSERT(wire == DType::F32 || wire == DType::BF16, "allreduce: wire dtype ",
              dtype_name(wire));
  if (!multi_process("allreduce")) return;  // the sum over one process is its own value
#if MGPU_BUILT_MPI
  // The call every rank describes, whichever transport carries it.
  const auto describe = [&] {
    Call call;
    call.op = static_cast<int64_t>(op);
    call.count = total_elements(tensors);
    call.dtype = static_cast<int64_t>(wire);
    call.tag = tag;
    call.device = tensors[0].device();
    return call;
  };
#endif
#if MGPU_BUILT_MPI && MGPU_NCCL_WORLD
  if (!tensors[0].device().is_cpu() && nccl_for_gpus()) {
    std::vector<Tensor> with_scratch = tensors;  // bfloat16: run_nccl_allreduce's scratch last
    if (wire == DType::BF16) {
      int64_t largest = 0;
      for (const Tensor& t : tensors) largest = std::max(largest, t.numel());
      with_scratch.push_back(Tensor::empty({largest}, DType::BF16, tensors[0].device(),
                                           "distributed.allreduce"));
    }
    enqueue_collective("distributed.allreduce (NCCL)", describe(), with_scratch,
                       run_nccl_allreduce);
    return;
  }
#endif
  if (staged_through_host(tensors,
                          [&](const std::vector<Tensor>& h) { allreduce(h, op, tag, wire); }))
    return;
#if MGPU_BUILT_MPI
  enqueue_collective("distributed.allreduce", describe(), tensors,
                     [](const Call& c, const std::vector<Tensor>& ts) { run_allreduce(c, ts); });
#endif
  (void)op, (void)tag, (void)wire;
}

void broadcast(const std::vector<Tensor>& tensors, int root) {
  validate("broadcast", tensors, false);
  const int size = multi_process("broadcast") ? world_size() : 1;
  MGPU_CHECK_INDEX(root >= 0 && root < size, "broadcast: root ", root, " is not a rank; the "
                   "world has ", size, " process", size == 1 ? "" : "es");
  if (size == 1) return;
  if (staged_through_host(tensors, [&](const std::vector<Tensor>& h) { broadcast(h, root); }))
    return;  // counted by the call on the host copies
  int64_t bytes = 0;
  for (const Tensor& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
  count_collective(bytes);
#if MGPU_BUILT_MPI
  Call call;
  call.op = static_cast<int64_t>(Op::Broadcast);
  call.root = root;
  call.device = tensors[0].device();
  call.dtype = static_cast<int64_t>(tensors[0].dtype());
  for (const Tensor& t : tensors) {
    call.count += static_cast<int64_t>(t.nbytes());
    if (t.dtype() != tensors[0].dtype()) call.dtype = kMixedDtypes;
  }
  enqueue_collective("distributed.broadcast", call, tensors,
                     [](const Call& c, const std::vector<Tensor>& ts) { run_broadcast(c, ts); });
#endif
}

void barrier(Device device) {
  check_device(device);
  if (multi_process("barrier")) {
#if MGPU_BUILT_MPI
    Call call;
    call.op = static_cast<int64_t>(Op::Barrier);
    call.device = device;
    enqueue_collective("distributed.barrier", call, {},
                       [](const Call&, const std::vector<Tensor>&) {});
#endif
  }
  queue_of(device).synchronize();
}

void finalize(bool abort) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.initialized || s.finalized) return;
    if (!s.use_mpi) {
      s.finalized = true;
      return;
    }
  }
#if MGPU_BUILT_MPI
  if (abort && s.size > 1) MPI_Abort(MPI_COMM_WORLD, 1);  // ends every rank; does not return
  try {
    waitall();
  } catch (...) {
    // Already raised where it happened (or about to be); finalizing must go on regardless.
  }
  bool ok = broken_reason().empty();
  if (ok && s.size > 1) {
    try {
      uint64_t seq;
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        seq = s.next_ticket++;
      }
      Turn turn(seq);
      Call call;
      call.op = static_cast<int64_t>(Op::Barrier);
      call.seq = static_cast<int64_t>(seq);
      call.device = Device{};
      compare_fingerprints(call);
    } catch (...) {
      ok = false;
    }
  }
#if MGPU_NCCL_WORLD
  // Every rank got here (the barrier above): the NCCL communicator ends before MPI does.
  // Finalizing it waits for every rank's; after a failure it is aborted instead.
  ok = close_nccl_world(ok);
#endif
  std::lock_guard<std::mutex> lock(s.mutex);
  s.finalized = true;
  if (!ok) return;  // exiting without MPI_Finalize: the launcher ends the job, nothing hangs
  MPI_Comm_free(&s.comm);
  MPI_Finalize();
#else
  (void)abort;
#endif
}

}  // namespace mgpu::comm::dist
