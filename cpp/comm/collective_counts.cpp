// cpp/comm/collective_counts.cpp -- the process-wide counters of collective_counts.h.
#include "comm/collective_counts.h"

#include <atomic>

namespace mgpu::comm {
namespace {

std::atomic<int64_t> g_calls{0}, g_bytes{0};

}  // namespace

void count_collective(int64_t bytes) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

CollectiveCounts collective_counts() {
  return {g_calls.load(std::memory_order_relaxed), g_bytes.load(std::memory_order_relaxed)};
}

}  // namespace mgpu::comm
