// cpp/emu/cuda_emulation.cpp -- the CUDA emulator: a fiber scheduler that runs one thread block at
// a time with one fiber per CUDA thread (ucontext, pooled stacks), barriers and warp collectives as
// scheduler waits, and the runtime slice (devices, memory, copies, streams, events, graph capture)
// on host memory. Test builds only (DESIGN.md, "Running CUDA code without a GPU").
//
// How a block runs: all its fibers start runnable; the scheduler sweeps them in a seeded order,
// each runs until it waits (barrier, warp collective) or exits. The last thread to arrive at a
// barrier releases the others and a new sweep starts in a new order, so code that reads another
// thread's shared-memory write without a barrier in between sees it only by luck. A sweep in which
// no fiber can run, while some have not exited, is a deadlock and fails the launch with the state
// of every waiting thread.
#include "emu/cuda_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MGPU_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MGPU_EMU_ASAN 1
#endif
#endif
#if MGPU_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Opaque handles of the runtime API (declared, not defined, by the header, as in CUDA).
using Work = std::function<cudaError_t()>;
struct CUstream_st {
  int device = 0;
  unsigned flags = 0;
  bool is_default = false;
  bool capturing = false;
  bool invalidated = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id capture_thread;
  std::vector<Work> recorded;
};
struct CUevent_st {
  int device = 0;
  unsigned flags = 0;
  bool recorded = false;
  std::chrono::steady_clock::time_point time;
};
struct CUgraph_st {
  std::vector<Work> nodes;
};
struct CUgraphExec_st {
  std::vector<Work> nodes;
};

namespace mgpu::emu {
namespace {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
std::string hex(uint64_t v) { return cat("0x", std::hex, v); }
std::string ptr_str(const void* p) { return hex(reinterpret_cast<uintptr_t>(p)); }
std::string dim_str(dim3 d) { return cat("(", d.x, ",", d.y, ",", d.z, ")"); }

constexpr size_t kDefaultDynamicSharedLimit = 48 * 1024;
constexpr size_t kSharedOptinLimit = 166912;  // an A100's sharedMemPerBlockOptin
constexpr int kMaxDevices = 64;

// ---- Per-OS-thread runtime state: current device and the last error, as in CUDA ----------------
struct ThreadState {
  int device = 0;
  cudaError_t last_error = cudaSuccess;
  std::string detail;
};
thread_local ThreadState tls;

cudaError_t fail(cudaError_t code, std::string detail) {
  tls.last_error = code;
  tls.detail = std::move(detail);
  return code;
}

// ---- Process-wide runtime state ----------------------------------------------------------------
struct Allocation {
  size_t size;
  int device;  // -1: pinned host memory (cudaMallocHost)
};

struct Runtime {
  std::mutex mu;
  bool configured = false;
  std::string config_error;
  int device_count = 2;
  size_t device_memory = size_t(16) << 30;
  std::map<uintptr_t, Allocation> allocations;
  std::vector<size_t> allocated;
  std::vector<std::vector<char>> peer;  // peer[d][p]: kernels on d may touch p's memory
  std::vector<cudaError_t> pending;     // a failed kernel's error, for the device's next sync
  std::vector<std::string> pending_detail;
  std::vector<std::unique_ptr<CUstream_st>> default_streams;
  std::set<CUstream_st*> streams;
  std::set<CUevent_st*> events;
  std::set<CUgraph_st*> graphs;
  std::set<CUgraphExec_st*> execs;
  std::map<const void*, size_t> max_dynamic_shared;
};
// Never destroyed: worker threads may still call in while the process exits.
Runtime& rt() {
  static Runtime* runtime = new Runtime;
  return *runtime;
}

constexpr uint64_t kDefaultSeed = 1;
#if MGPU_EMU_ASAN
constexpr size_t kDefaultStack = 256 * 1024;  // ASan's redzones make frames several times larger
#else
constexpr size_t kDefaultStack = 64 * 1024;
#endif
std::atomic<uint64_t> g_seed{kDefaultSeed};
std::atomic<size_t> g_stack_size{kDefaultStack};
std::atomic<bool> g_pointer_checks{true};

bool parse_env(const char* name, long long lo, long long hi, long long* out, std::string* error) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return false;
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (*end != '\0' || v < lo || v > hi) {
    *error = cat(name, " must be an integer in [", lo, ", ", hi, "], got '", text, "'");
    return false;
  }
  *out = v;
  return true;
}

// Caller holds rt().mu.
void configure_locked() {
  Runtime& r = rt();
  if (r.configured) return;
  r.configured = true;
  r.config_error.clear();
  long long v = 0;
  r.device_count = 2;
  if (parse_env("MGPU_EMULATED_GPUS", 0, kMaxDevices, &v, &r.config_error)) r.device_count = int(v);
  if (!r.config_error.empty()) r.device_count = 0;
  if (parse_env("MGPU_EMU_SEED", 0, INT64_MAX, &v, &r.config_error)) g_seed = uint64_t(v);
  if (parse_env("MGPU_EMU_STACK_KIB", 16, 1 << 20, &v, &r.config_error))
    g_stack_size = size_t(v) * 1024;
  int n = r.device_count;
  r.allocated.assign(n, 0);
  r.peer.assign(n, std::vector<char>(n, 0));
  r.pending.assign(n, cudaSuccess);
  r.pending_detail.assign(n, std::string());
  r.default_streams.clear();
  for (int d = 0; d < n; ++d) {
    r.default_streams.push_back(std::make_unique<CUstream_st>());
    r.default_streams.back()->device = d;
    r.default_streams.back()->is_default = true;
  }
}

Runtime& runtime() {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mu);
  configure_locked();
  return r;
}

bool valid_device(int d) { return d >= 0 && d < runtime().device_count; }

cudaError_t bad_device(const char* api, int d) {
  Runtime& r = runtime();
  if (!r.config_error.empty())
    return fail(cudaErrorInitializationError, cat(api, ": ", r.config_error));
  return fail(cudaErrorInvalidDevice,
              cat(api, ": device ", d, " does not exist; there are ", r.device_count,
                  " emulated GPUs (set MGPU_EMULATED_GPUS to change that)"));
}

cudaError_t take_pending(int device) {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (device < 0 || device >= int(r.pending.size()) || r.pending[device] == cudaSuccess)
    return cudaSuccess;
  cudaError_t e = r.pending[device];
  r.pending[device] = cudaSuccess;
  return fail(e, std::move(r.pending_detail[device]));
}

