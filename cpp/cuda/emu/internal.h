// cpp/cuda/emu/internal.h -- what the emulator's own sources share (kernel code never includes
// it): the runtime handles' contents, the process-wide runtime state and the checks on it, each OS
// thread's current device and last error, and one launch as the fiber scheduler runs it.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/emu/cuda_emulation.h"

#if defined(__SANITIZE_ADDRESS__)
#define MGPU_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MGPU_EMU_ASAN 1
#endif
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
  // Strict mode (MGPU_EMU_STRICT=1): work issued but not yet run, in stream order; it runs when
  // something synchronises with the stream (or at a random earlier point), on that thread. Items
  // are numbered 1, 2, ... in issue order: `issued` is the last number given, `completed` how
  // many have finished (they finish in order), so item i has finished iff completed >= i.
  std::mutex pending_mu;
  std::deque<Work> pending;
  uint64_t issued = 0;  // under pending_mu
  std::atomic<uint64_t> completed{0};
  std::mutex exec_mu;  // one thread at a time runs a stream's pending work, in order
};
// When an event's record last ran. Shared with the record's work item (queued, or a node of a
// graph), which may run after the event is destroyed: CUDA allows destroying an event whose
// record has not completed yet.
struct EventStamp {
  std::atomic<bool> recorded{false};
  std::atomic<std::chrono::steady_clock::rep> ticks{0};
};
struct CUevent_st {
  int device = 0;
  unsigned flags = 0;
  std::shared_ptr<EventStamp> stamp = std::make_shared<EventStamp>();
  // Its last record (under rt().mu): the stream and, in strict mode, the number of the record's
  // item on it; the event has completed once that item has (0: it completed when recorded).
  CUstream_st* stream = nullptr;
  uint64_t target = 0;
  bool captured = false;  // last recorded into a capture: a node, not a point in time
};
struct CUgraph_st {
  std::vector<Work> nodes;
};
struct CUgraphExec_st {
  std::vector<Work> nodes;
};

namespace mgpu::emu {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
inline std::string hex(uint64_t v) { return cat("0x", std::hex, v); }
inline std::string ptr_str(const void* p) { return hex(reinterpret_cast<uintptr_t>(p)); }
inline std::string dim_str(dim3 d) { return cat("(", d.x, ",", d.y, ",", d.z, ")"); }

inline constexpr size_t kDefaultDynamicSharedLimit = 48 * 1024;
inline constexpr size_t kSharedOptinLimit = 166912;  // an A100's sharedMemPerBlockOptin
inline constexpr int kMaxDevices = 64;

// ---- Per-OS-thread runtime state: current device and the last error, as in CUDA ----------------
struct ThreadState {
  int device = 0;
  cudaError_t last_error = cudaSuccess;
  std::string detail;
};
extern thread_local ThreadState tls;
// Makes (code, detail) this thread's last error; returns code.
cudaError_t fail(cudaError_t code, std::string detail);

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
  bool peer_supported = true;  // MGPU_EMU_PEER_ACCESS=0: no pair of devices can enable access
  std::map<uintptr_t, Allocation> allocations;
  std::vector<size_t> allocated;
  std::vector<std::vector<char>> peer;  // peer[d][p]: kernels on d may touch p's memory
  std::vector<cudaError_t> pending;     // a failed kernel's error, for the device's next sync
  std::vector<std::string> pending_detail;
  std::vector<std::unique_ptr<CUstream_st>> default_streams;
  std::set<CUstream_st*> streams;
  // Destroyed streams stay allocated: strict mode's queued event waits may still read their
  // progress (a wait on an event of a stream destroyed since; its work has finished by then).
  std::vector<std::unique_ptr<CUstream_st>> retired;
  std::set<CUevent_st*> events;
  std::set<CUgraph_st*> graphs;
  std::set<CUgraphExec_st*> execs;
  std::map<const void*, size_t> max_dynamic_shared;
};
Runtime& rt();
// rt(), configured from the environment on first use.
Runtime& runtime();
// Caller holds rt().mu.
void configure_locked();

