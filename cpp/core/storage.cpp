// cpp/core/storage.cpp -- the CPU caching allocator behind Storage::allocate.
// Blocks up to 1 MiB are rounded up to a size class and kept on that class's free list when
// released, so a training step that allocates the same tensors every time reuses them instead of
// asking the system. Larger blocks (activations, workspaces) come from an arena: segments taken
// from the system once, cut best-fit into blocks, whose neighbours merge again when released. A
// per-class cache would hold, for every large size, the most blocks of that size ever live at
// once, although the sizes peak at different times (a ResNet's 28x28 activations at the end of
// forward, its 7x7 ones earlier): the arena holds about the most bytes live at once instead.
#include "core/storage.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <iterator>
#include <map>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/gpu.h"

namespace mgpu {
namespace {

constexpr size_t kAlign = 64;
// Blocks up to this size are "small" to the steady-state trace (see cpu_trace_end).
constexpr size_t kSmallClass = 64 * 1024;

// Blocks over this size come from the arena, rounded up to kArenaGrain; fresh segments hold at
// least kSegmentBytes (address space: the system backs a page only once it is written). A step's
// blocks land all over the segments it needed, so after a few steps every page of them is
// resident: what the arena holds beyond the step's peak is resident too, up to one segment. At
// 64 MiB, 2 devices of ResNet-18's fused step (batch 256) held 1232 MiB for a 1156 MiB peak, 1
// device 1161-1225 for 1022 (2 devices at 256 MiB: 1296 for 1161; 32, 96 and 128 MiB did worse
// on one of the two: how a step's blocks fragment the segments depends on their sizes).
constexpr size_t kArenaMin = size_t{1} << 20;
constexpr size_t kArenaGrain = 64 * 1024;
constexpr size_t kSegmentBytes = size_t{64} << 20;

// Size classes: multiples of 64 B up to 4 KiB, then a quarter-power-of-two ladder so rounding
// wastes at most ~19 % while sizes that repeat every step land on the same list. Over kArenaMin:
// multiples of kArenaGrain (an arena block).
size_t size_class(size_t n) {
  if (n <= 4096) return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign;
  if (n > kArenaMin) return (n + kArenaGrain - 1) / kArenaGrain * kArenaGrain;
  size_t p = 4096;
  while (p * 2 < n) p *= 2;
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

bool in_arena(size_t cap) { return cap > kArenaMin; }

// A piece of an arena segment: handed out, or free (then also in CpuCache::free_chunks).
struct Chunk {
  size_t size;
  bool free;
  char* segment;  // the base of the segment it lies in: chunks merge only within one
};

struct CpuCache {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free_lists;  // by size class (up to kArenaMin)
  std::map<char*, Chunk> chunks;                     // the arena's, by address
  std::set<std::pair<size_t, char*>> free_chunks;    // the free ones by (size, address)
  std::map<char*, size_t> segments;                  // base -> bytes
  std::map<size_t, size_t> live;   // blocks handed out and not yet released, per size class
  bool tracing = false;
  // While tracing, per size class: the most blocks live at once, the requests, and the blocks
  // live when tracing began.
  std::map<size_t, size_t> trace_peak, trace_requests;
  size_t cached = 0;
  CpuMemoryStats stats;  // all but cached
};

CpuCache& cache() {
  static CpuCache* c = new CpuCache;  // never destroyed: tensors may outlive static destructors
  return *c;
}

// The smallest free chunk that holds cap bytes (the lowest address among equals), cut to cap;
// null when none does. Caller holds the mutex.
char* arena_take(CpuCache& c, size_t cap) {
  auto it = c.free_chunks.lower_bound({cap, nullptr});
  if (it == c.free_chunks.end()) return nullptr;
  char* p = it->second;
  c.free_chunks.erase(it);
  Chunk& ch = c.chunks.at(p);
  if (ch.size > cap) {  // the rest stays free
    const size_t rest = ch.size - cap;
    c.chunks.emplace(p + cap, Chunk{rest, true, ch.segment});
    c.free_chunks.insert({rest, p + cap});
    ch.size = cap;
  }
  ch.free = false;
  c.cached -= cap;
  return p;
}

// A new segment of `bytes` (from the system), all of it one free chunk. Caller holds the mutex.
void arena_add(CpuCache& c, char* base, size_t bytes) {
  c.segments.emplace(base, bytes);
  c.chunks.emplace(base, Chunk{bytes, true, base});
  c.free_chunks.insert({bytes, base});
  c.cached += bytes;
  c.stats.system_mallocs += 1;
  c.stats.system_bytes += bytes;
}

// Frees the chunk at p, merged with free neighbours of its segment. Caller holds the mutex.
void arena_give(CpuCache& c, char* p) {
  auto it = c.chunks.find(p);
  MGPU_ASSERT(it != c.chunks.end() && !it->second.free, "arena: releasing an unknown block");
  it->second.free = true;
  c.cached += it->second.size;
  auto joins = [](const std::pair<char* const, Chunk>& a, const std::pair<char* const, Chunk>& b) {
    return a.second.segment == b.second.segment && a.first + a.second.size == b.first;
  };
  auto next = std::next(it);
  if (next != c.chunks.end() && next->second.free && joins(*it, *next)) {
    c.free_chunks.erase({next->second.size, next->first});
    it->second.size += next->second.size;
    c.chunks.erase(next);
  }
  if (it != c.chunks.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && joins(*prev, *it)) {
      c.free_chunks.erase({prev->second.size, prev->first});
      prev->second.size += it->second.size;
      c.chunks.erase(it);
      it = prev;
    }
  }
  c.free_chunks.insert({it->second.size, it->first});
}

// A block of cap (a multiple of kArenaGrain) from the arena, growing it when no free chunk
// holds cap; null when the system refuses.
void* arena_allocate(CpuCache& c, size_t cap) {
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (char* p = arena_take(c, cap)) return p;
  }
  // A fresh segment of at least kSegmentBytes, or exactly cap when the system refuses that.
  size_t bytes = std::max(cap, kSegmentBytes);
  void* base = std::aligned_alloc(4096, bytes);
  if (!base && bytes > cap) base = std::aligned_alloc(4096, bytes = cap);
  if (!base) return nullptr;
  std::lock_guard<std::mutex> lock(c.mutex);
  arena_add(c, static_cast<char*>(base), bytes);
  return arena_take(c, cap);  // another thread may have taken the new chunk: then another fits
}

}  // namespace

