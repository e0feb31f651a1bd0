// cpp/core/gpu.cpp -- streams, caching allocator, staging and copies for GPU devices (gpu.h).
// The same source serves real CUDA and the emulator (cuda/runtime.cuh picks the runtime).
// Executed: on emulated GPUs in the tests. Only compiled: against the real CUDA runtime.
#include "core/gpu.h"

#include "core/error.h"

#if MGPU_GPU_BUILD

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#define MGPU_CUDA_ERROR_TYPE ::mgpu::DeviceError
#include "cuda/runtime.cuh"

namespace mgpu::gpu {
namespace {

// Host-to-device copies go through this many pinned bytes at a time.
constexpr size_t kStagingBytes = size_t(8) << 20;

struct PoolState {
  bool alive = true;
  std::vector<std::pair<void*, size_t>> released;  // returned by their tensors, kept for replays
};

struct DeviceState {
  std::once_flag streams_once;
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  cudaStream_t dlpack = nullptr;  // DLPack producers order their work before mgpu's on it

  std::mutex capture_mutex;  // synchronize() vs. begin/end of a capture
  bool capturing = false;
  cudaEvent_t before_capture = nullptr;
  std::unordered_map<void*, std::shared_ptr<PoolState>> pooled;  // guarded by `mutex`

  std::mutex mutex;  // the allocator's lists and counters
  std::unordered_map<size_t, std::vector<void*>> free_lists;
  MemoryStats stats;

  std::mutex staging_mutex;  // two pinned buffers per device, each reused once its copy is done
  void* staging[2] = {nullptr, nullptr};
  cudaEvent_t staging_done[2] = {nullptr, nullptr};
  int staging_next = 0;
};

DeviceState& state(int device) {
  static DeviceState* states = new DeviceState[kMaxGpus];  // never destroyed (see queue.cpp)
  MGPU_ASSERT(device >= 0 && device < kMaxGpus, "gpu index ", device);
  return states[device];
}

thread_local int t_pool_device = -1;
thread_local std::shared_ptr<PoolState> t_pool;

// The thread's current device as the runtime has it (-1 if it cannot say). Never cached: other
// code on the same thread (PyTorch, CuPy, a user's cudaSetDevice) changes it behind mgpu's back.
int runtime_current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

// Makes `device` current for a scope and restores the thread's previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : previous_(runtime_current_device()) { set_device(device); }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != runtime_current_device() &&
        cudaSetDevice(previous_) != cudaSuccess)
      cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

// Size classes as the CPU allocator's (storage.cpp): 512-byte steps up to 64 KiB, then a
// quarter-power-of-two ladder, so the sizes a training step repeats land on the same list.
size_t size_class(size_t n) {
  constexpr size_t kSmall = 512;
  if (n <= (size_t(64) << 10)) return n == 0 ? kSmall : (n + kSmall - 1) / kSmall * kSmall;
  size_t p = size_t(64) << 10;
  while (p * 2 < n) p *= 2;
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

std::string mib(size_t bytes) {
  return std::to_string((bytes + (size_t(1) << 19)) >> 20) + " MiB";
}

void free_cached_locked(DeviceState& s) {
  std::lock_guard<std::mutex> lock(device_wide_mutex());
  for (auto& [cap, list] : s.free_lists) {
    for (void* p : list) {
      // A failure leaves the block to the driver at exit; its error is cleared here, or the
      // next launch check would report it as that kernel's failure.
      if (cudaFree(p) != cudaSuccess) cudaGetLastError();
    }
  }
  s.free_lists.clear();
  s.stats.cached = 0;
}

}  // namespace

namespace {
struct DeviceQuery {
  int count = 0;
  std::string error;
};

const DeviceQuery& device_query() {
  static const DeviceQuery query = [] {
    DeviceQuery q;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      q.error = cudaGetErrorString(err);
      cudaGetLastError();  // no driver or no device: clear the error, report none
      n = 0;
    }
    q.count = std::min(n, kMaxGpus);
    return q;
  }();
  return query;
}
}  // namespace

int device_count() { return device_query().count; }

std::string device_query_error() { return device_query().error; }

std::string runtime_name() {
#if defined(MGPU_CUDA_EMULATION)
  return "emulated CUDA (mgpu's emulator, cpp/cuda/emu; set MGPU_EMULATED_GPUS)";
#else
  return "CUDA runtime " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10);
#endif
}

void set_device(int device) {
  // cudaGetDevice reads the runtime's own per-thread state (no driver call): asking is cheap, and
  // it is the truth even when other code switched devices since mgpu's last call.
  if (runtime_current_device() == device) return;
  MGPU_CUDA_CHECK(cudaSetDevice(device));
}

