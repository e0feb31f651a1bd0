// cpp/core/trace.cpp -- per-thread event buffers and their gathering into Chrome trace JSON.
// A buffer is written by its thread only: fixed chunks (never moved) and a count published with
// release, so stop() reads what was published without stopping anyone. A session bumps a
// generation; a thread finding its buffer from an older one empties it itself.
#include "core/trace.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace mgpu::trace {
namespace detail {
std::atomic<bool> g_on{false};
}  // namespace detail

namespace {

struct Event {
  int64_t t0, t1;
  const char* name;
  uint32_t label, track;
  bool task;
};

constexpr size_t kChunk = 4096, kMaxChunks = 2048;  // up to 8M events per thread and session

struct Buffer {
  std::atomic<uint64_t> generation{0};
  std::atomic<size_t> count{0};
  std::atomic<Event*> chunks[kMaxChunks] = {};
  std::atomic<uint64_t> dropped{0};
};

struct Registry {
  std::mutex mutex;
  std::vector<std::string> strings{""};  // id 0: no label
  std::unordered_map<std::string, uint32_t> ids{{"", 0}};
  std::vector<Buffer*> buffers;  // never freed: a thread may be writing to its own at any time
  int host_threads = 0;
  bool running = false;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed, as the queues' registry
  return *r;
}

std::atomic<uint64_t> g_generation{1};

thread_local Buffer* t_buffer = nullptr;
thread_local uint32_t t_track = 0;
thread_local uint32_t t_label = 0;
thread_local std::unordered_map<std::string, uint32_t>* t_cache = nullptr;

Buffer& own_buffer() {
  if (!t_buffer) {
    t_buffer = new Buffer;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.buffers.push_back(t_buffer);
  }
  return *t_buffer;
}

void append_escaped(std::string& out, const std::string& s) {
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
}

void append_us(std::string& out, int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += buf;
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint32_t intern(const std::string& s) {
  if (!t_cache) t_cache = new std::unordered_map<std::string, uint32_t>;
  auto hit = t_cache->find(s);
  if (hit != t_cache->end()) return hit->second;
  Registry& r = registry();
  uint32_t id;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto [it, fresh] = r.ids.emplace(s, static_cast<uint32_t>(r.strings.size()));
    if (fresh) r.strings.push_back(s);
    id = it->second;
  }
  t_cache->emplace(s, id);
  return id;
}

void set_thread_track(const std::string& name) { t_track = intern(name); }
void set_thread_track_id(uint32_t track) { t_track = track; }

uint32_t thread_track() {
  if (!t_track) {
    int n;
    {
      Registry& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      n = r.host_threads++;
    }
    t_track = intern(n == 0 ? std::string("host") : "host thread " + std::to_string(n));
  }
  return t_track;
}

uint32_t current_label() { return t_label; }

void record(uint32_t track, const char* name, uint32_t label, int64_t t0, int64_t t1,
            bool task) {
  Buffer& b = own_buffer();
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (b.generation.load(std::memory_order_relaxed) != gen) {
    b.count.store(0, std::memory_order_release);
    b.dropped.store(0, std::memory_order_relaxed);
    b.generation.store(gen, std::memory_order_release);
  }
  const size_t n = b.count.load(std::memory_order_relaxed);
  const size_t c = n / kChunk;
  if (c >= kMaxChunks) {
    b.dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Event* chunk = b.chunks[c].load(std::memory_order_relaxed);
  if (!chunk) {
    chunk = new Event[kChunk];
    b.chunks[c].store(chunk, std::memory_order_release);
  }
  chunk[n % kChunk] = Event{t0, t1, name, label, track, task};
  b.count.store(n + 1, std::memory_order_release);
}

void Label::begin(const std::string& what) {
  label_ = intern(what);
  previous_ = t_label;
  t_label = label_;
  t0_ = now_ns();
}

void Label::end() {
  t_label = previous_;
  record(thread_track(), nullptr, label_, t0_, now_ns());
}

void start() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  MGPU_CHECK_VALUE(!r.running, "trace: a profile is already being recorded; leave the running "
                   "mgpu.profile() (or unset MGPU_TRACE) before starting another");
  r.running = true;
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  detail::g_on.store(true, std::memory_order_release);
}

bool running() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.running;
}