// "1.5 GiB (1610612736 bytes)": sizes in messages a user can act on.
std::string describe_bytes(size_t n) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  std::ostringstream out;
  out.precision(u ? 3 : 0);
  out << std::fixed << v << ' ' << units[u];
  if (u) out << " (" << n << " bytes)";
  return out.str();
}

namespace {

// alloc(), and where the system refuses, alloc() again after the cache's free blocks went back.
template <class Alloc>
void* retry_after_emptying_cache(const Alloc& alloc) {
  void* p = alloc();
  if (!p) {
    cpu_empty_cache();
    p = alloc();
  }
  return p;
}

[[noreturn]] void throw_refused(size_t cap, Device device) {
  throw OutOfMemoryError(detail::cat("out of memory: the system refused ", describe_bytes(cap),
                                     " on ", device, "; use smaller batches or free tensors"));
}

}  // namespace

std::shared_ptr<Storage> Storage::allocate(Device device, size_t nbytes) {
  // Past this, size classes would overflow; no machine has the memory anyway.
  constexpr size_t kMaxBytes = size_t{1} << 56;
  if (nbytes > kMaxBytes)
    throw OutOfMemoryError(detail::cat("out of memory: ", describe_bytes(nbytes), " requested on ",
                                       device, ", more than any machine holds"));
  if (!device.is_cpu()) {
    size_t capacity = 0;
    void* p = gpu::allocate(device.index, nbytes, &capacity);
    return std::shared_ptr<Storage>(new Storage(device, p, nbytes, capacity, nullptr));
  }
  size_t cap = size_class(nbytes);
  void* p = nullptr;
  CpuCache& c = cache();
  if (in_arena(cap)) {
    p = retry_after_emptying_cache([&] { return arena_allocate(c, cap); });
    if (!p) throw_refused(cap, device);
    std::lock_guard<std::mutex> lock(c.mutex);
    c.stats.allocated += cap;
    c.stats.peak_allocated = std::max(c.stats.peak_allocated, c.stats.allocated);
    return std::shared_ptr<Storage>(new Storage(device, p, nbytes, cap, nullptr));
  }
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    const size_t live = ++c.live[cap];
    if (c.tracing) {
      size_t& most = c.trace_peak[cap];
      most = std::max(most, live);
      c.trace_requests[cap] += 1;
    }
    auto it = c.free_lists.find(cap);
    if (it != c.free_lists.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      c.cached -= cap;
      c.stats.allocated += cap;
      c.stats.peak_allocated = std::max(c.stats.peak_allocated, c.stats.allocated);
    }
  }
  if (!p) {
    p = retry_after_emptying_cache([&] { return std::aligned_alloc(kAlign, cap); });
    if (!p) {
      {
        std::lock_guard<std::mutex> lock(c.mutex);
        c.live[cap] -= 1;
      }
      throw_refused(cap, device);
    }
    std::lock_guard<std::mutex> lock(c.mutex);
    c.stats.allocated += cap;
    c.stats.peak_allocated = std::max(c.stats.peak_allocated, c.stats.allocated);
    c.stats.system_mallocs += 1;
    c.stats.system_bytes += cap;
  }
  return std::shared_ptr<Storage>(new Storage(device, p, nbytes, cap, nullptr));
}