// The allocation holding p (p may be one past the end if allow_end), or nullptr. Caller holds mu.
const std::pair<const uintptr_t, Allocation>* find_allocation(const void* p, bool allow_end) {
  auto& allocs = rt().allocations;
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = allocs.upper_bound(a);
  if (it == allocs.begin()) return nullptr;
  --it;
  uintptr_t end = it->first + it->second.size;
  if (a < end || (allow_end && a == end)) return &*it;
  return nullptr;
}

std::string where(const std::pair<const uintptr_t, Allocation>& alloc) {
  return alloc.second.device < 0 ? std::string("pinned host memory")
                                 : cat("memory of device ", alloc.second.device);
}

// One side of a copy or memset: `side` is "device" (must lie in a cudaMalloc'ed range of
// `device`, any device if -1), "host" (must not be device memory) or "any" (cudaMemcpyDefault).
cudaError_t check_side(const char* api, const char* role, const void* p, size_t count,
                       const char* side, int device) {
  if (p == nullptr) return fail(cudaErrorInvalidValue, cat(api, ": ", role, " is a null pointer"));
  std::lock_guard<std::mutex> lock(rt().mu);
  auto* alloc = find_allocation(p, false);
  bool want_device = std::strcmp(side, "device") == 0;
  if (alloc == nullptr || alloc->second.device < 0) {
    if (want_device) {
      return fail(cudaErrorInvalidValue,
                  cat(api, ": ", role, " ", ptr_str(p),
                      " is not device memory (not from cudaMalloc, or already freed)"));
    }
  } else {
    if (std::strcmp(side, "host") == 0) {
      return fail(cudaErrorInvalidValue,
                  cat(api, ": ", role, " ", ptr_str(p), " is ", where(*alloc),
                      " but the copy kind says host; use the right cudaMemcpyKind or "
                      "cudaMemcpyDefault"));
    }
    if (want_device && device >= 0 && alloc->second.device != device) {
      return fail(cudaErrorInvalidValue, cat(api, ": ", role, " ", ptr_str(p), " is ",
                                             where(*alloc), ", not of device ", device));
    }
  }
  if (alloc != nullptr) {
    size_t offset = reinterpret_cast<uintptr_t>(p) - alloc->first;
    if (count > alloc->second.size - offset) {
      return fail(
          cudaErrorInvalidValue,
          cat(api, ": ", role, " range of ", count, " bytes at offset ", offset,
              " overruns its allocation of ", alloc->second.size, " bytes (", where(*alloc), ")"));
    }
  }
  return cudaSuccess;
}

cudaError_t check_copy(const char* api, void* dst, const void* src, size_t count,
                       cudaMemcpyKind kind) {
  static const char* const kSides[5][2] = {{"host", "host"},
                                           {"device", "host"},
                                           {"host", "device"},
                                           {"device", "device"},
                                           {"any", "any"}};
  if (int(kind) < 0 || int(kind) > 4) {
    return fail(cudaErrorInvalidMemcpyDirection, cat(api, ": invalid cudaMemcpyKind ", int(kind)));
  }
  if (count == 0) return cudaSuccess;
  if (cudaError_t e = check_side(api, "dst", dst, count, kSides[kind][0], -1)) return e;
  return check_side(api, "src", src, count, kSides[kind][1], -1);
}

// Capture rules: while a stream captures in global mode (or thread-local mode, on the capturing
// thread), calls that could implicitly synchronise with it are errors and invalidate the capture.
cudaError_t check_capture_safe(const char* api, cudaError_t code) {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  for (CUstream_st* s : r.streams) {
    if (!s->capturing) continue;
    if (s->mode == cudaStreamCaptureModeRelaxed) continue;
    if (s->mode == cudaStreamCaptureModeThreadLocal &&
        s->capture_thread != std::this_thread::get_id())
      continue;
    s->invalidated = true;
    return fail(code,
                cat(api, " is not allowed while a stream of device ", s->device,
                    " is capturing a graph (it would synchronise with the capture); use the "
                    "Async variant on the capturing stream, or cudaStreamCaptureModeRelaxed"));
  }
  return cudaSuccess;
}

// Resolves a stream handle: 0, cudaStreamLegacy and cudaStreamPerThread are the current device's
// default stream.
cudaError_t resolve_stream(const char* api, cudaStream_t handle, CUstream_st** out) {
  Runtime& r = runtime();
  if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    if (!valid_device(tls.device)) return bad_device(api, tls.device);
    *out = r.default_streams[tls.device].get();
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.streams.count(handle) == 0) {
    return fail(cudaErrorInvalidResourceHandle,
                cat(api, ": stream ", ptr_str(handle), " is not a live stream (destroyed?)"));
  }
  *out = handle;
  return cudaSuccess;
}

// Issues work on a stream: runs it now, or records it if the stream is capturing.
cudaError_t issue(const char* api, CUstream_st* s, bool legacy, Work work) {
  if (s->capturing) {
    s->recorded.push_back(std::move(work));
    return cudaSuccess;
  }
  if (legacy) {
    if (cudaError_t e = check_capture_safe(api, cudaErrorStreamCaptureImplicit)) return e;
  }
  return work();
}

// ---- Fibers
// ---------------------------------------------------------------------------------------
enum class FiberState { runnable, at_barrier, at_warp, exited };

struct Fiber {
  ucontext_t context;
  char* mapping = nullptr;  // guard page + stack
  size_t mapping_size = 0;
  char* stack = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;  // ASan's bookkeeping for this stack
  FiberState state = FiberState::runnable;
  bool abort = false;
  unsigned tid = 0;
  uint3 index{0, 0, 0};
  // This lane's part in a warp collective.
  WarpOp op = WarpOp::sync;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  const char* file = "";
  int line = 0;
  uint64_t result = 0;

  ~Fiber() {
    if (mapping != nullptr) {
#if MGPU_EMU_ASAN
      __asan_unpoison_memory_region(stack, stack_size);
#endif
      munmap(mapping, mapping_size);
    }
  }
};

struct FiberAbort {};  // unwinds a waiting fiber when its block has failed

struct KernelError : std::runtime_error {
  cudaError_t code;
  KernelError(cudaError_t c, const std::string& what) : std::runtime_error(what), code(c) {}
};

struct BlockRun {
  const LaunchSite* site = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber*> fibers;
  unsigned n = 0;
  unsigned exited = 0;
  uint64_t events = 0;  // arrivals and exits: progress other than spinning on atomicCAS
  // __syncthreads
  unsigned arrived = 0;
  int bar_kind = 0;
  int bar_predicates = 0;
  int bar_result = 0;
  const char* bar_file = "";
  int bar_line = 0;
  unsigned bar_first = 0;
  bool phase_changed = false;
  // the first failure
  bool failed = false;
  cudaError_t code = cudaSuccess;
  std::string what;
  bool has_thread = false;
  unsigned failed_tid = 0;
};

