// cpp/cuda/emu/state.cpp -- the emulator's process-wide state (devices, allocations, streams,
// events, graphs, pending kernel errors) and per-thread state (current device, last error), the
// checks every runtime call shares, and the settings tests change.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/emu/internal.h"

namespace mgpu::emu {
namespace {

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

}  // namespace

thread_local ThreadState tls;

cudaError_t fail(cudaError_t code, std::string detail) {
  tls.last_error = code;
  tls.detail = std::move(detail);
  return code;
}

// Never destroyed: worker threads may still call in while the process exits.
Runtime& rt() {
  static Runtime* runtime = new Runtime;
  return *runtime;
}

std::atomic<uint64_t> g_seed{kDefaultSeed};
std::atomic<size_t> g_stack_size{kDefaultStack};
std::atomic<bool> g_strict{false};
namespace {
std::atomic<uint64_t> g_draws{0};
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

uint64_t strict_draw() { return mix(g_seed.load() ^ mix(g_draws.fetch_add(1))); }

namespace {
// Strict mode: what the front item of each blocked stream waits for, and the deadlock reports
// not yet taken by the items they name (both under graph_mu(), keyed by stream).
struct Blocked {
  std::function<std::vector<Need>()> needs;
  std::function<void(const std::string&)> on_deadlock;
};
std::mutex& graph_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<const CUstream_st*, Blocked>& blocked_items() {
  static auto* m = new std::map<const CUstream_st*, Blocked>;
  return *m;
}
std::map<const CUstream_st*, std::string>& deadlocks() {
  static auto* m = new std::map<const CUstream_st*, std::string>;
  return *m;
}

// Set by a work item that must run again later (block_stream).
thread_local std::function<void()> t_blocked;
thread_local Blocked t_blocked_on;
// The streams this thread runs now, outermost first: a wait item running another stream's work
// runs it nested, and must not take (or try to take) a stream it already holds.
thread_local std::vector<const CUstream_st*> t_held;
struct Hold {
  explicit Hold(const CUstream_st* s) { t_held.push_back(s); }
  ~Hold() { t_held.pop_back(); }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
};
bool holds(const CUstream_st* s) {
  return std::find(t_held.begin(), t_held.end(), s) != t_held.end();
}

// Runs the item at s's front (caller holds s->exec_mu); false when the queue is empty. An item
// that blocks goes back to the front, its wait is moved to *blocked and what it waits for is
// registered for the deadlock check.
bool run_front(CUstream_st* s, std::function<void()>* blocked) {
  Work w;
  {
    std::lock_guard<std::mutex> lock(s->pending_mu);
    if (s->pending.empty()) return false;
    w = std::move(s->pending.front());
    s->pending.pop_front();
  }
  // A nested run (an event wait running another stream's items) keeps its caller's state.
  std::function<void()> outer_blocked = std::move(t_blocked);
  Blocked outer_on = std::move(t_blocked_on);
  t_blocked = nullptr;
  t_blocked_on = Blocked{};
  cudaError_t e = w();
  std::function<void()> mine = std::move(t_blocked);
  Blocked mine_on = std::move(t_blocked_on);
  t_blocked = std::move(outer_blocked);
  t_blocked_on = std::move(outer_on);
  if (mine) {
    *blocked = std::move(mine);
    {
      std::lock_guard<std::mutex> lock(graph_mu());
      blocked_items()[s] = std::move(mine_on);
    }
    std::lock_guard<std::mutex> lock(s->pending_mu);
    s->pending.push_front(std::move(w));
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(graph_mu());
    blocked_items().erase(s);
    deadlocks().erase(s);
  }
  s->completed.fetch_add(1);
  if (e != cudaSuccess) {
    Runtime& r = runtime();
    std::lock_guard<std::mutex> lock(r.mu);
    if (s->device < int(r.pending.size()) && r.pending[s->device] == cudaSuccess) {
      r.pending[s->device] = e;
      r.pending_detail[s->device] = tls.detail;
    }
  }
  return true;
}

// What s's blocked front item waits for now (empty if s is not blocked).
std::vector<Need> needs_of(const CUstream_st* s) {
  std::function<std::vector<Need>()> needs;
  {
    std::lock_guard<std::mutex> lock(graph_mu());
    auto it = blocked_items().find(s);
    if (it == blocked_items().end() || !it->second.needs) return {};
    needs = it->second.needs;
  }
  return needs();
}
}  // namespace

uint64_t push_pending(CUstream_st* s, Work work) {
  std::lock_guard<std::mutex> lock(s->pending_mu);
  s->pending.push_back(std::move(work));
  return ++s->issued;
}

void block_stream(std::function<void()> wait, std::function<std::vector<Need>()> needs,
                  std::function<void(const std::string&)> on_deadlock) {
  t_blocked = std::move(wait);
  t_blocked_on = Blocked{std::move(needs), std::move(on_deadlock)};
}

void drive(CUstream_st* s, uint64_t target) {
  const ThreadState saved = tls;
  for (;;) {
    std::function<void()> blocked;
    {
      std::lock_guard<std::mutex> exec(s->exec_mu);
      Hold hold(s);
      while (!blocked && s->completed.load() < target && run_front(s, &blocked)) {
      }
    }
    if (!blocked) break;
    blocked();  // the stream is free meanwhile: another thread may run its blocked item first
  }
  tls = saved;
}

void flush_stream(CUstream_st* s) { drive(s, UINT64_MAX); }

bool advance(CUstream_st* s, uint64_t target) {
  if (s->completed.load() >= target) return true;
  if (holds(s)) return false;
  std::unique_lock<std::mutex> exec(s->exec_mu, std::try_to_lock);
  if (!exec.owns_lock()) return false;
  Hold hold(s);
  std::function<void()> blocked;
  while (!blocked && s->completed.load() < target && run_front(s, &blocked)) {
  }
  return s->completed.load() >= target;
}

std::function<void()> run_until_blocked(CUstream_st* s, bool* ran) {
  *ran = false;
  if (holds(s)) return nullptr;
  std::unique_lock<std::mutex> exec(s->exec_mu, std::try_to_lock);
  if (!exec.owns_lock()) return nullptr;
  Hold hold(s);
  const ThreadState saved = tls;
  std::function<void()> blocked;
  while (run_front(s, &blocked)) {
    if (blocked) break;
    *ran = true;  // an item finished (a blocked one may have arrived, but nothing finished)
  }
  tls = saved;
  return blocked;
}

bool help_along(const std::vector<CUstream_st*>& roots) {
  bool ran = false;
  std::vector<CUstream_st*> todo;
  std::set<CUstream_st*> seen;
  for (CUstream_st* s : roots)
    if (seen.insert(s).second) todo.push_back(s);
  for (size_t i = 0; i < todo.size(); ++i) {
    bool any = false;
    run_until_blocked(todo[i], &any);
    ran = ran || any;
    for (const Need& n : needs_of(todo[i]))
      if (seen.insert(n.stream).second) todo.push_back(n.stream);
  }
  return ran;
}

std::string stream_name(const CUstream_st* s) {
  if (s->is_default) return cat("the default stream of device ", s->device);
  return cat("stream ", ptr_str(s), " of device ", s->device);
}

std::string check_deadlock(CUstream_st* from, DeadlockCheck* state) {
  // Depth-first along what blocked front items wait for; a stream met again on the path closes
  // a cycle. Each path entry: a stream and what its front item waits for on the next one.
  std::vector<std::pair<CUstream_st*, std::string>> path, cycle;
  std::set<CUstream_st*> finished;
  std::function<bool(CUstream_st*)> visit = [&](CUstream_st* s) {
    auto on_path = std::find_if(path.begin(), path.end(), [s](const auto& p) { return p.first == s; });
    if (on_path != path.end()) {
      cycle.assign(on_path, path.end());
      return true;
    }
    if (finished.count(s)) return false;
    std::vector<Need> needs = needs_of(s);
    for (const Need& n : needs) {
      path.emplace_back(s, cat(n.what, " on ", stream_name(n.stream)));
      if (visit(n.stream)) return true;
      path.pop_back();
    }
    finished.insert(s);
    return false;
  };
  visit(from);
  std::string signature;
  for (const auto& [s, what] : cycle) signature += cat(ptr_str(s), ":", s->completed.load(), ";");
  const auto now = std::chrono::steady_clock::now();
  if (signature.empty() || signature != state->signature) {
    state->signature = signature;
    state->seen = now;
    return std::string();
  }
  if (now - state->seen < std::chrono::milliseconds(100)) return std::string();
  // The same cycle twice, 100 ms apart, and none of its streams finished an item meanwhile: each
  // front item waits for the next stream's progress, which waits for the next: none can move.
  std::string report = "deadlock between streams (on a GPU they hang): ";
  for (size_t i = 0; i < cycle.size(); ++i)
    report += cat(i ? "; " : "", stream_name(cycle[i].first), " waits for ", cycle[i].second);
  report += cat("; none of them can proceed [strict emulator: replay with MGPU_EMU_STRICT=1 "
                "MGPU_EMU_SEED=", g_seed.load(), "]");
  std::vector<std::function<void(const std::string&)>> breaks;
  {
    std::lock_guard<std::mutex> lock(graph_mu());
    for (const auto& [s, what] : cycle) {
      deadlocks()[s] = report;
      auto it = blocked_items().find(s);
      if (it != blocked_items().end() && it->second.on_deadlock)
        breaks.push_back(it->second.on_deadlock);
    }
  }
  for (auto& b : breaks) b(report);
  state->signature.clear();
  return report;
}

std::string take_deadlock(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(graph_mu());
  auto it = deadlocks().find(s);
  if (it == deadlocks().end()) return std::string();
  std::string report = std::move(it->second);
  deadlocks().erase(it);
  return report;
}

void flush_device(int device) {
  Runtime& r = runtime();
  std::vector<CUstream_st*> streams;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (CUstream_st* s : r.streams)
      if (device < 0 || s->device == device) streams.push_back(s);
    for (auto& s : r.default_streams)
      if (device < 0 || s->device == device) streams.push_back(s.get());
  }
  for (CUstream_st* s : streams) flush_stream(s);
}

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
  g_strict = false;
  if (parse_env("MGPU_EMU_STRICT", 0, 1, &v, &r.config_error)) g_strict = v == 1;
  if (parse_env("MGPU_EMU_STACK_KIB", 16, 1 << 20, &v, &r.config_error))
    g_stack_size = size_t(v) * 1024;
  r.peer_supported = true;
  if (parse_env("MGPU_EMU_PEER_ACCESS", 0, 1, &v, &r.config_error)) r.peer_supported = v == 1;
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

bool is_device_memory(const void* p) {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mu);
  return find_allocation(p, false) != nullptr;
}

