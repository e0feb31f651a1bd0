// cpp/comm/allreduce_gpu.cpp -- all-reduce across the GPUs of one process (allreduce.h's contract):
// each GPU's queue runs its part, the parts meet at barriers. By default one grouped
// ncclAllReduce on the communication streams over a packed flat buffer: real NCCL in a CUDA build
// with NCCL, the emulator's NCCL (cpp/cuda/emu/nccl_emu.h) in the emulated build. Its communicators
// are aborted and rebuilt after a failure: an asynchronous NCCL error, or a collective that does
// not finish within MGPU_NCCL_TIMEOUT_S seconds (a watchdog thread aborts it), raises DeviceError.
// Otherwise (no NCCL, MGPU_ALLREDUCE=peer): reduce-scatter + all-gather over peer copies,
// chunks summed in device order 0..k-1, so the sums are bitwise those of cpu(0..k-1) (in
// bfloat16 too: allreduce.h's wire).
#include "comm/allreduce_gpu.h"

#if MGPU_GPU_BUILD

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/barrier.h"
#include "core/gpu.h"
#include "ops/elementwise.h"
#define MGPU_CUDA_ERROR_TYPE ::mgpu::DeviceError
#include "cuda/runtime.cuh"

#if MGPU_BUILT_NCCL && !MGPU_CUDA_EMULATION_BUILD
#define MGPU_ALLREDUCE_NCCL 1
#include <nccl.h>
#elif MGPU_CUDA_EMULATION_BUILD
#define MGPU_ALLREDUCE_NCCL 1
#include "cuda/emu/nccl_emu.h"
#else
#define MGPU_ALLREDUCE_NCCL 0
#endif

namespace mgpu::comm {
namespace {

bool use_nccl() {
  if (!MGPU_ALLREDUCE_NCCL) return false;
  const char* v = std::getenv("MGPU_ALLREDUCE");
  return !(v && std::string(v) == "peer");
}

// MGPU_NCCL_TIMEOUT_S: how long an in-process NCCL collective may take (default 300 s), and how
// long a device's part of any in-process GPU all-reduce waits for the other devices' parts.
double nccl_timeout_s() {
  const char* v = std::getenv("MGPU_NCCL_TIMEOUT_S");
  if (v == nullptr || *v == '\0') return 300.0;
  char* end = nullptr;
  double t = std::strtod(v, &end);
  if (*end != '\0' || !(t > 0))
    throw ValueError(std::string("MGPU_NCCL_TIMEOUT_S must be a positive number of seconds, got '") +
                     v + "'");
  return t;
}

std::string gpu_list(const std::vector<int>& gpus) {
  std::string s;
  for (int g : gpus) s += (s.empty() ? "gpu(" : ", gpu(") + std::to_string(g) + ")";
  return s;
}

#if MGPU_ALLREDUCE_NCCL
void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) {
    throw DeviceError(std::string("allreduce: ") + call + " failed: " + ncclGetErrorString(r));
  }
}