struct Scheduler {
  ucontext_t main_context;
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* main_fake_stack = nullptr;
  Fiber* current = nullptr;
  BlockRun* block = nullptr;
  std::vector<std::unique_ptr<Fiber>> pool;
  size_t pool_stack_size = 0;
  unsigned char* dynamic_shared = nullptr;
  uint64_t switches = 0;
};
thread_local Scheduler sched;

std::string thread_str(const BlockRun& b, unsigned tid) {
  return cat("thread ", dim_str(dim3(b.fibers[tid]->index)));
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::sync:
      return "__syncwarp";
    case WarpOp::shfl:
      return "__shfl_sync";
    case WarpOp::shfl_up:
      return "__shfl_up_sync";
    case WarpOp::shfl_down:
      return "__shfl_down_sync";
    case WarpOp::shfl_xor:
      return "__shfl_xor_sync";
    case WarpOp::ballot:
      return "__ballot_sync";
    case WarpOp::any:
      return "__any_sync";
    case WarpOp::all:
      return "__all_sync";
  }
  return "?";
}

void asan_start_switch(void** fake_save, const void* bottom, size_t size) {
#if MGPU_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save, (void)bottom, (void)size;
#endif
}
void asan_finish_switch(void* fake_save, const void** bottom_old, size_t* size_old) {
#if MGPU_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
  (void)fake_save, (void)bottom_old, (void)size_old;
#endif
}

// Scheduler side: run fiber f until it waits or exits.
void switch_to(Fiber* f) {
  sched.current = f;
  threadIdx = f->index;
  ++sched.switches;
  asan_start_switch(&sched.main_fake_stack, f->stack, f->stack_size);
  swapcontext(&sched.main_context, &f->context);
  asan_finish_switch(sched.main_fake_stack, nullptr, nullptr);
  sched.current = nullptr;
}

// Fiber side: give control back to the scheduler.
void switch_to_scheduler(Fiber* f) {
  asan_start_switch(&f->fake_stack, sched.main_stack_bottom, sched.main_stack_size);
  swapcontext(&f->context, &sched.main_context);
  asan_finish_switch(f->fake_stack, &sched.main_stack_bottom, &sched.main_stack_size);
}

// Fiber side: wait; the scheduler resumes us when our state is runnable again, or to abort.
void suspend(Fiber* f) {
  switch_to_scheduler(f);
  if (f->abort) throw FiberAbort{};
}

void record_failure(BlockRun& b, const Fiber* f, cudaError_t code, std::string what) {
  if (b.failed) return;
  b.failed = true;
  b.code = code;
  b.what = std::move(what);
  b.has_thread = f != nullptr;
  if (f != nullptr) b.failed_tid = f->tid;
}

void run_thread(Fiber* f) {
  BlockRun& b = *sched.block;
  try {
    (*b.body)();
  } catch (const FiberAbort&) {
  } catch (const KernelError& e) {
    record_failure(b, f, e.code, e.what());
  } catch (const std::exception& e) {
    record_failure(b, f, cudaErrorLaunchFailure, cat("uncaught exception: ", e.what()));
  } catch (...) {
    record_failure(b, f, cudaErrorLaunchFailure, "uncaught exception of unknown type");
  }
}

// Every fiber runs this loop for its whole life: one CUDA thread per iteration, then back to the
// scheduler, which reuses the fiber (and its stack) for a thread of a later block or launch.
void fiber_main() {
  asan_finish_switch(nullptr, &sched.main_stack_bottom, &sched.main_stack_size);
  Fiber* f = sched.current;
  for (;;) {
    if (!f->abort) run_thread(f);
    f->state = FiberState::exited;
    ++sched.block->exited;
    ++sched.block->events;
    switch_to_scheduler(f);
  }
}