std::mutex& device_wide_mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

namespace {
DeviceState& with_streams(int device) {
  DeviceState& s = state(device);
  std::call_once(s.streams_once, [&] {
    DeviceGuard guard(device);
    MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&s.compute, cudaStreamNonBlocking));
    MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&s.comm, cudaStreamNonBlocking));
    MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&s.dlpack, cudaStreamNonBlocking));
    // Direct access to the other GPUs where the hardware allows it: peer copies (and NCCL's
    // fallbacks) then go over NVLink/PCIe instead of through host memory. Where it is not
    // possible, cudaMemcpyPeerAsync still works, staged by the driver.
    for (int j = 0; j < device_count(); ++j) {
      int ok = 0;
      if (j == device || cudaDeviceCanAccessPeer(&ok, device, j) != cudaSuccess || !ok) {
        cudaGetLastError();
        continue;
      }
      if (cudaDeviceEnablePeerAccess(j, 0) != cudaSuccess) cudaGetLastError();  // e.g. already on
    }
  });
  return s;
}
}  // namespace

cudaStream_t compute_stream(int device) { return with_streams(device).compute; }
cudaStream_t import_stream(int device) { return with_streams(device).dlpack; }

struct ImportFence {
  cudaEvent_t event = nullptr;
  ~ImportFence() {
    if (event && cudaEventDestroy(event) != cudaSuccess) cudaGetLastError();
  }
};

std::shared_ptr<ImportFence> import_fence(int device) {
  DeviceState& s = with_streams(device);
  DeviceGuard guard(device);
  auto fence = std::make_shared<ImportFence>();
  MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&fence->event, cudaEventDisableTiming));
  MGPU_CUDA_CHECK(cudaEventRecord(fence->event, s.dlpack));
  return fence;
}

void wait_import_fence(int device, const ImportFence& fence) {
  MGPU_CUDA_CHECK(cudaStreamWaitEvent(with_streams(device).compute, fence.event, 0));
}
cudaStream_t comm_stream(int device) { return with_streams(device).comm; }

namespace {
std::atomic<uint64_t>& host_wait_count() {
  static std::atomic<uint64_t> n{0};
  return n;
}
}  // namespace

void count_host_wait() { host_wait_count().fetch_add(1, std::memory_order_relaxed); }
uint64_t host_waits() { return host_wait_count().load(std::memory_order_relaxed); }

void synchronize(int device) {
  count_host_wait();
  DeviceState& s = with_streams(device);
  cudaError_t e;
  {
    std::lock_guard<std::mutex> lock(s.capture_mutex);
    if (s.capturing) {
      e = cudaEventSynchronize(s.before_capture);
    } else {
      // Both streams mgpu's work runs on: a reduction left on the communication stream (a bucket
      // of a step that failed) still writes gradients, so "done" must include it.
      e = cudaStreamSynchronize(s.compute);
      if (e == cudaSuccess) e = cudaStreamSynchronize(s.comm);
    }
  }
  if (e != cudaSuccess) {
    std::string message = cuda_detail::error_message(e, "cudaStreamSynchronize", __FILE__, __LINE__);
    cudaGetLastError();  // reported here: the next launch check must not blame its kernel for it
    throw DeviceError("gpu(" + std::to_string(device) + "): a kernel or copy failed: " + message);
  }
}

void* allocate(int device, size_t nbytes, size_t* capacity) {
  DeviceState& s = state(device);
  const size_t cap = size_class(nbytes);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.free_lists.find(cap);
    if (it != s.free_lists.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      s.stats.cached -= cap;
      s.stats.allocated += cap;
      s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
      if (t_pool && t_pool_device == device) s.pooled[p] = t_pool;
      *capacity = cap;
      return p;
    }
  }
  DeviceGuard guard(device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, cap);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    // Blocks this device no longer uses may be pending on the stream: finish it, give the cache
    // back to the driver, and try once more. Not cudaStreamSynchronize while the worker captures
    // a graph (this thread may be the host allocating for that capture): synchronising a
    // capturing stream is illegal and invalidates the capture.
    {
      DeviceState& ss = with_streams(device);
      std::lock_guard<std::mutex> lock(ss.capture_mutex);
      if (ss.capturing) cudaEventSynchronize(ss.before_capture);
      else cudaStreamSynchronize(ss.compute);
    }
    cudaGetLastError();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      free_cached_locked(s);
    }
    e = cudaMalloc(&p, cap);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    cudaGetLastError();
    size_t held;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      held = s.stats.allocated;
    }
    if (e == cudaErrorMemoryAllocation) {
      throw OutOfMemoryError(detail::cat(
          "gpu(", device, ") is out of memory: cannot allocate ", mib(nbytes), " (", nbytes,
          " bytes); mgpu's tensors hold ", mib(held), " on it",
          known ? ", the device has " + mib(free_bytes) + " free of " + mib(total_bytes) : "",
          ". Use a smaller batch, free tensors you no longer need (del), or call "
          "mgpu.empty_cache()"));
    }
    throw DeviceError(cuda_detail::error_message(e, "cudaMalloc", __FILE__, __LINE__));
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  ++s.stats.device_mallocs;
  s.stats.allocated += cap;
  s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
  if (t_pool && t_pool_device == device) s.pooled[p] = t_pool;
  *capacity = cap;
  return p;
}