// An NCCL group on this thread, ended when it goes out of scope, a throw included: a group left
// open (an ncclAllReduce that failed between start and end) would hold back every later
// collective of this thread, which then never launches and hangs.
class NcclGroup {
 public:
  NcclGroup() { nccl_check(ncclGroupStart(), "ncclGroupStart"); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();  // unwinding: the first error is the one reported
  }
  void end() {
    open_ = false;
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

// One communicator per GPU for a set of devices, made by ncclCommInitAll. A set lives while the
// cache or a collective holds it: the cache keeps the kMaxCachedSets most recently used sets
// (each holds GPU memory outside mgpu's allocator statistics), empty_communicators() drops the
// idle ones, and a set that fails is aborted and dropped at once; the next all-reduce on its
// devices makes a new set. A set nobody holds is destroyed (ncclCommDestroy) unless it was
// aborted, which already freed it.
//
// Launch and abort never overlap: real NCCL frees a communicator in ncclCommAbort, so a launch
// racing the watchdog's abort would use freed memory. A launch starts only on a set not yet
// retired, and a retire waits for the launch in progress to return before it aborts.
struct Communicators {
  std::vector<int> gpus;
  std::vector<ncclComm_t> comms;
  std::mutex calls;  // ncclCommAbort, ncclCommGetAsyncError and launches never race each other
  std::condition_variable launch_done;
  bool launching = false;  // a launch is in progress (guarded by `calls`)
  std::atomic<bool> broken{false};
  std::atomic<bool> timed_out{false};
  std::string why;   // the first failure, set once under `calls` before `broken`
  Communicators() { live_sets().fetch_add(1); }
  ~Communicators();
  Communicators(const Communicators&) = delete;
  Communicators& operator=(const Communicators&) = delete;
  static std::atomic<int>& live_sets() {
    static std::atomic<int> n{0};
    return n;
  }
};

Communicators::~Communicators() {
  live_sets().fetch_sub(1);
  if (broken.load()) return;  // ncclCommAbort freed them
  // Several communicators of one thread are destroyed in a group: each one's finalisation waits
  // for the others' (intra-node teardown is collective). Not alongside a cudaFree or a grouped
  // launch on the same devices (gpu::device_wide_mutex).
  std::lock_guard<std::mutex> lock(gpu::device_wide_mutex());
  if (ncclGroupStart() != ncclSuccess) return;
  for (ncclComm_t comm : comms)
    if (comm) ncclCommDestroy(comm);  // a failure leaves the communicator to the driver at exit
  ncclGroupEnd();
}

// How many sets of communicators the cache keeps: a training run uses one device set, a sweep
// over subsets (benchmarks, tests) a few at a time.
constexpr size_t kMaxCachedSets = 4;

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
// Most recently used first.
std::list<std::shared_ptr<Communicators>>& cache() {
  static auto* c = new std::list<std::shared_ptr<Communicators>>;
  return *c;
}

std::shared_ptr<Communicators> communicators(const std::vector<int>& gpus) {
  std::shared_ptr<Communicators> evicted;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& c = cache();
  for (auto it = c.begin(); it != c.end(); ++it) {
    if ((*it)->gpus == gpus) {
      c.splice(c.begin(), c, it);
      return c.front();
    }
  }
  auto made = std::make_shared<Communicators>();
  made->gpus = gpus;
  made->comms.resize(gpus.size());
  nccl_check(ncclCommInitAll(made->comms.data(), static_cast<int>(gpus.size()), gpus.data()),
             "ncclCommInitAll");
  c.push_front(made);
  if (c.size() > kMaxCachedSets) {
    evicted = std::move(c.back());
    c.pop_back();
  }
  return made;
}

// Aborts a failed set of communicators (once) and drops it from the cache: a communicator whose
// collective failed or hangs cannot be trusted with the next one, and ncclCommAbort is what
// ends a collective that never finishes. A launch in progress on the set is waited for first
// (no new one starts once `broken` is set); only a launch that itself hangs past the collective
// timeout is aborted under it, as the last way out (a host call that never returns).
void retire(Communicators& c, const std::string& why, double launch_grace_s) {
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    auto& list = cache();
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->get() == &c) {
        list.erase(it);  // the caller holds the set, so it is not destroyed here
        break;
      }
    }
  }
  std::unique_lock<std::mutex> lock(c.calls);
  if (c.broken.load()) return;
  c.why = why;
  c.broken.store(true);
  c.launch_done.wait_for(lock, std::chrono::duration<double>(launch_grace_s),
                         [&] { return !c.launching; });
  for (ncclComm_t comm : c.comms) ncclCommAbort(comm);
}