std::unique_ptr<Fiber> make_fiber(size_t stack_size) {
  auto f = std::make_unique<Fiber>();
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  stack_size = (stack_size + page - 1) / page * page;
  f->mapping_size = stack_size + page;
  void* m = mmap(nullptr, f->mapping_size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  f->mapping = static_cast<char*>(m);
  mprotect(f->mapping, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  f->stack = f->mapping + page;
  f->stack_size = stack_size;
  getcontext(&f->context);
  f->context.uc_stack.ss_sp = f->stack;
  f->context.uc_stack.ss_size = f->stack_size;
  f->context.uc_link = nullptr;
  makecontext(&f->context, fiber_main, 0);
  return f;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string describe_waiters(const BlockRun& b) {
  std::ostringstream out;
  if (b.arrived > 0) {
    out << b.arrived << " of " << b.n << " threads wait at __syncthreads (" << b.bar_file << ":"
        << b.bar_line << "), e.g. " << thread_str(b, b.bar_first) << "; ";
  }
  for (unsigned w = 0; w * 32 < b.n; ++w) {
    for (unsigned l = 0; l < 32 && w * 32 + l < b.n; ++l) {
      const Fiber* f = b.fibers[w * 32 + l];
      if (f->state != FiberState::at_warp) continue;
      out << "warp " << w << " lane " << l << " waits at " << op_name(f->op) << "(mask "
          << hex(f->mask) << ") (" << f->file << ":" << f->line << "); ";
      break;  // one lane per warp is enough to read the situation
    }
  }
  out << b.exited << " threads have exited";
  return out.str();
}

// After fiber f exited: nobody may be waiting for it.
void check_exit(BlockRun& b, const Fiber* f) {
  if (b.arrived > 0) {
    record_failure(b, f, cudaErrorLaunchFailure,
                   cat("exited while ", b.arrived, " threads wait at __syncthreads (", b.bar_file,
                       ":", b.bar_line,
                       "); every thread of a block must reach each barrier (on a "
                       "GPU this hangs or gives wrong results): guard the work instead of "
                       "returning early"));
    return;
  }
  unsigned warp = f->tid / 32, lane = f->tid % 32;
  for (unsigned l = 0; l < 32 && warp * 32 + l < b.n; ++l) {
    const Fiber* g = b.fibers[warp * 32 + l];
    if (g->state == FiberState::at_warp && (g->mask >> lane & 1u)) {
      record_failure(b, f, cudaErrorLaunchFailure,
                     cat("exited while lane ", l, " of its warp waits for it at ", op_name(g->op),
                         "(mask ", hex(g->mask), ") (", g->file, ":", g->line,
                         "); every lane named in the mask must take part"));
      return;
    }
  }
}

constexpr uint64_t kMaxIdleSweeps = 100000;

// Runs every thread of one block to completion (or to the block's failure).
void run_block(BlockRun& b, uint64_t block_linear) {
  uint64_t rng = g_seed.load() ^ (block_linear * 0xd1b54a32d192ed03ull);
  bool shuffle = g_seed.load() != 0;
  std::vector<unsigned> order(b.n);
  uint64_t idle_sweeps = 0;
  while (!b.failed && b.exited < b.n) {
    for (unsigned i = 0; i < b.n; ++i) order[i] = i;
    if (shuffle) {
      for (unsigned i = b.n; i > 1; --i) std::swap(order[i - 1], order[splitmix64(rng) % i]);
    }
    b.phase_changed = false;
    bool ran = false;
    uint64_t events_before = b.events;
    for (unsigned i = 0; i < b.n && !b.failed && !b.phase_changed; ++i) {
      Fiber* f = b.fibers[order[i]];
      if (f->state != FiberState::runnable) continue;
      switch_to(f);
      ran = true;
      if (f->state == FiberState::exited && !b.failed) check_exit(b, f);
    }
    if (b.failed || b.exited == b.n) break;
    if (!ran) {
      record_failure(b, nullptr, cudaErrorLaunchFailure,
                     cat("deadlock: no thread can proceed: ", describe_waiters(b)));
      break;
    }
    idle_sweeps = b.events == events_before ? idle_sweeps + 1 : 0;
    if (idle_sweeps > kMaxIdleSweeps) {
      record_failure(b, nullptr, cudaErrorLaunchFailure,
                     cat("livelock: threads keep failing atomicCAS and nothing else happens (",
                         describe_waiters(b),
                         "); blocks run one at a time here, so a block "
                         "cannot wait for another block"));
      break;
    }
  }
  if (!b.failed) return;
  // Unwind every fiber still inside the kernel, so its stack is clean for reuse.
  for (unsigned t = 0; t < b.n; ++t) {
    Fiber* f = b.fibers[t];
    if (f->state == FiberState::exited) continue;
    f->abort = true;
    switch_to(f);
  }
}

// ---- Kernel launches
// --------------------------------------------------------------------------------
struct LaunchSpec {
  LaunchSite site;
  dim3 grid, block;
  size_t shared_bytes;
  int device;
  std::function<void()> body;
  std::vector<PointerArg> pointers;
};

std::string launch_name(const LaunchSpec& s) {
  return cat("kernel '", s.site.kernel, "' (launched at ", s.site.file, ":", s.site.line, ")");
}

cudaError_t report_kernel_failure(int device, cudaError_t code, std::string message) {
  Runtime& r = runtime();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (device >= 0 && device < int(r.pending.size()) && r.pending[device] == cudaSuccess) {
      r.pending[device] = code;
      r.pending_detail[device] = message;
    }
  }
  return fail(code, std::move(message));
}

cudaError_t check_pointers(const LaunchSpec& s) {
  if (!g_pointer_checks.load()) return cudaSuccess;
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const PointerArg& p : s.pointers) {
    auto* alloc = find_allocation(p.value, true);
    if (alloc == nullptr) {
      return fail(cudaErrorIllegalAddress,
                  cat(launch_name(s), ": argument ", p.index, " is ", ptr_str(p.value),
                      ", which is not memory from cudaMalloc or cudaMallocHost (pageable host "
                      "memory, or a freed buffer); a kernel cannot dereference it"));
    }
    int owner = alloc->second.device;
    if (owner >= 0 && owner != s.device && !r.peer[s.device][owner]) {
      return fail(cudaErrorIllegalAddress,
                  cat(launch_name(s), ": argument ", p.index, " is ", where(*alloc),
                      ", but the kernel runs on device ", s.device,
                      " without peer access to it; call cudaDeviceEnablePeerAccess(", owner,
                      ", 0) on device ", s.device, ", or copy the data first"));
    }
  }
  return cudaSuccess;
}

cudaError_t run_grid(const LaunchSpec& s) {
  if (cudaError_t e = check_pointers(s)) {
    std::string detail = tls.detail;
    return report_kernel_failure(s.device, e, detail);
  }
  unsigned n = s.block.x * s.block.y * s.block.z;
  size_t stack_size = g_stack_size.load();
  if (sched.pool_stack_size != stack_size) {
    sched.pool.clear();
    sched.pool_stack_size = stack_size;
  }
  while (sched.pool.size() < n) sched.pool.push_back(make_fiber(stack_size));

  BlockRun b;
  b.site = &s.site;
  b.body = &s.body;
  b.n = n;
  b.fibers.resize(n);
  for (unsigned t = 0; t < n; ++t) {
    Fiber* f = sched.pool[t].get();
    f->tid = t;
    f->index = uint3{t % s.block.x, (t / s.block.x) % s.block.y, t / (s.block.x * s.block.y)};
    b.fibers[t] = f;
  }
  std::unique_ptr<unsigned char[]> shared(
      new unsigned char[s.shared_bytes > 0 ? s.shared_bytes : 1]);
  sched.dynamic_shared = shared.get();
  sched.block = &b;
  gridDim = s.grid;
  blockDim = s.block;
  uint64_t linear = 0;
  cudaError_t result = cudaSuccess;
  for (unsigned bz = 0; bz < s.grid.z && result == cudaSuccess; ++bz) {
    for (unsigned by = 0; by < s.grid.y && result == cudaSuccess; ++by) {
      for (unsigned bx = 0; bx < s.grid.x; ++bx, ++linear) {
        blockIdx = uint3{bx, by, bz};
        for (Fiber* f : b.fibers) {
          f->state = FiberState::runnable;
          f->abort = false;
        }
        b.exited = 0;
        b.arrived = 0;
        b.events = 0;
        std::memset(shared.get(), 0xff, s.shared_bytes);
        run_block(b, linear);
        if (b.failed) {
          std::string thread =
              b.has_thread ? cat(", ", thread_str(b, b.failed_tid)) : std::string();
          result = report_kernel_failure(
              s.device, b.code,
              cat(launch_name(s), " failed in block ", dim_str(dim3(blockIdx)), " of grid ",
                  dim_str(s.grid), " (block size ", dim_str(s.block), ")", thread, ": ", b.what));
          break;
        }
      }
    }
  }
  sched.block = nullptr;
  sched.dynamic_shared = nullptr;
  return result;
}

cudaError_t check_config(const LaunchSpec& s) {
  const dim3 g = s.grid, b = s.block;
  uint64_t threads = uint64_t(b.x) * b.y * b.z;
  const char* why = nullptr;
  if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0) {
    why = "a grid or block dimension is 0";
  } else if (threads > 1024) {
    why = "more than 1024 threads per block";
  } else if (b.x > 1024 || b.y > 1024 || b.z > 64) {
    why = "block dimensions exceed (1024, 1024, 64)";
  } else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    why = "grid dimensions exceed (2^31-1, 65535, 65535)";
  }
  if (why != nullptr) {
    return fail(cudaErrorInvalidConfiguration, cat(launch_name(s), ": invalid configuration grid ",
                                                   dim_str(g), " block ", dim_str(b), ": ", why));
  }
  size_t limit = kDefaultDynamicSharedLimit;
  {
    Runtime& r = runtime();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.max_dynamic_shared.find(s.site.kernel_address);
    if (it != r.max_dynamic_shared.end()) limit = it->second;
  }
  if (s.shared_bytes > limit) {
    return fail(cudaErrorInvalidValue,
                cat(launch_name(s), ": ", s.shared_bytes,
                    " bytes of dynamic shared memory exceed "
                    "the kernel's limit of ",
                    limit,
                    "; raise it with cudaFuncSetAttribute(kernel, "
                    "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) (at most ",
                    kSharedOptinLimit, ")"));
  }
  return cudaSuccess;
}

}  // namespace