inline constexpr uint64_t kDefaultSeed = 1;
#if MGPU_EMU_ASAN
inline constexpr size_t kDefaultStack = 256 * 1024;  // ASan's redzones make frames several times larger
#else
inline constexpr size_t kDefaultStack = 64 * 1024;
#endif
extern std::atomic<uint64_t> g_seed;
// Strict mode (MGPU_EMU_STRICT=1): streams run behind the host, blocks of a grid in a random
// order, freed memory is poisoned, and CUDA's capture rules on events apply. Its random choices
// come from MGPU_EMU_SEED (a failing run names the seed, to replay it).
extern std::atomic<bool> g_strict;
// The next number of the strict mode's seeded sequence (shared by all threads).
uint64_t strict_draw();
// What a blocked strict-mode work item waits for: progress of another stream, described for a
// deadlock report ("waits for <what> on <stream>").
struct Need {
  CUstream_st* stream;
  std::string what;
};
// Queues work on s (strict mode); returns the item's number on s.
uint64_t push_pending(CUstream_st* s, Work work);
// Runs a stream's pending work (strict mode), on this thread; its errors go to the device's
// next synchronisation, not to this thread's last error. A work item that cannot finish yet (a
// collective whose other ranks have not arrived, a wait for an event whose work has not run)
// calls block_stream() and returns: it stays at the front of the stream, and the thread waits as
// block_stream() said *without* holding the stream (so other threads can run it and every other
// stream meanwhile), then runs it again. No thread ever waits while it holds a stream: a rank's
// wait can never hold back another's.
void flush_stream(CUstream_st* s);
// As flush_stream, but only until s's item `target` has finished (what an event recorded there
// covers); nothing queued after it runs.
void drive(CUstream_st* s, uint64_t target);
// Runs s's items up to `target` without waiting: not when another thread (or this one, further
// out) runs s, and only until an item blocks. Returns whether item `target` has finished.
bool advance(CUstream_st* s, uint64_t target);
// Called by a strict-mode work item that must run again later: `wait` returns once the item may
// make progress (it may help by running other streams; it holds none when called). `needs` says
// (when called, at any time) what the item still waits for: empty once nothing; a deadlock check
// follows these edges. `on_deadlock` is called with the report when the item is part of one.
void block_stream(std::function<void()> wait,
                  std::function<std::vector<Need>()> needs = nullptr,
                  std::function<void(const std::string&)> on_deadlock = nullptr);
// Runs s's pending work until it is empty or an item blocks; returns the blocked item's wait (or
// an empty function) without waiting, and whether any item ran. Never blocks on s's lock: when
// another thread runs s, it returns at once (ran = false).
std::function<void()> run_until_blocked(CUstream_st* s, bool* ran);
// run_until_blocked on each of `roots`, then on every stream their blocked items wait for (and
// so on): what a thread does while it waits for them. Returns whether any item ran.
bool help_along(const std::vector<CUstream_st*>& roots);
// A cycle of streams whose front items each wait for the next one's progress, reachable from s:
// a deadlock (on a GPU, a hang). Call it while idle; it reports one only when it has seen the
// same cycle, with no stream of it making progress, at two calls at least 100 ms apart (kept in
// *state, one per waiting thread). Then every item of the cycle fails with the report (returned).
struct DeadlockCheck {
  std::string signature;
  std::chrono::steady_clock::time_point seen;
};
std::string check_deadlock(CUstream_st* s, DeadlockCheck* state);
// The deadlock report for s's front item, if the check found one (taken: reported once).
std::string take_deadlock(CUstream_st* s);
// "stream 0x... of device d" (or "the default stream of device d").
std::string stream_name(const CUstream_st* s);
// Every stream of `device` (-1: of every device).
void flush_device(int device);
extern std::atomic<size_t> g_stack_size;

// The checks every runtime call shares (state.cpp); each returns the error it recorded with fail().
bool valid_device(int d);
cudaError_t bad_device(const char* api, int d);
// The error a failed kernel left for `device`'s next synchronisation, now cleared.
cudaError_t take_pending(int device);
// The allocation holding p (p may be one past the end if allow_end), or nullptr. Caller holds mu.
const std::pair<const uintptr_t, Allocation>* find_allocation(const void* p, bool allow_end);
std::string where(const std::pair<const uintptr_t, Allocation>& alloc);
cudaError_t check_side(const char* api, const char* role, const void* p, size_t count,
                       const char* side, int device);
cudaError_t check_copy(const char* api, void* dst, const void* src, size_t count,
                       cudaMemcpyKind kind);
cudaError_t check_capture_safe(const char* api, cudaError_t code);
// Strict mode: a copy or memset issued on a stream of `device` may touch device memory of that
// device or of a peer it has enabled access to, nothing else (p may be host memory).
cudaError_t check_owner(const char* api, const char* role, const void* p, int device);
// p lies inside a live device allocation (of any device).
bool is_device_memory(const void* p);
cudaError_t resolve_stream(const char* api, cudaStream_t handle, CUstream_st** out);
// Issues work on a stream: runs it now, or records it if the stream is capturing. *position (if
// given) is the item's number on s when strict mode queues it, else 0 (it has run, or is a node).
cudaError_t issue(const char* api, CUstream_st* s, bool legacy, Work work,
                  uint64_t* position = nullptr);

// ---- One launch (launch.cpp) and the scheduler that runs it (fibers.cpp) ----------------------
struct LaunchSpec {
  LaunchSite site;
  dim3 grid, block;
  size_t shared_bytes;
  int device;
  std::function<void()> body;
  std::vector<PointerArg> pointers;
};
std::string launch_name(const LaunchSpec& s);
// Fails the launch: the error goes to cudaGetLastError and to the device's next synchronisation.
cudaError_t report_kernel_failure(int device, cudaError_t code, std::string message);
// Runs every block of the grid, one after another, each thread a fiber of this OS thread.
cudaError_t run_grid(const LaunchSpec& s);
// Whether this OS thread is running a kernel's block.
bool in_kernel();

}  // namespace mgpu::emu