// Runs `launch` (NCCL calls on the set) unless the set is retired; returns whether it ran. A
// retire meanwhile waits for it to return (see retire).
template <typename Fn>
bool launch_unless_retired(Communicators& c, Fn&& launch) {
  {
    std::lock_guard<std::mutex> lock(c.calls);
    if (c.broken.load()) return false;
    c.launching = true;
  }
  struct Done {
    Communicators& c;
    ~Done() {
      std::lock_guard<std::mutex> lock(c.calls);
      c.launching = false;
      c.launch_done.notify_all();
    }
  } done{c};
  launch();
  return true;
}

// The first asynchronous error of the set's communicators, or ncclSuccess.
ncclResult_t async_error(Communicators& c) {
  std::lock_guard<std::mutex> lock(c.calls);
  if (c.broken.load()) return ncclSuccess;
  for (ncclComm_t comm : c.comms) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclSuccess && state != ncclInProgress) return state;
  }
  return ncclSuccess;
}

// For tests: NCCL launches that failed (a launch on an aborted communicator is one), and a
// pause before every launch (0: none) that lets a test land the watchdog's abort inside it.
std::atomic<int64_t>& refused_launches() {
  static std::atomic<int64_t> n{0};
  return n;
}
std::atomic<double>& launch_pause_s() {
  static std::atomic<double> s{0.0};
  return s;
}

// A thread that aborts the communicators of a collective still armed past its deadline. The
// waits it ends are on the devices (a rank that never arrives hangs every rank's stream), so no
// host thread that waits on them can time them out itself.
class Watchdog {
 public:
  static Watchdog& get() {
    static Watchdog* w = new Watchdog;  // never destroyed: armed workers may outlive main
    return *w;
  }
  uint64_t arm(const std::shared_ptr<Communicators>& c, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
    const uint64_t id = next_++;
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(seconds));
    armed_[id] = Entry{deadline, c, seconds};
    cv_.notify_all();
    return id;
  }
  void disarm(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_.erase(id);
  }

 private:
  struct Entry {
    std::chrono::steady_clock::time_point deadline;
    std::weak_ptr<Communicators> comms;
    double seconds;
  };
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (armed_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto first = std::min_element(armed_.begin(), armed_.end(), [](const auto& x, const auto& y) {
        return x.second.deadline < y.second.deadline;
      });
      if (std::chrono::steady_clock::now() < first->second.deadline) {
        cv_.wait_until(lock, first->second.deadline);
        continue;
      }
      Entry e = first->second;
      armed_.erase(first);
      lock.unlock();
      if (auto c = e.comms.lock()) {
        c->timed_out.store(true);
        retire(*c, "an NCCL collective on " + gpu_list(c->gpus) + " did not finish within " +
                       std::to_string(e.seconds) + " s (MGPU_NCCL_TIMEOUT_S): a device never "
                       "joined it, or hangs", e.seconds);
      }
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> armed_;
  uint64_t next_ = 0;
  bool started_ = false;
};

// Armed for the life of one device's part of a collective.
class Armed {
 public:
  Armed(const std::shared_ptr<Communicators>& c, double seconds)
      : id_(Watchdog::get().arm(c, seconds)) {}
  ~Armed() { Watchdog::get().disarm(id_); }
  Armed(const Armed&) = delete;
  Armed& operator=(const Armed&) = delete;

 private:
  uint64_t id_;
};
#endif

}  // namespace

struct GpuCollective {
  std::vector<int> gpu;                  // gpu[d]: the CUDA index of entry d
  std::vector<Tensor> flat;              // flat[d]: entry d packed, `total` values on gpu[d]
  DType wire = DType::F32;               // flat's dtype: F32, or BF16
  std::vector<Tensor> scratch;           // per device, the peer path's chunks (run_peer*)
  int64_t total = 0;
  bool nccl = false;
  // NCCL only: where the result is left (allreduce_gpu.h). kOnComm: unpacked on the
  // communication stream; a later collective's end or join_compute(), which makes the compute
  // stream wait for that stream, covers it.
  Finish finish = Finish::kWait;
  std::shared_ptr<GpuCollective> earlier;  // kept alive until this one has made compute wait
  Barrier barrier;
  std::vector<std::vector<Tensor>> data;  // data[d]: set when device d joins (kept alive)
  explicit GpuCollective(int k) : barrier(k), data(static_cast<size_t>(k)) {}