// ---- The emulator's interface
// ------------------------------------------------------------------------
const std::string& last_error_detail() { return tls.detail; }

void reset_from_env() {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& [base, alloc] : r.allocations) std::free(reinterpret_cast<void*>(base));
  r.allocations.clear();
  for (CUstream_st* s : r.streams) delete s;
  for (CUevent_st* e : r.events) delete e;
  for (CUgraph_st* g : r.graphs) delete g;
  for (CUgraphExec_st* x : r.execs) delete x;
  r.streams.clear();
  r.events.clear();
  r.graphs.clear();
  r.execs.clear();
  r.max_dynamic_shared.clear();
  g_seed = kDefaultSeed;
  g_stack_size = kDefaultStack;
  g_pointer_checks = true;
  r.configured = false;
  configure_locked();
  tls = ThreadState{};
}

void set_seed(uint64_t s) { g_seed = s; }
uint64_t seed() {
  runtime();
  return g_seed.load();
}
void set_stack_size(size_t bytes) { g_stack_size = std::max<size_t>(bytes, 16 * 1024); }
void set_pointer_checks(bool on) { g_pointer_checks = on; }
uint64_t fiber_switches() { return sched.switches; }
size_t fiber_pool_size() { return sched.pool.size(); }

void launch(const LaunchSite& site, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            std::function<void()> body, const PointerArg* pointers, int num_pointers) {
  LaunchSpec spec{site,
                  grid,
                  block,
                  shared_bytes,
                  tls.device,
                  std::move(body),
                  std::vector<PointerArg>(pointers, pointers + num_pointers)};
  if (sched.block != nullptr) {
    fail(cudaErrorNotSupported, cat(launch_name(spec),
                                    ": launching a kernel from a kernel "
                                    "(dynamic parallelism) is not emulated"));
    return;
  }
  CUstream_st* s = nullptr;
  if (resolve_stream("kernel launch", stream, &s)) return;
  if (s->device != tls.device) {
    fail(cudaErrorInvalidResourceHandle,
         cat(launch_name(spec), ": the stream belongs to device ", s->device,
             " but the current device is ", tls.device, "; call cudaSetDevice(", s->device,
             ") before launching"));
    return;
  }
  if (check_config(spec)) return;
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  auto shared_spec = std::make_shared<const LaunchSpec>(std::move(spec));
  issue("kernel launch", s, legacy, [shared_spec] { return run_grid(*shared_spec); });
}

void* dynamic_shared_memory() {
  if (sched.block == nullptr) throw std::logic_error("dynamic shared memory used outside a kernel");
  return sched.dynamic_shared;
}