cudaError_t check_owner(const char* api, const char* role, const void* p, int device) {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mu);
  auto* alloc = find_allocation(p, false);
  if (alloc == nullptr) return cudaSuccess;
  const int owner = alloc->second.device;
  if (owner < 0 || owner == device || r.peer[device][owner]) return cudaSuccess;
  // CUDA itself would stage such a copy through host memory (unified addressing); the strict
  // emulator refuses it, as mgpu moves data between devices only with cudaMemcpyPeerAsync.
  return fail(cudaErrorInvalidValue,
              cat(api, ": ", role, " ", ptr_str(p), " is ", where(*alloc),
                  ", but the stream belongs to device ", device,
                  ", which has no peer access to it (strict emulator); use cudaMemcpyPeerAsync"));
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

// Issues work on a stream: runs it now, or records it if the stream is capturing. In strict mode
// work on a stream other than the legacy default stream waits in the stream's queue until
// something synchronises with the stream, or one time in four runs (with what waits before it)
// at once, as far as it can without waiting (a collective whose other ranks have not arrived,
// or an event wait whose work another thread runs, stays queued): host code runs ahead, and
// streams interleave in a seeded random order, but the host never waits for a stream here. The legacy
// default stream's work (cudaMemcpy, cudaMemset) runs at once, as those calls are synchronous,
// but it does not wait for the non-blocking streams: nothing in CUDA makes it.
cudaError_t issue(const char* api, CUstream_st* s, bool legacy, Work work, uint64_t* position) {
  if (position != nullptr) *position = 0;
  if (s->capturing) {
    // Strict mode: work another thread issues into a capture (not begun in relaxed mode) is
    // refused. CUDA records it into the capturing thread's graph: it does not run now, and runs
    // at every replay, which is never what that other thread meant.
    if (g_strict.load() && s->mode != cudaStreamCaptureModeRelaxed &&
        s->capture_thread != std::this_thread::get_id()) {
      return fail(cudaErrorStreamCaptureWrongThread,
                  cat(api, ": issued into a stream of device ", s->device,
                      " that another thread is capturing; on a GPU it would be recorded into "
                      "that thread's graph instead of run (strict emulator)"));
    }
    s->recorded.push_back(std::move(work));
    return cudaSuccess;
  }
  if (legacy) {
    if (cudaError_t e = check_capture_safe(api, cudaErrorStreamCaptureImplicit)) return e;
  }
  if (!g_strict.load() || legacy) return work();
  const uint64_t at = push_pending(s, std::move(work));
  if (position != nullptr) *position = at;
  if (strict_draw() % 4 == 0) {
    bool ran = false;
    run_until_blocked(s, &ran);
  }
  return cudaSuccess;
}

// ---- The emulator's settings ---------------------------------------------------------------
const std::string& last_error_detail() { return tls.detail; }

void reset_from_env() {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& s : r.default_streams) s->pending.clear();  // strict mode's unrun work is dropped
  for (auto& [base, alloc] : r.allocations) std::free(reinterpret_cast<void*>(base));
  r.allocations.clear();
  {
    std::lock_guard<std::mutex> graph(graph_mu());
    blocked_items().clear();
    deadlocks().clear();
  }
  r.retired.clear();
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
  r.configured = false;
  configure_locked();
  tls = ThreadState{};
}

void set_seed(uint64_t s) { g_seed = s; }

LiveCounts live_counts() {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  LiveCounts c;
  c.streams = r.streams.size();
  c.events = r.events.size();
  c.graphs = r.graphs.size();
  c.graph_execs = r.execs.size();
  for (const auto& [base, alloc] : r.allocations) {
    if (alloc.device < 0) {
      ++c.host_allocations;
      c.host_bytes += alloc.size;
    } else {
      ++c.device_allocations;
      c.device_bytes += alloc.size;
    }
  }
  return c;
}

bool strict() {
  runtime();  // configured from the environment
  return g_strict.load();
}

}  // namespace mgpu::emu