  int k() const { return static_cast<int>(gpu.size()); }
  int64_t chunk_begin(int j) const { return total * j / k(); }

  void pack(int me) {
    int64_t at = 0;
    for (const Tensor& t : data[me]) {
      if (wire == DType::BF16)
        ops::cuda::convert(t.numel(), t.f32(), flat[me].data<BFloat16>() + at,
                           gpu::compute_stream(gpu[me]));
      else
        gpu::copy_within(gpu[me], flat[me].f32() + at, t.f32(), t.nbytes());
      at += t.numel();
    }
  }
  void unpack(int me) {
    int64_t at = 0;
    for (const Tensor& t : data[me]) {
      if (wire == DType::BF16)
        ops::cuda::convert(t.numel(), flat[me].data<BFloat16>() + at, t.f32(),
                           gpu::compute_stream(gpu[me]));
      else
        gpu::copy_within(gpu[me], t.f32(), flat[me].f32() + at, t.nbytes());
      at += t.numel();
    }
  }

  void run(int me) {
    try {
      cudaStream_t stream = gpu::compute_stream(gpu[me]);
      pack(me);
#if MGPU_ALLREDUCE_NCCL
      if (nccl) {
        run_nccl(me, stream);
        return;
      }
#endif
      if (wire == DType::BF16) run_peer_bf16(me, stream);
      else run_peer(me, stream);
      unpack(me);
    } catch (...) {
      barrier.abort();  // release the devices waiting for this one
      // A part that failed before its end (a failed pack, an aborted barrier) leaves earlier
      // collectives' reductions on the communication stream: the compute stream waits for them
      // before their buffers, which this one keeps, go back to the cache.
      try {
        join_compute(me);
      } catch (...) {  // the first error is the one reported
      }
      throw;
    }
  }

  void run_peer(int me, cudaStream_t stream) {
    // Every device's buffer must be complete before anyone reads it.
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
    const int64_t lo = chunk_begin(me), n = chunk_begin(me + 1) - lo;
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    float* acc = scratch[me].f32();
    float* fetched = acc + n;
    float* mine = flat[me].f32() + lo;
    if (n > 0) {
      fetch(me, 0, acc, lo, bytes);
      for (int d = 1; d < k(); ++d) {
        const float* x = mine;
        if (d != me) {
          fetch(me, d, fetched, lo, bytes);
          x = fetched;
        }
        ops::cuda::for_each_index(n, ops::BinarySameOut<ops::BinaryOp::Add>{acc, x, acc},
                                  stream);
      }
      gpu::copy_within(gpu[me], mine, acc, bytes);
    }
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
    // All-gather: every other chunk from the device that owns it.
    for (int j = 0; j < k(); ++j) {
      if (j == me) continue;
      const int64_t jlo = chunk_begin(j), jn = chunk_begin(j + 1) - jlo;
      if (jn > 0) fetch(me, j, flat[me].f32() + jlo, jlo, static_cast<size_t>(jn) * sizeof(float));
    }
    // No buffer may be released (and reused) while a peer still reads it.
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
  }

