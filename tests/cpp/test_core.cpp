// tests/cpp/test_core.cpp -- the engine's core: queues keep order and carry errors, copies between
// devices are ordered on both sides, the thread all-reduce sums exactly, the allocator reuses.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "comm/allreduce.h"
#include "core/parallel.h"
#include "core/queue.h"
#include "core/tensor.h"
#include "ops/elementwise.h"
#include "train/split_batch.h"

namespace mgpu {
namespace {

Device cpu(int i) { return Device{DeviceKind::CPU, i}; }

Tensor filled(Shape s, float v, Device d) {
  Tensor t = Tensor::empty(s, DType::F32, d);
  ops::fill(t, v);
  return t;
}

std::vector<float> values(const Tensor& t) {
  queue_of(t.device()).synchronize();
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

TEST(Queue, RunsTasksInOrderAndWaits) {
  std::vector<int> seen;
  Queue& q = queue_of(cpu(5));
  for (int i = 0; i < 100; ++i) q.enqueue("push", [&seen, i] { seen.push_back(i); });
  q.synchronize();
  ASSERT_EQ(seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
}

TEST(Queue, KeepsTheFirstErrorWithOpAndDeviceAndRaisesItOnce) {
  Queue& q = queue_of(cpu(6));
  q.enqueue("first_op", [] { throw ValueError("bad thing"); });
  q.enqueue("second_op", [] { throw ValueError("later thing"); });
  try {
    q.synchronize();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("first_op on cpu(6) failed: bad thing"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(q.synchronize());  // reported once, and the queue still works
  int ran = 0;
  q.enqueue("ok", [&ran] { ran = 1; });
  q.synchronize();
  EXPECT_EQ(ran, 1);
}

TEST(Queue, BackpressureBoundsTheBacklog) {
  Queue& q = queue_of(cpu(7));
  std::atomic<bool> release{false};
  q.enqueue("hold", [&release] { while (!release) std::this_thread::yield(); });
  std::atomic<int> enqueued{0};
  std::thread producer([&] {
    for (uint64_t i = 0; i < Queue::kMaxPending + 10; ++i) {
      q.enqueue("noop", [] {});
      ++enqueued;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LE(enqueued.load(), static_cast<int>(Queue::kMaxPending));
  release = true;
  producer.join();
  q.synchronize();
  EXPECT_EQ(enqueued.load(), static_cast<int>(Queue::kMaxPending + 10));
}

TEST(Copy, BetweenDevicesIsOrderedOnBothQueues) {
  // Bounce a value between two devices, adding one on each: any reordering loses an increment.
  Tensor a = filled({1000}, 0.0f, cpu(0));
  for (int hop = 0; hop < 200; ++hop) {
    Tensor b = ops::to_device(a, cpu(hop % 2 ? 0 : 1), true);
    ops::binary_scalar_inplace(ops::BinaryOp::Add, b, 1.0f);
    a = b;
  }
  for (float v : values(a)) ASSERT_EQ(v, 200.0f);
}

TEST(Copy, SourceIsNotOverwrittenBeforeTheCopyReadsIt) {
  Tensor src = filled({1 << 16}, 1.0f, cpu(0));
  Tensor dst = Tensor::empty({1 << 16}, DType::F32, cpu(1));
  ops::copy(dst, src);
  ops::fill(src, 5.0f);  // a later write on the source's queue
  for (float v : values(dst)) ASSERT_EQ(v, 1.0f);
  for (float v : values(src)) ASSERT_EQ(v, 5.0f);
}

TEST(Allreduce, DeviceIHoldingIPlusOneEndsWithTheTriangleNumber) {
  for (int k = 1; k <= 4; ++k) {
    for (int64_t n : {1, 7, 100003}) {
      std::vector<std::vector<Tensor>> data;
      for (int i = 0; i < k; ++i) data.push_back({filled({n}, float(i + 1), cpu(i))});
      comm::allreduce(data);
      for (auto& d : data)
        for (float v : values(d[0])) ASSERT_EQ(v, k * (k + 1) / 2.0f) << "k=" << k << " n=" << n;
    }
  }
}

TEST(Allreduce, WaitsForEveryProducerBeforeReading) {
  // Device 1 is slow to produce its buffer; the collective must still see its final values.
  Tensor a = filled({4096}, 1.0f, cpu(0));
  Tensor b = Tensor::empty({4096}, DType::F32, cpu(1));
  float* bp = b.f32();
  queue_of(cpu(1)).enqueue("slow", [bp] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (int i = 0; i < 4096; ++i) bp[i] = 2.0f;
  });
  comm::allreduce({{a}, {b}});
  for (float v : values(a)) ASSERT_EQ(v, 3.0f);
  for (float v : values(b)) ASSERT_EQ(v, 3.0f);
}

TEST(Allreduce, RejectsMismatchedShapesAndDuplicateDevices) {
  Tensor a = filled({3}, 1.0f, cpu(0)), b = filled({4}, 1.0f, cpu(1)), c = filled({3}, 1.0f, cpu(0));
  EXPECT_THROW(comm::allreduce({{a}, {b}}), ValueError);
  EXPECT_THROW(comm::allreduce({{a}, {c}}), ValueError);
}

TEST(SplitBatch, ShardSizesDifferByAtMostOne) {
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(train::shard_ranges(5, 2), (R{{0, 3}, {3, 5}}));
  EXPECT_EQ(train::shard_ranges(2, 4), (R{{0, 1}, {1, 2}, {2, 2}, {2, 2}}));
  EXPECT_EQ(train::shard_ranges(12, 3), (R{{0, 4}, {4, 8}, {8, 12}}));
}

TEST(ParallelFor, CoversEveryIndexOnceAndRethrows) {
  std::vector<std::atomic<int>> hits(1000);
  parallel_for(1000, [&](int64_t i) { hits[i]++; });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_THROW(parallel_for(100, [](int64_t i) { if (i == 42) throw ValueError("x"); }), ValueError);
}

TEST(Storage, FreedBlocksAreReused) {
  void* first;
  {
    Tensor t = Tensor::empty({12345}, DType::F32, cpu(0));
    first = t.raw();
  }
  Tensor again = Tensor::empty({12345}, DType::F32, cpu(0));
  EXPECT_EQ(again.raw(), first);
}

TEST(Tensor, ReshapeInfersAndChecks) {
  Tensor t = Tensor::empty({4, 5}, DType::F32, cpu(0));
  EXPECT_EQ(t.reshape({-1, 2}).shape(), (Shape{10, 2}));
  EXPECT_THROW(t.reshape({3, -1}), ValueError);
  Tensor empty = Tensor::empty({0, 50, 4, 4}, DType::F32, cpu(0));
  EXPECT_EQ(empty.reshape({0, -1}).shape(), (Shape{0, 800}));
  EXPECT_THROW(Tensor::empty({2}, DType::F32, cpu(kMaxCpuDevices)), IndexError);
}

}  // namespace
}  // namespace mgpu