int syncthreads(int kind, int predicate, const char* file, int line) {
  Fiber* f = sched.current;
  if (f == nullptr) throw std::logic_error("__syncthreads called outside a kernel");
  BlockRun& b = *sched.block;
  if (b.exited > 0) {
    throw KernelError(
        cudaErrorLaunchFailure,
        cat("reached __syncthreads (", file, ":", line, ") after ", b.exited, " of ", b.n,
            " threads exited; every thread of a block must reach each barrier "
            "(on a GPU this hangs or gives wrong results): guard the work instead "
            "of returning early"));
  }
  if (b.arrived == 0) {
    b.bar_kind = kind;
    b.bar_file = file;
    b.bar_line = line;
    b.bar_first = f->tid;
    b.bar_predicates = 0;
  } else if (b.bar_line != line || b.bar_kind != kind || std::strcmp(b.bar_file, file) != 0) {
    throw KernelError(cudaErrorLaunchFailure,
                      cat("divergent barriers: this thread is at ", file, ":", line, " while ",
                          thread_str(b, b.bar_first), " waits at ", b.bar_file, ":", b.bar_line,
                          "; all threads of a block must reach the same __syncthreads"));
  }
  ++b.arrived;
  ++b.events;
  b.bar_predicates += predicate != 0;
  f->state = FiberState::at_barrier;
  if (b.arrived == b.n) {
    switch (b.bar_kind) {
      case 1:
        b.bar_result = b.bar_predicates;
        break;
      case 2:
        b.bar_result = unsigned(b.bar_predicates) == b.n;
        break;
      case 3:
        b.bar_result = b.bar_predicates > 0;
        break;
      default:
        b.bar_result = 0;
    }
    for (Fiber* g : b.fibers) g->state = FiberState::runnable;
    b.arrived = 0;
    b.phase_changed = true;  // the next phase starts in a new order, this thread included
  }
  suspend(f);
  return b.bar_result;
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line) {
  Fiber* f = sched.current;
  if (f == nullptr) throw std::logic_error("warp intrinsic called outside a kernel");
  BlockRun& b = *sched.block;
  const unsigned warp = f->tid / 32, lane = f->tid % 32;
  const unsigned lanes = std::min(32u, b.n - warp * 32);
  const unsigned existing = lanes == 32 ? ~0u : (1u << lanes) - 1;
  auto where_str = [&] { return cat(op_name(op), "(mask ", hex(mask), ") at ", file, ":", line); };
  if ((mask >> lane & 1u) == 0) {
    throw KernelError(cudaErrorLaunchFailure, cat(where_str(), ": lane ", lane,
                                                  " calls it with a mask that leaves it out"));
  }
  if ((mask & ~existing) != 0) {
    throw KernelError(cudaErrorLaunchFailure,
                      cat(where_str(), ": the mask names lanes that do not exist; warp ", warp,
                          " of this ", b.n, "-thread block has ", lanes, " lanes"));
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    throw KernelError(cudaErrorLaunchFailure,
                      cat(where_str(), ": width ", width, " is not a power of 2 in [1, 32]"));
  }
  Fiber* const* lane_fiber = &b.fibers[warp * 32];
  bool all_here = true;
  for (unsigned l = 0; l < lanes; ++l) {
    if (l == lane || (mask >> l & 1u) == 0) continue;
    const Fiber* g = lane_fiber[l];
    if (g->state == FiberState::exited) {
      throw KernelError(cudaErrorLaunchFailure, cat(where_str(), ": lane ", l,
                                                    " of the mask has already exited; every "
                                                    "lane named in the mask must take part"));
    }
    if (g->state == FiberState::at_warp && (g->op != op || g->mask != mask)) {
      throw KernelError(cudaErrorLaunchFailure,
                        cat(where_str(), ": lane ", l, " of the same warp waits at ",
                            op_name(g->op), "(mask ", hex(g->mask), ") at ", g->file, ":", g->line,
                            "; the lanes of a mask must meet at the same collective"));
    }
    all_here = all_here && g->state == FiberState::at_warp;
  }
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->file = file;
  f->line = line;
  ++b.events;
  if (!all_here) {
    f->state = FiberState::at_warp;
    suspend(f);
    return f->result;
  }
  // The last lane to arrive computes everyone's result.
  uint64_t ballot = 0;
  for (unsigned l = 0; l < lanes; ++l) {
    if ((mask >> l & 1u) && lane_fiber[l]->value != 0) ballot |= uint64_t(1) << l;
  }
  for (unsigned l = 0; l < lanes; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    Fiber* g = lane_fiber[l];
    const unsigned w = unsigned(g->width), segment = l & ~(w - 1);
    unsigned src = l;
    switch (op) {
      case WarpOp::sync:
        g->result = 0;
        break;
      case WarpOp::ballot:
        g->result = ballot;
        break;
      case WarpOp::any:
        g->result = ballot != 0;
        break;
      case WarpOp::all:
        g->result = ballot == mask;
        break;
      case WarpOp::shfl:
        src = segment + (unsigned(g->arg) & (w - 1));
        break;
      case WarpOp::shfl_up:
        src = (l - segment) < unsigned(g->arg) ? l : l - unsigned(g->arg);
        break;
      case WarpOp::shfl_down:
        src = (l - segment) + unsigned(g->arg) >= w ? l : l + unsigned(g->arg);
        break;
      case WarpOp::shfl_xor:
        src = l ^ unsigned(g->arg);
        if (src >= segment + w) src = l;
        break;
    }
    if (op == WarpOp::shfl || op == WarpOp::shfl_up || op == WarpOp::shfl_down ||
        op == WarpOp::shfl_xor) {
      // A source lane outside the mask has no defined value: make that loud (NaN / -1).
      g->result = src < lanes && (mask >> src & 1u) ? lane_fiber[src]->value : ~uint64_t(0);
    }
    if (g != f) g->state = FiberState::runnable;
  }
  f->state = FiberState::runnable;
  return f->result;
}

void yield_after_failed_cas() {
  Fiber* f = sched.current;
  if (f == nullptr) return;
  suspend(f);
}

void assert_fail(const char* expr, const char* file, int line, const char* function) {
  if (sched.current != nullptr) {
    throw KernelError(cudaErrorAssert,
                      cat("assertion `", expr, "` failed at ", file, ":", line, " in ", function));
  }
  // Host code: what the C library's assert does (its __assert_fail is not declared under NDEBUG).
  std::fprintf(stderr, "%s:%d: %s: Assertion `%s' failed.\n", file, line, function, expr);
  std::abort();
}

}  // namespace mgpu::emu

// ---- CUDA runtime API
// ------------------------------------------------------------------------------
using mgpu::emu::cat;
using mgpu::emu::fail;
using mgpu::emu::runtime;
using mgpu::emu::tls;