  // run_peer in bfloat16 (wire BF16): the packed buffers hold each device's rounded values;
  // device me widens chunk me of every device's buffer to float32 and adds them in device order
  // (run_peer's order, so the CPU devices' bits), rounds the sum into its own buffer's chunk,
  // and the all-gather fetches the other chunks' rounded sums: half of run_peer's bytes.
  void run_peer_bf16(int me, cudaStream_t stream) {
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
    const int64_t lo = chunk_begin(me), n = chunk_begin(me + 1) - lo;
    float* acc = scratch[me].f32();
    float* widened = acc + n;
    BFloat16* fetched = reinterpret_cast<BFloat16*>(widened + n);
    BFloat16* mine = flat[me].data<BFloat16>() + lo;
    if (n > 0) {
      for (int d = 0; d < k(); ++d) {
        const BFloat16* x = mine;
        if (d != me) {
          fetch(me, d, fetched, lo, static_cast<size_t>(n) * sizeof(BFloat16));
          x = fetched;
        }
        ops::cuda::convert(n, x, d == 0 ? acc : widened, stream);
        if (d > 0)
          ops::cuda::for_each_index(n, ops::BinarySameOut<ops::BinaryOp::Add>{acc, widened, acc},
                                    stream);
      }
      ops::cuda::convert(n, acc, mine, stream);
    }
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
    for (int j = 0; j < k(); ++j) {
      if (j == me) continue;
      const int64_t jlo = chunk_begin(j), jn = chunk_begin(j + 1) - jlo;
      if (jn > 0)
        fetch(me, j, flat[me].data<BFloat16>() + jlo, jlo,
              static_cast<size_t>(jn) * sizeof(BFloat16));
    }
    gpu::synchronize(gpu[me]);
    barrier.arrive_and_wait();
  }

  // Copies elements [lo, lo + bytes / element size) of device d's flat buffer to `to` on
  // device me.
  void fetch(int me, int d, void* to, int64_t lo, size_t bytes) {
    const char* from = static_cast<const char*>(flat[d].raw()) + lo * dtype_size(wire);
    if (d == me) gpu::copy_within(gpu[me], to, from, bytes);
    else gpu::copy_from_peer(gpu[me], to, gpu[d], from, bytes);
  }

#if MGPU_ALLREDUCE_NCCL
  std::shared_ptr<Communicators> comms;
  double timeout_s = 300.0;

