// cpp/core/trace.h -- the timeline: spans of every device queue's tasks, each layer's
// forward and backward, all-reduce buckets, copies and waits, written as a Chrome/Perfetto trace.
// Off (the default), a span site costs one relaxed atomic load: no clock read, no allocation. On,
// each thread appends to its own buffer (no lock per event); stop() gathers them once.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace mgpu::trace {

namespace detail {
extern std::atomic<bool> g_on;
}  // namespace detail

inline bool on() { return detail::g_on.load(std::memory_order_relaxed); }

// Nanoseconds of CLOCK_MONOTONIC (std::chrono::steady_clock), the clock of Python's
// time.monotonic_ns(), so spans recorded from Python line up with the engine's.
int64_t now_ns();

// Interned strings (span names and track names): the id is stable for the process. Slow path
// only (a thread-local cache in front of a locked table): called where tracing is on.
uint32_t intern(const std::string& s);

// The track the calling thread records on: a device queue's worker names its own (and switches
// to "<device> comm" while it runs a collective); any other thread gets "host" (the first one to
// record, normally Python's main thread) or "host thread N".
void set_thread_track(const std::string& name);
uint32_t thread_track();
void set_thread_track_id(uint32_t track);

// Appends one complete span on `track`. `name` is a string literal (or nullptr), `label` an
// interned id (0: none); the span is called by its label when name is null, else by name with
// the label as its "label" argument. Device tasks with the same label in a row are wrapped, at
// stop(), in one span called by the label (a layer's forward made of several ops).
// `task` marks a device queue's task.
void record(uint32_t track, const char* name, uint32_t label, int64_t t0, int64_t t1,
            bool task = false);

// The label the calling thread gives the tasks it enqueues (0: none); see Label.
uint32_t current_label();

// Starts a session (clearing what an earlier one kept). Throws ValueError if one is running.
void start();
// Ends the session and returns its events as the body of a JSON array (Chrome trace events,
// comma separated, "M" metadata naming the process `pid` as `process_name` and every track),
// ts and dur in microseconds. Callers wait for the devices first (waitall) so no task is cut.
std::string stop(int pid, const std::string& process_name);
bool running();

// A span of the calling thread's track from construction to destruction.
class Span {
 public:
  explicit Span(const char* name) : name_(name), t0_(on() ? now_ns() : 0) {}
  // A span called by a string built only when tracing is on: what(arg) is called then.
  template <typename Fn>
  Span(const char* name, Fn&& what) : name_(name), t0_(on() ? now_ns() : 0) {
    if (t0_) label_ = intern(what());
  }
  ~Span() {
    if (t0_) record(thread_track(), name_, label_, t0_, now_ns());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  int64_t t0_;
  uint32_t label_ = 0;
};

// Labels the device tasks the calling thread enqueues in its scope ("conv1 forward",
// "allreduce bucket 2") and records the enqueueing itself as a span of the thread's track
// (on GPUs, the host-side cost of the layer). Scopes nest: the innermost label wins.
class Label {
 public:
  template <typename Fn>
  explicit Label(Fn&& what) {
    if (on()) begin(what());
  }
  ~Label() {
    if (t0_) end();
  }
  Label(const Label&) = delete;
  Label& operator=(const Label&) = delete;

 private:
  void begin(const std::string& what);
  void end();
  int64_t t0_ = 0;
  uint32_t label_ = 0, previous_ = 0;
};

}  // namespace mgpu::trace