namespace {
struct ErrorText {
  cudaError_t code;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState",
     "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled",
     "peer access is already enabled"},
    {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled",
     "peer access has not been enabled"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
const ErrorText* find_error(cudaError_t e) {
  for (const ErrorText& t : kErrors) {
    if (t.code == e) return &t;
  }
  return nullptr;
}

template <typename Set, typename Handle>
bool live(Set& set, Handle h) {
  std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
  return set.count(h) != 0;
}
}  // namespace

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* t = find_error(error);
  return t ? t->name : "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* t = find_error(error);
  return t ? t->text : "unrecognized error code";
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = tls.last_error;
  tls.last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return tls.last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: count is null");
  auto& r = runtime();
  *count = r.device_count;
  if (!r.config_error.empty()) return fail(cudaErrorInitializationError, r.config_error);
  if (r.device_count == 0) {
    return fail(cudaErrorNoDevice, "cudaGetDeviceCount: MGPU_EMULATED_GPUS=0 emulates no GPU");
  }
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (!mgpu::emu::valid_device(device)) return mgpu::emu::bad_device("cudaSetDevice", device);
  tls.device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDevice: device is null");
  *device = tls.device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is null");
  if (!mgpu::emu::valid_device(device))
    return mgpu::emu::bad_device("cudaGetDeviceProperties", device);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "mgpu emulated GPU %d (CPU fibers)", device);
  prop->totalGlobalMem = runtime().device_memory;
  prop->sharedMemPerBlock = mgpu::emu::kDefaultDynamicSharedLimit;
  prop->regsPerBlock = 65536;
  prop->warpSize = warpSize;
  prop->memPitch = size_t(1) << 31;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 8;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->canMapHostMemory = 1;
  prop->concurrentKernels = 1;
  prop->pciBusID = device;
  prop->asyncEngineCount = 1;
  prop->unifiedAddressing = 1;
  prop->memoryBusWidth = 64;
  prop->l2CacheSize = 1 << 20;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerMultiprocessor = mgpu::emu::kSharedOptinLimit;
  prop->regsPerMultiprocessor = 65536;
  prop->sharedMemPerBlockOptin = mgpu::emu::kSharedOptinLimit;
  prop->maxBlocksPerMultiProcessor = 32;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceSynchronize", tls.device);
  {
    auto& r = runtime();
    std::lock_guard<std::mutex> lock(r.mu);
    for (CUstream_st* s : r.streams) {
      if (s->capturing && s->device == tls.device) {
        s->invalidated = true;
        return fail(cudaErrorStreamCaptureUnsupported,
                    cat("cudaDeviceSynchronize while a stream of device ", tls.device,
                        " is capturing a graph; end the capture first"));
      }
    }
  }
  return mgpu::emu::take_pending(tls.device);
}
cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (canAccessPeer == nullptr)
    return fail(cudaErrorInvalidValue, "cudaDeviceCanAccessPeer: result pointer is null");
  if (!mgpu::emu::valid_device(device))
    return mgpu::emu::bad_device("cudaDeviceCanAccessPeer", device);
  if (!mgpu::emu::valid_device(peerDevice))
    return mgpu::emu::bad_device("cudaDeviceCanAccessPeer", peerDevice);
  *canAccessPeer = device != peerDevice;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  if (flags != 0) return fail(cudaErrorInvalidValue, "cudaDeviceEnablePeerAccess: flags must be 0");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceEnablePeerAccess", tls.device);
  if (!mgpu::emu::valid_device(peerDevice) || peerDevice == tls.device) {
    return mgpu::emu::bad_device("cudaDeviceEnablePeerAccess", peerDevice);
  }
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  char& on = r.peer[tls.device][peerDevice];
  if (on) {
    return fail(cudaErrorPeerAccessAlreadyEnabled,
                cat("cudaDeviceEnablePeerAccess: device ", tls.device, " already accesses device ",
                    peerDevice));
  }
  on = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  if (!mgpu::emu::valid_device(peerDevice))
    return mgpu::emu::bad_device("cudaDeviceDisablePeerAccess", peerDevice);
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceDisablePeerAccess", tls.device);
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  char& on = r.peer[tls.device][peerDevice];
  if (!on) {
    return fail(cudaErrorPeerAccessNotEnabled,
                cat("cudaDeviceDisablePeerAccess: device ", tls.device, " has no access to device ",
                    peerDevice));
  }
  on = 0;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (func == nullptr) return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: func is null");
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    return fail(cudaErrorNotSupported,
                cat("cudaFuncSetAttribute: attribute ", int(attr), " is not emulated"));
  }
  if (value < 0 || size_t(value) > mgpu::emu::kSharedOptinLimit) {
    return fail(cudaErrorInvalidValue, cat("cudaFuncSetAttribute: ", value,
                                           " bytes of dynamic shared memory; "
                                           "the limit is ",
                                           mgpu::emu::kSharedOptinLimit));
  }
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.max_dynamic_shared[func] = size_t(value);
  return cudaSuccess;
}

namespace {
cudaError_t allocate(const char* api, void** ptr, size_t size, int device) {
  if (ptr == nullptr) return fail(cudaErrorInvalidValue, cat(api, ": result pointer is null"));
  *ptr = nullptr;
  if (cudaError_t e = mgpu::emu::check_capture_safe(api, cudaErrorStreamCaptureUnsupported))
    return e;
  if (size == 0) return cudaSuccess;
  auto& r = runtime();
  if (device >= 0) {
    std::lock_guard<std::mutex> lock(r.mu);
    if (size > r.device_memory - r.allocated[device]) {
      return fail(cudaErrorMemoryAllocation,
                  cat(api, ": out of memory on device ", device, ": asked for ", size, " bytes, ",
                      r.device_memory - r.allocated[device], " of ", r.device_memory, " free"));
    }
  }
  size_t rounded = (size + 255) / 256 * 256;  // CUDA aligns allocations to 256 bytes
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr)
    return fail(cudaErrorMemoryAllocation,
                cat(api, ": host allocation of ", size, " bytes failed"));
  // Fresh device memory is garbage on a GPU; 0xff bytes (NaN, -1) make reading it before writing
  // show.
  if (device >= 0) std::memset(p, 0xff, rounded);
  std::lock_guard<std::mutex> lock(r.mu);
  r.allocations[reinterpret_cast<uintptr_t>(p)] = mgpu::emu::Allocation{size, device};
  if (device >= 0) r.allocated[device] += size;
  *ptr = p;
  return cudaSuccess;
}
cudaError_t release(const char* api, void* p, bool device_memory) {
  if (p == nullptr) return cudaSuccess;
  if (cudaError_t e = mgpu::emu::check_capture_safe(api, cudaErrorStreamCaptureUnsupported))
    return e;
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == r.allocations.end() || (it->second.device >= 0) != device_memory) {
    return fail(device_memory ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue,
                cat(api, ": ", mgpu::emu::ptr_str(p), " is not the start of a live ",
                    device_memory ? "cudaMalloc" : "cudaMallocHost", " allocation"));
  }
  if (it->second.device >= 0) r.allocated[it->second.device] -= it->second.size;
  r.allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (!mgpu::emu::valid_device(tls.device)) return mgpu::emu::bad_device("cudaMalloc", tls.device);
  return allocate("cudaMalloc", devPtr, size, tls.device);
}
cudaError_t cudaFree(void* devPtr) { return release("cudaFree", devPtr, true); }
cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return allocate("cudaMallocHost", ptr, size, -1);
}
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  (void)flags;  // every emulated host allocation is "pinned" and mapped
  return allocate("cudaHostAlloc", pHost, size, -1);
}
cudaError_t cudaFreeHost(void* ptr) { return release("cudaFreeHost", ptr, false); }
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (free == nullptr || total == nullptr)
    return fail(cudaErrorInvalidValue, "cudaMemGetInfo: null result pointer");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaMemGetInfo", tls.device);
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  *total = r.device_memory;
  *free = r.device_memory - r.allocated[tls.device];
  return cudaSuccess;
}