void release(int device, void* ptr, size_t capacity) {
  DeviceState& s = state(device);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.pooled.find(ptr);
    if (it != s.pooled.end()) {
      if (it->second->alive) {  // a graph still replays kernels that use this block
        it->second->released.emplace_back(ptr, capacity);
        s.stats.allocated -= capacity;
        return;
      }
      s.pooled.erase(it);
    }
  }
#if defined(MGPU_CUDA_EMULATION)
  // The strict emulator: the block is poisoned (NaN as floats) in the compute stream's order, so
  // work of another stream that still reads it without a wait (a use after free) reads NaN.
  if (emu::strict()) {
    DeviceState& ss = with_streams(device);
    std::lock_guard<std::mutex> lock(ss.capture_mutex);
    if (!ss.capturing && cudaMemsetAsync(ptr, 0xff, capacity, ss.compute) != cudaSuccess)
      cudaGetLastError();
  }
#endif
  std::lock_guard<std::mutex> lock(s.mutex);
  s.free_lists[capacity].push_back(ptr);
  s.stats.allocated -= capacity;
  s.stats.cached += capacity;
}

MemoryStats memory_stats(int device) {
  DeviceState& s = state(device);
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.stats;
}

void empty_cache(int device) {
  synchronize(device);
  DeviceState& s = state(device);
  DeviceGuard guard(device);
  std::lock_guard<std::mutex> lock(s.mutex);
  free_cached_locked(s);
}

void copy_from_host(int device, void* dst, const void* src, size_t nbytes) {
  DeviceGuard guard(device);
  DeviceState& s = with_streams(device);
  std::lock_guard<std::mutex> lock(s.staging_mutex);
  if (!s.staging[0]) {
    for (int i = 0; i < 2; ++i) {
      MGPU_CUDA_CHECK(cudaMallocHost(&s.staging[i], kStagingBytes));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&s.staging_done[i], cudaEventDisableTiming));
    }
  }
  auto* to = static_cast<char*>(dst);
  auto* from = static_cast<const char*>(src);
  for (size_t done = 0; done < nbytes;) {
    size_t n = std::min(kStagingBytes, nbytes - done);
    const int b = s.staging_next;
    s.staging_next ^= 1;
    // This buffer's previous DMA must have left it before it is refilled. It was issued two
    // copies ago, so the wait no longer drains everything queued since the last copy (x then y
    // of one step used to wait for the whole previous step on the stream).
    count_host_wait();
    MGPU_CUDA_CHECK(cudaEventSynchronize(s.staging_done[b]));
    std::memcpy(s.staging[b], from + done, n);
    MGPU_CUDA_CHECK(
        cudaMemcpyAsync(to + done, s.staging[b], n, cudaMemcpyHostToDevice, s.compute));
    MGPU_CUDA_CHECK(cudaEventRecord(s.staging_done[b], s.compute));
    done += n;
  }
}

void copy_to_host(int device, void* dst, const void* src, size_t nbytes) {
  DeviceGuard guard(device);
  cudaStream_t stream = compute_stream(device);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream));
  synchronize(device);
}

void read_to_host(int device, void* dst, const void* src, size_t nbytes) {
  DeviceGuard guard(device);
  MGPU_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDeviceToHost));
}

void copy_within(int device, void* dst, const void* src, size_t nbytes) {
  MGPU_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, compute_stream(device)));
}

void copy_from_peer(int device, void* dst, int src_device, const void* src, size_t nbytes) {
  MGPU_CUDA_CHECK(
      cudaMemcpyPeerAsync(dst, device, src, src_device, nbytes, compute_stream(device)));
}

void memset_async(int device, void* dst, int value, size_t nbytes) {
  MGPU_CUDA_CHECK(cudaMemsetAsync(dst, value, nbytes, compute_stream(device)));
}

