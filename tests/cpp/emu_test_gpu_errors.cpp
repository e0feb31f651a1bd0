// tests/cpp/emu_test_gpu_errors.cpp -- on emulated GPUs: the launchers' grid arithmetic near 2^31
// (checked as plain arithmetic: a tensor that size does not fit the test machine), and failures
// of CUDA calls mgpu makes without throwing (a cudaFree while emptying the cache, a graph's
// destruction), which must not stay behind as the thread's last error for the next launch check
// to report as its own kernel's failure; and waitall() waiting for every stream of a device, not
// only its compute stream. Built into mgpu_cuda_kernel_tests.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>

#include "core/gpu.h"
#include "core/queue.h"
#include "core/tensor.h"
#include "cuda/emu/internal.h"
#include "ops/elementwise.h"
#include "ops/launch.cuh"

namespace {

namespace detail = mgpu::ops::cuda::detail;

TEST(GridArithmetic, CeilDivIsExactUpToIntMax) {
  // (a + b - 1) / b overflows for these; the quotient itself fits.
  EXPECT_EQ(detail::ceil_div(INT_MAX, 256), 8388608);
  EXPECT_EQ(detail::ceil_div(INT_MAX - 100, 256), 8388608);
  EXPECT_EQ(detail::ceil_div(INT_MAX, 1), INT_MAX);
  EXPECT_EQ(detail::ceil_div(INT_MAX, 16), 134217728);
  EXPECT_EQ(detail::ceil_div(0, 256), 0);
  EXPECT_EQ(detail::ceil_div(256, 256), 1);
  EXPECT_EQ(detail::ceil_div(257, 256), 2);
}

TEST(GridArithmetic, GridBlocksCoverCountsNearIntMax) {
  EXPECT_EQ(detail::grid_blocks("t", INT_MAX, 8), 268435456u);
  EXPECT_EQ(detail::grid_blocks("t", INT_MAX - 3, 32), 67108864u);
  EXPECT_EQ(detail::grid_blocks("t", INT_MAX, 1), static_cast<unsigned>(INT_MAX));
  EXPECT_EQ(detail::grid_blocks("t", 1, 256), 1u);
  EXPECT_EQ(detail::grid_blocks("t", 0, 256), 0u);
  // The last block's first index, computed in 64 bits as the kernels do, is below the count.
  const int64_t count = INT_MAX - 5, per = 8;
  const int64_t last = static_cast<int64_t>(detail::grid_blocks("t", count, per)) - 1;
  EXPECT_LT(last * per, count);
  EXPECT_GE(last * per + per, count);
  EXPECT_GT(last * per + per - 1, static_cast<int64_t>(INT_MAX) - 8);  // past int in the tail
}

TEST(GridArithmetic, GridBlocksRefuseCountsPastIntIndexing) {
  try {
    detail::grid_blocks("cuda::argmax_rows", int64_t{INT_MAX} + 1, 8);
    FAIL() << "a count of 2^31 was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda::argmax_rows"), std::string::npos) << what;
    EXPECT_NE(what.find("2147483648"), std::string::npos) << what;
  }
  EXPECT_THROW(detail::grid_blocks("t", -1, 8), std::invalid_argument);
}

// A kernel of one element on gpu(0)'s compute stream, then its launch check (which throws
// whatever error the thread still holds, naming this kernel).
void launch_one(float* p) {
  mgpu::ops::cuda::for_each_index(1, mgpu::ops::FillOut{p, 1.0f},
                                  mgpu::gpu::compute_stream(0));
}

TEST(StaleErrors, AFailedFreeInEmptyCacheIsNotBlamedOnTheNextKernel) {
  mgpu::gpu::set_device(0);
  size_t cap = 0;
  void* block = mgpu::gpu::allocate(0, (size_t(3) << 20) + 1234, &cap);
  mgpu::gpu::release(0, block, cap);  // on the cache's free list now
  // Freed behind the cache's back: its own cudaFree in empty_cache then fails.
  mgpu::gpu::synchronize(0);
  ASSERT_EQ(cudaFree(block), cudaSuccess);
  mgpu::gpu::empty_cache(0);
  size_t cap2 = 0;
  void* p = mgpu::gpu::allocate(0, 64, &cap2);
  EXPECT_NO_THROW(launch_one(static_cast<float*>(p)));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  mgpu::gpu::release(0, p, cap2);
  mgpu::gpu::synchronize(0);
}

TEST(StaleErrors, AFailedGraphDestructionIsNotBlamedOnTheNextKernel) {
  mgpu::gpu::set_device(0);
  size_t cap = 0;
  void* p = mgpu::gpu::allocate(0, 64, &cap);
  std::set<CUgraphExec_st*> before;
  {
    std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
    before = mgpu::emu::rt().execs;
  }
  mgpu::gpu::begin_capture(0);
  launch_one(static_cast<float*>(p));
  std::shared_ptr<mgpu::gpu::Graph> graph = mgpu::gpu::end_capture(0);
  CUgraphExec_st* exec = nullptr;
  {
    std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
    for (CUgraphExec_st* x : mgpu::emu::rt().execs)
      if (!before.count(x)) exec = x;
  }
  ASSERT_NE(exec, nullptr);
  // Destroyed behind the graph's back: its own cudaGraphExecDestroy then fails.
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  graph.reset();
  EXPECT_NO_THROW(launch_one(static_cast<float*>(p)));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  mgpu::gpu::release(0, p, cap);
  mgpu::gpu::synchronize(0);
}

// A reduction that a failed step leaves on the communication stream, which no compute-stream work
// waits for: waitall() must wait for it too. On the strict emulator a stream's work runs only when
// something waits for that stream (or at a random earlier point), so each round's fill stays
// queued until a wait covers the communication stream (3 rounds in 4 at least, by the seed).
TEST(WaitAll, WaitsForWorkLeftOnTheCommunicationStream) {
  if (!mgpu::emu::strict()) GTEST_SKIP() << "needs the strict emulator (streams behind the host)";
  constexpr int64_t n = 64;
  // waitall() waits for the devices that have a queue: gpu(0)'s, made by the fill.
  const mgpu::Device gpu0{mgpu::DeviceKind::CUDA, 0};
  mgpu::Tensor t = mgpu::Tensor::empty({n}, mgpu::DType::F32, gpu0);
  mgpu::ops::fill(t, 0.0);
  mgpu::waitall();
  mgpu::gpu::set_device(0);
  cudaStream_t comm = mgpu::gpu::comm_stream(0);
  for (int round = 1; round <= 16; ++round) {
    const auto value = static_cast<float>(round);
    mgpu::ops::cuda::for_each_index(n, mgpu::ops::FillOut{t.f32(), value}, comm);
    mgpu::waitall();
    // Emulated device memory is host memory: the host reads what the streams have written.
    float got[n];
    std::memcpy(got, t.f32(), sizeof got);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], value) << "round " << round << ", element " << i;
  }
}

}  // namespace