std::string stop(int pid, const std::string& process_name) {
  detail::g_on.store(false, std::memory_order_release);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  MGPU_CHECK_VALUE(r.running, "trace: no profile is being recorded");
  r.running = false;
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  // Events by track, in time order; a track belongs to one thread (a worker's comm track too).
  std::unordered_map<uint32_t, std::vector<Event>> by_track;
  uint64_t dropped = 0;
  for (Buffer* b : r.buffers) {
    if (b->generation.load(std::memory_order_acquire) != gen) continue;
    const size_t n = b->count.load(std::memory_order_acquire);
    dropped += b->dropped.load(std::memory_order_relaxed);
    for (size_t i = 0; i < n; ++i) {
      const Event& e = b->chunks[i / kChunk].load(std::memory_order_acquire)[i % kChunk];
      by_track[e.track].push_back(e);
    }
  }
  std::string out;
  const std::string pid_s = std::to_string(pid);
  auto meta = [&](const char* what, const std::string& tid, const std::string& key,
                  const std::string& value, bool quoted) {
    if (!out.empty()) out += ",\n";
    out += "{\"ph\":\"M\",\"name\":\"";
    out += what;
    out += "\",\"pid\":" + pid_s + (tid.empty() ? "" : ",\"tid\":" + tid) + ",\"args\":{\"" + key +
           "\":";
    if (quoted) out += '"';
    append_escaped(out, value);
    if (quoted) out += '"';
    out += "}}";
  };
  meta("process_name", "", "name", process_name, true);
  meta("process_sort_index", "", "sort_index", pid_s, false);
  if (dropped) meta("process_labels", "", "labels", std::to_string(dropped) + " events dropped "
                    "(a thread's buffer was full)", true);
  // Tracks in name order, "host" first: devices then sort as cpu(0), cpu(0) comm, cpu(1), ...
  std::vector<uint32_t> tracks;
  for (auto& [t, evs] : by_track) tracks.push_back(t);
  std::sort(tracks.begin(), tracks.end(), [&](uint32_t a, uint32_t b) {
    const std::string &x = r.strings[a], &y = r.strings[b];
    const bool hx = x.rfind("host", 0) == 0, hy = y.rfind("host", 0) == 0;
    return hx != hy ? hx : x < y;
  });
  auto span = [&](const Event& e, uint32_t track, bool group) {
    out += ",\n{\"ph\":\"X\",\"pid\":" + pid_s + ",\"tid\":" + std::to_string(track) +
           ",\"name\":\"";
    append_escaped(out, e.name ? std::string(e.name) : r.strings[e.label]);
    out += "\",\"cat\":\"";
    out += group ? "layer" : e.task ? "task" : e.name ? "span" : "scope";
    out += "\",\"ts\":";
    append_us(out, e.t0);
    out += ",\"dur\":";
    append_us(out, std::max<int64_t>(0, e.t1 - e.t0));
    if (e.name && e.label) {
      out += ",\"args\":{\"label\":\"";
      append_escaped(out, r.strings[e.label]);
      out += "\"}";
    }
    out += "}";
  };
  for (size_t i = 0; i < tracks.size(); ++i) {
    const uint32_t t = tracks[i];
    meta("thread_name", std::to_string(t), "name", r.strings[t], true);
    meta("thread_sort_index", std::to_string(t), "sort_index", std::to_string(i), false);
    std::vector<Event>& evs = by_track[t];
    // Outer spans first where two start together, so viewers nest them.
    std::stable_sort(evs.begin(), evs.end(), [](const Event& a, const Event& b) {
      return a.t0 != b.t0 ? a.t0 < b.t0 : a.t1 > b.t1;
    });
    // Labelled tasks in a row (top-level on their track) are wrapped in one span called by the
    // label: the ops of one layer's forward make one "conv1 forward" span.
    std::vector<Event> groups;
    int64_t top_end = INT64_MIN;
    bool open = false;
    Event g{};
    for (const Event& e : evs) {
      if (e.t0 < top_end) continue;  // nested inside the previous top-level span
      top_end = e.t1;
      if (e.task && e.label && open && g.label == e.label) {
        g.t1 = e.t1;
        continue;
      }
      if (open) groups.push_back(g);
      open = e.task && e.label;
      g = Event{e.t0, e.t1, nullptr, e.label, t, false};
    }
    if (open) groups.push_back(g);
    for (const Event& w : groups) span(w, t, true);
    for (const Event& e : evs) span(e, t, false);
  }
  return out;
}

}  // namespace mgpu::trace