class Graph {
 public:
  Graph(cudaGraph_t g, cudaGraphExec_t e) : graph(g), exec(e) {}
  // Destructors never throw: a failure is cleared where it happens, so the next launch check
  // does not blame its own kernel for it.
  ~Graph() {
    if (exec && cudaGraphExecDestroy(exec) != cudaSuccess) cudaGetLastError();
    if (graph && cudaGraphDestroy(graph) != cudaSuccess) cudaGetLastError();
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
};

void begin_capture(int device) {
  DeviceState& s = with_streams(device);
  std::lock_guard<std::mutex> lock(s.capture_mutex);
  MGPU_ASSERT(!s.capturing, "gpu(", device, ") is already capturing a graph");
  if (!s.before_capture)
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&s.before_capture, cudaEventDisableTiming));
  MGPU_CUDA_CHECK(cudaEventRecord(s.before_capture, s.compute));
  MGPU_CUDA_CHECK(cudaStreamBeginCapture(s.compute, cudaStreamCaptureModeThreadLocal));
  s.capturing = true;
}

std::shared_ptr<Graph> end_capture(int device) {
  DeviceState& s = with_streams(device);
  cudaGraph_t graph = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.capture_mutex);
    MGPU_ASSERT(s.capturing, "gpu(", device, ") is not capturing a graph");
    s.capturing = false;
    MGPU_CUDA_CHECK(cudaStreamEndCapture(s.compute, &graph));
  }
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  if (e != cudaSuccess) {
    cudaGraphDestroy(graph);
    MGPU_CUDA_CHECK(e);
  }
  return std::make_shared<Graph>(graph, exec);
}

void launch(const Graph& graph, int device) {
  MGPU_CUDA_CHECK(cudaGraphLaunch(graph.exec, compute_stream(device)));
}

class GraphPool {
 public:
  GraphPool(int device, std::shared_ptr<PoolState> st) : device_(device), state_(std::move(st)) {}
  ~GraphPool() {
    DeviceState& s = state(device_);
    std::lock_guard<std::mutex> lock(s.mutex);
    state_->alive = false;
    for (auto [ptr, cap] : state_->released) {
      s.pooled.erase(ptr);
      s.free_lists[cap].push_back(ptr);
      s.stats.cached += cap;
    }
  }
  GraphPool(const GraphPool&) = delete;
  GraphPool& operator=(const GraphPool&) = delete;

 private:
  int device_;
  std::shared_ptr<PoolState> state_;
};

void begin_graph_pool(int device) {
  MGPU_ASSERT(!t_pool, "a graph pool is already open on this thread");
  t_pool = std::make_shared<PoolState>();
  t_pool_device = device;
}

std::shared_ptr<GraphPool> end_graph_pool() {
  MGPU_ASSERT(t_pool, "no graph pool is open on this thread");
  auto pool = std::make_shared<GraphPool>(t_pool_device, std::move(t_pool));
  t_pool = nullptr;
  t_pool_device = -1;
  return pool;
}

}  // namespace mgpu::gpu

#else  // CPU-only build: no GPU can exist, so only the queries are reachable.

namespace mgpu::gpu {

int device_count() { return 0; }
std::string device_query_error() { return ""; }
std::string runtime_name() { return "not built"; }

namespace {
[[noreturn]] void not_built() {
  throw InternalError("internal error: a GPU function was called in a build without GPUs");
}
}  // namespace

void set_device(int) { not_built(); }
cudaStream_t compute_stream(int) { not_built(); }
cudaStream_t comm_stream(int) { not_built(); }
cudaStream_t import_stream(int) { not_built(); }
struct ImportFence {};
std::shared_ptr<ImportFence> import_fence(int) { not_built(); }
void wait_import_fence(int, const ImportFence&) { not_built(); }
void synchronize(int) { not_built(); }
void count_host_wait() {}
uint64_t host_waits() { return 0; }
void* allocate(int, size_t, size_t*) { not_built(); }
void release(int, void*, size_t) { not_built(); }
MemoryStats memory_stats(int) { return {}; }
std::mutex& device_wide_mutex() {
  static std::mutex m;
  return m;
}
void empty_cache(int) {}
void copy_from_host(int, void*, const void*, size_t) { not_built(); }
void copy_to_host(int, void*, const void*, size_t) { not_built(); }
void copy_within(int, void*, const void*, size_t) { not_built(); }
void copy_from_peer(int, void*, int, const void*, size_t) { not_built(); }
void memset_async(int, void*, int, size_t) { not_built(); }
void read_to_host(int, void*, const void*, size_t) { not_built(); }
class Graph {};
class GraphPool {};
void begin_capture(int) { not_built(); }
std::shared_ptr<Graph> end_capture(int) { not_built(); }
void launch(const Graph&, int) { not_built(); }
void begin_graph_pool(int) { not_built(); }
std::shared_ptr<GraphPool> end_graph_pool() { not_built(); }

}  // namespace mgpu::gpu

#endif