namespace {
cudaError_t copy_async(const char* api, void* dst, const void* src, size_t count,
                       cudaMemcpyKind kind, cudaStream_t stream) {
  if (cudaError_t e = mgpu::emu::check_copy(api, dst, src, count, kind)) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = mgpu::emu::check_copy(api, dst, src, count, kind)) return e;
    if (count > 0) std::memmove(dst, src, count);
    return cudaSuccess;
  });
}
cudaError_t check_peer(const char* api, void* dst, int dstDevice, const void* src, int srcDevice,
                       size_t count) {
  if (!mgpu::emu::valid_device(dstDevice)) return mgpu::emu::bad_device(api, dstDevice);
  if (!mgpu::emu::valid_device(srcDevice)) return mgpu::emu::bad_device(api, srcDevice);
  if (count == 0) return cudaSuccess;
  if (cudaError_t e = mgpu::emu::check_side(api, "dst", dst, count, "device", dstDevice)) return e;
  return mgpu::emu::check_side(api, "src", src, count, "device", srcDevice);
}
cudaError_t peer_async(const char* api, void* dst, int dstDevice, const void* src, int srcDevice,
                       size_t count, cudaStream_t stream) {
  if (cudaError_t e = check_peer(api, dst, dstDevice, src, srcDevice, count)) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = check_peer(api, dst, dstDevice, src, srcDevice, count)) return e;
    if (count > 0) std::memmove(dst, src, count);
    return cudaSuccess;
  });
}
cudaError_t set_async(const char* api, void* devPtr, int value, size_t count, cudaStream_t stream) {
  auto check = [=] {
    return count == 0 ? cudaSuccess
                      : mgpu::emu::check_side(api, "pointer", devPtr, count, "device", -1);
  };
  if (cudaError_t e = check()) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = check()) return e;
    if (count > 0) std::memset(devPtr, value, count);
    return cudaSuccess;
  });
}
}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy_async("cudaMemcpy", dst, src, count, kind, nullptr);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy_async("cudaMemcpyAsync", dst, src, count, kind, stream);
}
cudaError_t cudaMemcpyPeer(void* dst, int dstDevice, const void* src, int srcDevice, size_t count) {
  return peer_async("cudaMemcpyPeer", dst, dstDevice, src, srcDevice, count, nullptr);
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream) {
  return peer_async("cudaMemcpyPeerAsync", dst, dstDevice, src, srcDevice, count, stream);
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return set_async("cudaMemset", devPtr, value, count, nullptr);
}
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return set_async("cudaMemsetAsync", devPtr, value, count, stream);
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return cudaStreamCreateWithFlags(pStream, 0);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  if (pStream == nullptr)
    return fail(cudaErrorInvalidValue, "cudaStreamCreate: result pointer is null");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaStreamCreate", tls.device);
  auto* s = new CUstream_st;
  s->device = tls.device;
  s->flags = flags;
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams.insert(s);
  *pStream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.streams.erase(stream) == 0) {
    return fail(cudaErrorInvalidResourceHandle,
                cat("cudaStreamDestroy: ", mgpu::emu::ptr_str(stream), " is not a live stream"));
  }
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamSynchronize", stream, &s)) return e;
  if (s->capturing) {
    s->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamSynchronize on a capturing stream; end the capture first");
  }
  return mgpu::emu::take_pending(s->device);
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamQuery", stream, &s)) return e;
  if (s->capturing) {
    s->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery on a capturing stream");
  }
  return cudaSuccess;  // work runs when issued, so a stream is always idle
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  (void)flags;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamWaitEvent", stream, &s)) return e;
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: not a live event");
  }
  // Everything before the event's record has already run; in a capture the order is the
  // recording order, so the wait is a no-op either way.
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr)
    return fail(cudaErrorInvalidValue, "cudaEventCreate: result pointer is null");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaEventCreate", tls.device);
  auto* e = new CUevent_st;
  e->device = tls.device;
  e->flags = flags;
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: not a live event");
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaEventRecord", stream, &s)) return e;
  if (event->device != s->device) {
    return fail(cudaErrorInvalidResourceHandle,
                cat("cudaEventRecord: the event belongs to device ", event->device,
                    " but the stream to device ", s->device));
  }
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue("cudaEventRecord", s, legacy, [event] {
    event->recorded = true;
    event->time = std::chrono::steady_clock::now();
    return cudaSuccess;
  });
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: not a live event");
  }
  return mgpu::emu::take_pending(event->device);
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: not a live event");
  }
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr) return fail(cudaErrorInvalidValue, "cudaEventElapsedTime: ms is null");
  if (!live(runtime().events, start) || !live(runtime().events, end)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not a live event");
  }
  if ((start->flags | end->flags) & cudaEventDisableTiming) {
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
  }
  if (!start->recorded || !end->recorded) {
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was never recorded");
  }
  *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.events.erase(event) == 0) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not a live event");
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamBeginCapture", stream, &s)) return e;
  if (s->is_default) {
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamBeginCapture: the default stream cannot capture; create a stream");
  }
  if (s->capturing)
    return fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  s->capturing = true;
  s->invalidated = false;
  s->mode = mode;
  s->capture_thread = std::this_thread::get_id();
  s->recorded.clear();
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  if (pGraph == nullptr) return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: pGraph is null");
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamEndCapture", stream, &s)) return e;
  if (!s->capturing)
    return fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  s->capturing = false;
  *pGraph = nullptr;
  std::vector<Work> nodes = std::move(s->recorded);
  s->recorded.clear();
  if (s->invalidated) {
    return fail(cudaErrorStreamCaptureInvalidated,
                "cudaStreamEndCapture: the capture was invalidated by a call not allowed during "
                "capture (see the earlier error)");
  }
  auto* g = new CUgraph_st{std::move(nodes)};
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.graphs.insert(g);
  *pGraph = g;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* pCaptureStatus) {
  if (pCaptureStatus == nullptr)
    return fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: status is null");
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamIsCapturing", stream, &s)) return e;
  *pCaptureStatus = !s->capturing    ? cudaStreamCaptureStatusNone
                    : s->invalidated ? cudaStreamCaptureStatusInvalidated
                                     : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags) {
  (void)flags;
  if (pGraphExec == nullptr)
    return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: pGraphExec is null");
  if (!live(runtime().graphs, graph)) {
    return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: not a live graph");
  }
  auto* x = new CUgraphExec_st{graph->nodes};
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.execs.insert(x);
  *pGraphExec = x;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  if (!live(runtime().execs, graphExec)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: not a live executable graph");
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaGraphLaunch", stream, &s)) return e;
  std::vector<Work> nodes = graphExec->nodes;  // the exec may be destroyed once launched
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue("cudaGraphLaunch", s, legacy, [nodes] {
    for (const Work& node : nodes) {
      if (cudaError_t e = node()) return e;
    }
    return cudaSuccess;
  });
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.execs.erase(graphExec) == 0) {
    return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: not a live executable graph");
  }
  delete graphExec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.graphs.erase(graph) == 0)
    return fail(cudaErrorInvalidValue, "cudaGraphDestroy: not a live graph");
  delete graph;
  return cudaSuccess;
}
