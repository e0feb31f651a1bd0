// cpp/core/storage.cpp -- the CPU caching allocator behind Storage::allocate.
// Blocks are rounded up to a size class and kept on a free list when released, so a training
// step that allocates the same activations every time reuses them instead of asking the system
// (large malloc/free pairs would otherwise mmap and page-fault on every step).
#include "core/storage.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <map>
#include <vector>

#include "core/error.h"
#include "core/gpu.h"

namespace mgpu {
namespace {

constexpr size_t kAlign = 64;
// Blocks up to this size are "small" to the steady-state trace (see cpu_trace_end).
constexpr size_t kSmallClass = 64 * 1024;

// Size classes: multiples of 64 B up to 4 KiB, then a quarter-power-of-two ladder so rounding
// wastes at most ~19 % while sizes that repeat every step land on the same list.
size_t size_class(size_t n) {
  if (n <= 4096) return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign;
  size_t p = 4096;
  while (p * 2 < n) p *= 2;
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

struct CpuCache {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free_lists;  // by size class
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
    p = std::aligned_alloc(kAlign, cap);
    if (!p) {
      cpu_empty_cache();
      p = std::aligned_alloc(kAlign, cap);
    }
    if (!p) {
      std::lock_guard<std::mutex> lock(c.mutex);
      c.live[cap] -= 1;
    }
    if (!p)
      throw OutOfMemoryError(detail::cat("out of memory: the system refused ",
                                         describe_bytes(cap), " on ", device,
                                         "; use smaller batches or free tensors"));
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
  c.free_lists[capacity_].push_back(data_);
  c.live[capacity_] -= 1;
  c.cached += capacity_;
  c.stats.allocated -= capacity_;
}

size_t cpu_cached_bytes() {
  CpuCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.cached;
}

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
  for (auto& [cap, list] : c.free_lists)
    for (void* p : list) std::free(p);
  c.free_lists.clear();
  c.cached = 0;
}

}  // namespace mgpu