std::shared_ptr<Storage> Storage::wrap(Device device, void* data, size_t nbytes,
                                       std::function<void()> release) {
  auto s = std::shared_ptr<Storage>(new Storage(device, data, nbytes, 0, std::move(release)));
  s->mark_written();  // its owner filled it
  return s;
}

Storage::~Storage() {
  if (release_) {
    release_();
    return;
  }
  if (capacity_ == 0) return;
  if (!device_.is_cpu()) {
    gpu::release(device_.index, data_, capacity_);
    return;
  }
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.stats.allocated -= capacity_;
  if (in_arena(capacity_)) {
    arena_give(c, static_cast<char*>(data_));
    return;
  }
  c.free_lists[capacity_].push_back(data_);
  c.live[capacity_] -= 1;
  c.cached += capacity_;
}

size_t cpu_cached_bytes() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.cached;
}

// The counters count arena blocks in multiples of 64 KiB; cached includes the arena's free
// chunks, system_mallocs / system_bytes its segments (address space until written).
CpuMemoryStats cpu_memory_stats() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  CpuMemoryStats out = c.stats;
  out.cached = c.cached;
  return out;
}

void cpu_reset_peak_memory() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.stats.peak_allocated = c.stats.allocated;
}

void cpu_trace_begin() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.tracing = true;
  c.trace_peak.clear();
  c.trace_requests.clear();
}

std::map<size_t, size_t> cpu_trace_end() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.tracing = false;
  // Small classes: every request (cpu_reserve keeps that many free: no timing can need more, and
  // it costs little). Large ones: the most live at once, which bounds the cache's memory; it
  // depends on how far the host ran ahead of the devices, which the queues' byte budget bounds.
  std::map<size_t, size_t> out;
  for (const auto& [cap, peak] : c.trace_peak) {
    out[cap] = cap <= kSmallClass ? c.trace_requests[cap] : peak;
  }
  return out;
}

void cpu_reserve(const std::map<size_t, size_t>& blocks) {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (const auto& [cap, want] : blocks) {
    MGPU_CHECK_VALUE(cap == size_class(cap), "cpu_reserve: ", cap, " bytes is not a size class");
    // The arena keeps every segment the traced step took (a trace holds no arena sizes).
    if (in_arena(cap)) continue;
    std::vector<void*>& list = c.free_lists[cap];
    // Small classes want that many free blocks, large ones that many live or free.
    auto held = c.live.find(cap);
    const size_t live = cap <= kSmallClass || held == c.live.end() ? 0 : held->second;
    while (list.size() + live < want) {
      void* p = std::aligned_alloc(kAlign, cap);
      if (!p) return;  // the reserve is an optimisation: later allocations report the shortage
      list.push_back(p);
      c.cached += cap;
      c.stats.system_mallocs += 1;
      c.stats.system_bytes += cap;
    }
  }
}

void cpu_empty_cache() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto& [cap, list] : c.free_lists) {
    for (void* p : list) std::free(p);
    c.cached -= cap * list.size();
  }
  c.free_lists.clear();
  // Arena segments that are one free chunk go back too; the others stay whole.
  for (auto it = c.segments.begin(); it != c.segments.end();) {
    auto ch = c.chunks.find(it->first);
    if (!ch->second.free || ch->second.size != it->second) {
      ++it;
      continue;
    }
    c.free_chunks.erase({it->second, it->first});
    c.chunks.erase(ch);
    c.cached -= it->second;
    std::free(it->first);
    it = c.segments.erase(it);
  }
}

}  // namespace mgpu