  // The hand-over events of a device, made once by its worker and reused: its collectives run
  // one after another on that worker, so a record is always waited on before the next one.
  static std::pair<cudaEvent_t, cudaEvent_t> handover_events(int device) {
    static cudaEvent_t packed[gpu::kMaxGpus] = {}, reduced[gpu::kMaxGpus] = {};
    if (!packed[device]) {
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&packed[device], cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&reduced[device], cudaEventDisableTiming));
    }
    return {packed[device], reduced[device]};
  }

  // The grouped ncclAllReduce of every device (device 0's worker calls it for all).
  void launch() {
    try {
      const double pause = launch_pause_s().load();
      if (pause > 0) std::this_thread::sleep_for(std::chrono::duration<double>(pause));
      NcclGroup group;
      for (int d = 0; d < k(); ++d) {
        nccl_check(ncclAllReduce(flat[d].raw(), flat[d].raw(), static_cast<size_t>(total),
                                 wire == DType::BF16 ? ncclBfloat16 : ncclFloat, ncclSum,
                                 comms->comms[d], gpu::comm_stream(gpu[d])),
                   "ncclAllReduce");
      }
      group.end();
    } catch (...) {
      refused_launches().fetch_add(1);
      throw;
    }
  }

  [[noreturn]] void fail_broken() const {
    throw DeviceError("allreduce: " + comms->why + "; the communicators were aborted, the next "
                      "all-reduce makes new ones");
  }

  void run_nccl(int me, cudaStream_t stream) {
    // The communication stream takes the packed buffer from the compute stream, and hands it back.
    // Without this wait the collective may read the buffer before the packing copies wrote it: on
    // the strict emulator, where the collective is queued work of the communication stream, it
    // then sums the poisoned (NaN) block (test_nccl_emu.py's strict test fails for seeds 1-3).
    cudaStream_t comm = gpu::comm_stream(gpu[me]);
    auto [packed, reduced] = handover_events(gpu[me]);
    MGPU_CUDA_CHECK(cudaEventRecord(packed, stream));
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(comm, packed, 0));
    barrier.arrive_and_wait();  // every device's pack is enqueued
    Armed armed(comms, timeout_s);
    try {
      if (comms->broken.load()) fail_broken();  // an earlier bucket of this step failed
      if (me == 0) {
        // One grouped call launches the reduction on all devices' communication streams (no
        // cudaFree meanwhile: see gpu::device_wide_mutex), never on a retired (aborted) set.
        std::lock_guard<std::mutex> lock(gpu::device_wide_mutex());
        const bool launched = launch_unless_retired(*comms, [&] { launch(); });
        // NCCL switched devices to launch on the others: make this worker's GPU current again.
        gpu::set_device(gpu[me]);
        if (!launched) fail_broken();
      }
      barrier.arrive_and_wait();  // the reduction is enqueued on every communication stream
      // Unpacked on the communication stream, so the compute stream need not wait here: with
      // kOnComm it goes on (the conv layers' backward) while the reduction runs.
      int64_t at = 0;
      for (const Tensor& t : data[me]) {
        if (wire == DType::BF16)
          ops::cuda::convert(t.numel(), flat[me].data<BFloat16>() + at, t.f32(), comm);
        else
          MGPU_CUDA_CHECK(cudaMemcpyAsync(t.f32(), flat[me].f32() + at, t.nbytes(),
                                          cudaMemcpyDeviceToDevice, comm));
        at += t.numel();
      }
      if (finish == Finish::kOnComm) return;
      // Everything on the communication stream so far -- this reduction and any earlier one
      // left there -- happens before the compute stream's next work.
      MGPU_CUDA_CHECK(cudaEventRecord(reduced, comm));
      MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream, reduced, 0));
      if (finish == Finish::kJoin) return;
      // The step's last collective waits for the reduction here, under the watchdog's deadline,
      // and asks NCCL for asynchronous errors: a failed or aborted collective is an exception
      // of this step, not silently wrong gradients.
      gpu::count_host_wait();
      for (;;) {
        cudaError_t q = cudaEventQuery(reduced);
        if (comms->broken.load()) fail_broken();
        if (ncclResult_t e = async_error(*comms); e != ncclSuccess) {
          retire(*comms, std::string("an NCCL collective on ") + gpu_list(gpu) +
                             " failed asynchronously: " + ncclGetErrorString(e), timeout_s);
          fail_broken();
        }
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) MGPU_CUDA_CHECK(q);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    } catch (const std::exception& e) {
      // Error path: the communicators go (aborted, so nothing of theirs still runs), and the
      // compute stream waits for everything on the communication stream before the buffers it
      // reads or writes are reused.
      if (!comms->broken.load()) retire(*comms, e.what(), timeout_s);
      cudaEventRecord(reduced, comm);
      cudaStreamWaitEvent(stream, reduced, 0);
      // The aborted collective's failure is reported here, not by the device's next wait.
      cudaStreamSynchronize(comm);
      cudaGetLastError();
      try {
        throw;
      } catch (const DeviceError&) {
        fail_broken();  // the reason (a timeout, an asynchronous error) rather than its symptom
      }
    }
  }
#endif

  // The compute stream of device `me` waits for everything on its communication stream so far.
  void join_compute(int me) {
#if MGPU_ALLREDUCE_NCCL
    if (!nccl) return;  // the peer-copy path never leaves work there
    cudaEvent_t reduced = handover_events(gpu[me]).second;
    MGPU_CUDA_CHECK(cudaEventRecord(reduced, gpu::comm_stream(gpu[me])));
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(gpu::compute_stream(gpu[me]), reduced, 0));
#else
    (void)me;
#endif
  }
};

