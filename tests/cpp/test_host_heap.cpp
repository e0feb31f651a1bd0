// tests/cpp/test_host_heap.cpp -- the fused step's host-heap use in steady state. This binary's
// operator new and delete count every host allocation (the device allocator is checked elsewhere:
// tests/test_concise_step.py's steady-state test): a residual net with batch norm on two CPU
// replicas, after its first steps, must not hold more host memory as steps go on (no per-step
// leak of task closures, trace labels or vectors), and the number of host allocations per step is
// reported.
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "core/queue.h"
#include "ops/elementwise.h"
#include "train/model.h"
#include "train/train_batch.h"

namespace {
std::atomic<int64_t> g_news{0};
std::atomic<int64_t> g_live{0};  // bytes of live blocks from operator new (usable sizes)

void* counted_new(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (!p) throw std::bad_alloc();
  g_news.fetch_add(1, std::memory_order_relaxed);
  g_live.fetch_add(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
  return p;
}
void counted_delete(void* p) noexcept {
  if (!p) return;
  g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
  std::free(p);
}
}  // namespace

// Every plain (not over-aligned) form of new and delete in this binary goes through the counters.
void* operator new(size_t n) { return counted_new(n); }
void* operator new[](size_t n) { return counted_new(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { counted_delete(p); }
void operator delete[](void* p) noexcept { counted_delete(p); }
void operator delete(void* p, size_t) noexcept { counted_delete(p); }
void operator delete[](void* p, size_t) noexcept { counted_delete(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counted_delete(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_delete(p); }

namespace mgpu {
namespace {

Device cpu(int i) { return Device{DeviceKind::CPU, i}; }

Tensor filled(Shape s, float start, float step, Device d) {
  Tensor t = Tensor::empty(s, DType::F32, d);
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.f32()[i] = start + step * static_cast<float>(i % 97);
  }
  return t;
}

train::LayerSpec layer(std::string kind, std::vector<int64_t> in = {},
                       std::map<std::string, double> o = {}) {
  return {std::move(kind), std::move(in), std::move(o), {}, {}};
}

TEST(HostHeap, SteadyFusedStepsHoldNoMoreHostMemoryAsStepsGoOn) {
  // conv -> bn -> relu (slot 3) -> conv -> bn -> add(slot 3) -> relu -> pool -> flatten -> linear.
  std::vector<train::LayerSpec> spec = {
      layer("conv2d", {}, {{"padding", 1}}), layer("batch_norm"), layer("relu"),
      layer("conv2d", {}, {{"padding", 1}, {"bias", 0}}), layer("batch_norm"),
      layer("add", {5, 3}), layer("relu"), layer("global_avg_pool"), layer("flatten"),
      layer("linear", {}, {{"transpose", 1}})};
  const std::vector<Shape> params = {{8, 1, 3, 3}, {8}, {8}, {8}, {8, 8, 3, 3}, {8}, {8},
                                     {10, 8}, {10}};
  const std::vector<Shape> buffers = {{8}, {8}, {8}, {8}};
  const train::Model m(spec, params, buffers);
  std::vector<train::Replica> replicas;
  for (int d = 0; d < 2; ++d) {
    train::Replica r{cpu(d), {}, {}, {}, {}, {}};
    float at = 0.01f;
    for (const Shape& s : params) r.state.params.push_back(filled(s, -at, at / 50, cpu(d)));
    for (size_t b = 0; b < buffers.size(); ++b) {
      r.state.buffers.push_back(filled(buffers[b], b % 2 ? 1.0f : 0.0f, 0.0f, cpu(d)));
    }
    replicas.push_back(std::move(r));
  }
  Tensor X = filled({16, 1, 12, 12}, -1.0f, 0.02f, cpu(0));
  Tensor y = Tensor::empty({16}, DType::I64, cpu(0));
  for (int64_t i = 0; i < 16; ++i) y.data<int64_t>()[i] = i % 10;
  train::Sgd sgd;
  sgd.lr = 0.05f;
  sgd.momentum = 0.9f;
  sgd.weight_decay = 1e-4f;
  auto step = [&] {
    std::vector<Tensor> losses = train::train_step(m, X, y, replicas, sgd);
    for (int d = 0; d < 2; ++d) queue_of(cpu(d)).synchronize();
  };
  for (int i = 0; i < 3; ++i) step();  // caches, reserves and thread-locals settle
  constexpr int kSteps = 600;
  std::vector<int64_t> live, news;  // reserved: their own growth would count as the step's
  live.reserve(kSteps);
  news.reserve(kSteps);
  for (int i = 0; i < kSteps; ++i) {
    const int64_t n0 = g_news.load();
    step();
    news.push_back(g_news.load() - n0);
    live.push_back(g_live.load());
  }
  // Blocks freed a moment after the wait returns (a worker dropping its last task) make single
  // readings wobble by a few blocks, and a container may grow once (about 1 KB seen), so the
  // medians of the first and last 100 steps are compared against 4 KB: the smallest heap block
  // (24 usable bytes) leaked once per step moves the median by 12 KB.
  auto median = [](std::vector<int64_t> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  const int64_t early = median({live.begin(), live.begin() + 100});
  const int64_t late = median({live.end() - 100, live.end()});
  EXPECT_LE(late - early, 4096) << "host bytes held grew from a median of " << early
                               << " (steps 4-103) to " << late << " (steps " << kSteps - 96
                               << "-" << kSteps + 3 << "): a per-step leak";
  EXPECT_GT(news[0], 0);  // the counters see the step's allocations (task closures, vectors)
  ::testing::Test::RecordProperty("host_allocations_per_step", static_cast<int>(news.back()));
  std::printf("host allocations per steady fused step (2 replicas, 10 layers): %lld\n",
              static_cast<long long>(news.back()));
}

}  // namespace
}  // namespace mgpu