GpuAllReduce::GpuAllReduce(const std::vector<Device>& devices, const std::vector<Shape>& shapes,
                           Finish finish, const GpuAllReduce* earlier, DType wire)
    : shapes_(shapes) {
  const int k = static_cast<int>(devices.size());
  auto coll = std::make_shared<GpuCollective>(k);
  coll_ = coll;
  coll->finish = finish;
  if (earlier) coll->earlier = earlier->coll_;
  for (const Device& d : devices) coll->gpu.push_back(d.index);
  for (const Shape& s : shapes) coll->total += numel(s);
  coll->nccl = use_nccl();
  coll->wire = wire;
  const double timeout_s = nccl_timeout_s();
  coll->barrier.set_deadline(
      timeout_s, "allreduce: a part of the all-reduce over " + gpu_list(coll->gpu) + " waited " +
                     std::to_string(timeout_s) + " s (MGPU_NCCL_TIMEOUT_S) for the other "
                     "devices' parts: one never joined (its queue is blocked, e.g. by a wait for "
                     "another device, or the devices received collectives in different orders)");
  for (int d = 0; d < k; ++d) {
    coll->flat.push_back(Tensor::empty({coll->total}, wire, devices[d]));
    if (!coll->nccl) {
      // run_peer's sum and fetched chunk; run_peer_bf16's sum, widened chunk and fetched chunk
      // (bfloat16, in the third part).
      const int64_t chunk = coll->chunk_begin(d + 1) - coll->chunk_begin(d);
      coll->scratch.push_back(
          Tensor::empty({(wire == DType::BF16 ? 3 : 2) * chunk}, DType::F32, devices[d]));
    }
  }
#if MGPU_ALLREDUCE_NCCL
  if (coll->nccl) {
    coll->timeout_s = timeout_s;
    coll->comms = communicators(coll->gpu);
  }
#endif
}

void GpuAllReduce::abort() { coll_->barrier.abort(); }

void GpuAllReduce::join_compute(size_t d) const {
  MGPU_ASSERT(d < coll_->gpu.size(), "device ", d, " of ", coll_->gpu.size());
  enqueue_on(Device{DeviceKind::CUDA, coll_->gpu[d]}, "allreduce (join)",
             [coll = coll_, me = static_cast<int>(d)] { coll->join_compute(me); });
}

void GpuAllReduce::join(size_t d, const std::vector<Tensor>& tensors) {
  MGPU_ASSERT(d < coll_->gpu.size() && coll_->data[d].empty(), "device ", d, " joins twice");
  MGPU_ASSERT(tensors.size() == shapes_.size(), "a bucket of ", tensors.size(), " tensors");
  for (size_t i = 0; i < tensors.size(); ++i)
    MGPU_ASSERT(tensors[i].shape() == shapes_[i] && tensors[i].device().index == coll_->gpu[d]);
  coll_->data[d] = tensors;
  Device dev{DeviceKind::CUDA, coll_->gpu[d]};
  enqueue_on(dev, "allreduce", [coll = coll_, me = static_cast<int>(d)] { coll->run(me); });
}

void allreduce_gpu(const std::vector<std::vector<Tensor>>& data,
                   const std::vector<Device>& devices, DType wire) {
  std::vector<Shape> shapes;
  for (const Tensor& t : data[0]) shapes.push_back(t.shape());
  GpuAllReduce all(devices, shapes, Finish::kWait, nullptr, wire);
  // Every queue gets its part in the same host order, so the barriers cannot deadlock.
  std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
  for (size_t d = 0; d < devices.size(); ++d) all.join(d, data[d]);
}

NcclStats nccl_stats() {
  NcclStats out;
#if MGPU_ALLREDUCE_NCCL
  out.live_sets = Communicators::live_sets().load();
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    out.cached_sets = static_cast<int>(cache().size());
  }
  out.refused_launches = refused_launches().load();
#endif
  return out;
}

void set_nccl_launch_pause(double seconds) {
#if MGPU_ALLREDUCE_NCCL
  launch_pause_s().store(seconds);
#else
  (void)seconds;
#endif
}

void empty_communicators() {
#if MGPU_ALLREDUCE_NCCL
  std::list<std::shared_ptr<Communicators>> idle;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& c = cache();
  for (auto it = c.begin(); it != c.end();) {
    auto next = std::next(it);
    if (it->use_count() == 1) idle.splice(idle.end(), c, it);
    it = next;
  }
#endif
}

}  // namespace mgpu::comm

#endif  // MGPU_GPU_BUILD
