// tests/cpp/emu_test_cuda_emulation.cpp -- the CUDA emulator (cpp/cuda/emu/) proven on real CUDA
// kernels (tests/cpp/emu_kernels.cu) against plain C++ loops, plus its runtime API: copies, memset,
// streams, events, peer access, graph capture and replay, and the errors a GPU would give (or hang
// on): bad pointers and sizes, divergent barriers, deadlocks, asserts. Not named test_*.cpp: it
// needs -DMGPU_CUDA_EMULATION and its own target.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/runtime.cuh"
#include "emu_kernels.h"
#include "emu_test_util.h"

namespace {

using mgpu::emu::last_error_detail;
using mgpu_test::DeviceVector;
using ::testing::HasSubstr;

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

class Emu : public ::testing::Test {
 protected:
  // Kernel tests run under MGPU_EMU_SEED (default 1), so CI can vary the fiber order; tests
  // about the order set their seeds.
  void SetUp() override { mgpu::emu::reset_from_env(); }
  void TearDown() override {
    cudaGetLastError();
    mgpu::emu::reset_from_env();
  }
};

// ---- Kernels against plain loops
// ------------------------------------------------------------------

std::vector<float> matmul_reference(const std::vector<float>& a, const std::vector<float>& b, int m,
                                    int n, int k) {
  std::vector<float> c(size_t(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int p = 0; p < k; ++p) acc += double(a[size_t(i) * k + p]) * b[size_t(p) * n + j];
      c[size_t(i) * n + j] = float(acc);
    }
  }
  return c;
}

TEST_F(Emu, TiledMatmulMatchesLoopsForOddAndTileSizes) {
  struct Size {
    int m, n, k;
  };
  for (Size s :
       {Size{1, 1, 1}, Size{16, 16, 16}, Size{17, 33, 29}, Size{64, 48, 80}, Size{5, 100, 3}}) {
    for (uint64_t seed : {0, 1, 7}) {
      mgpu::emu::set_seed(seed);
      const auto a = random_floats(size_t(s.m) * s.k, 1), b = random_floats(size_t(s.k) * s.n, 2);
      DeviceVector<float> da(a), db(b), dc(size_t(s.m) * s.n);
      mgpu_test::matmul(da.get(), db.get(), dc.get(), s.m, s.n, s.k, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
      const auto c = dc.download(), want = matmul_reference(a, b, s.m, s.n, s.k);
      for (size_t i = 0; i < c.size(); ++i) {
        ASSERT_NEAR(c[i], want[i], 1e-5f + 1e-5f * std::abs(want[i]))
            << "C[" << i / s.n << "][" << i % s.n << "] of " << s.m << "x" << s.k << " * " << s.k
            << "x" << s.n << ", seed " << seed;
      }
    }
  }
}

// Integer-valued floats: every order of summation gives the exact sum.
std::vector<float> small_integers(int n) {
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = float(i % 7 - 3 + (i % 5 == 0 ? 10 : 0));
  return x;
}
std::vector<float> block_sums_reference(const std::vector<float>& x, int threads) {
  std::vector<float> out((x.size() + threads - 1) / threads, 0.0f);
  for (size_t i = 0; i < x.size(); ++i) out[i / threads] += x[i];
  return out;
}

TEST_F(Emu, BlockReductionWithSharedMemoryIsExact) {
  const int n = 1000;  // four blocks of 256, the last one partial
  const auto x = small_integers(n);
  DeviceVector<float> dx(x), dpartial(4);
  for (uint64_t seed : {0, 1, 2, 3}) {
    mgpu::emu::set_seed(seed);
    mgpu_test::block_sums(dx.get(), dpartial.get(), n, true, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
    EXPECT_EQ(dpartial.download(), block_sums_reference(x, 256)) << "seed " << seed;
  }
}

TEST_F(Emu, MissingBarrierInReductionGivesAWrongResultUnderVariedOrder) {
  const int n = 1024;
  const auto x = small_integers(n);
  const auto want = block_sums_reference(x, 256);
  DeviceVector<float> dx(x), dpartial(4);
  int wrong = 0;
  for (uint64_t seed : {1, 2, 3, 4}) {
    mgpu::emu::set_seed(seed);
    mgpu_test::block_sums(dx.get(), dpartial.get(), n, false, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
    wrong += dpartial.download() != want;
    // The correct kernel stays correct under the same orders.
    mgpu_test::block_sums(dx.get(), dpartial.get(), n, true, nullptr);
    EXPECT_EQ(dpartial.download(), want) << "seed " << seed;
  }
  EXPECT_GE(wrong, 1) << "the kernel without its barrier passed under every fiber order";
}

TEST_F(Emu, WarpShufflesBallotsAndScanMatchLoops) {
  for (int threads : {32, 128, 256}) {
    const int n = 1000, blocks = (n + threads - 1) / threads, warps = threads / 32;
    std::vector<int> x(n);
    for (int i = 0; i < n; ++i) x[i] = (i * 37) % 11 - 4;
    DeviceVector<int> dx(x), dtotal(blocks), dscan(n);
    DeviceVector<unsigned> dballot(size_t(blocks) * warps);
    mgpu_test::warp_reduce(dx.get(), n, dtotal.get(), dballot.get(), dscan.get(), threads, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
    std::vector<int> total(blocks, 0), scan(n);
    std::vector<unsigned> ballot(size_t(blocks) * warps, 0);
    for (int i = 0; i < n; ++i) {
      total[i / threads] += x[i];
      scan[i] = x[i] + (i % 32 == 0 ? 0 : scan[i - 1]);
      if (x[i] > 0) ballot[i / 32] |= 1u << (i % 32);
    }
    EXPECT_EQ(dtotal.download(), total) << threads << " threads";
    EXPECT_EQ(dscan.download(), scan) << threads << " threads";
    EXPECT_EQ(dballot.download(), ballot) << threads << " threads";
  }
}

TEST_F(Emu, AtomicHistogramSumAndMaxAreExact) {
  const int n = 5000, bins = 40;
  std::vector<int> values(n);
  std::mt19937 gen(3);
  for (int& v : values) v = int(gen() % bins);
  DeviceVector<int> dvalues(values), dmax(std::vector<int>{-1});
  DeviceVector<unsigned> dbins(std::vector<unsigned>(bins, 0));
  DeviceVector<float> dsum(std::vector<float>{0.0f});
  mgpu_test::histogram(dvalues.get(), n, dbins.get(), bins, dsum.get(), dmax.get(), nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  std::vector<unsigned> want(bins, 0);
  float sum = 0;
  for (int v : values) {
    ++want[v];
    sum += float(v);
  }
  EXPECT_EQ(dbins.download(), want);
  EXPECT_EQ(dsum.download()[0], sum);
  EXPECT_EQ(dmax.download()[0], bins - 1);
}

TEST_F(Emu, GridStrideSaxpyCoversEveryElement) {
  const int n = 10007;
  const auto x = random_floats(n, 4), y = random_floats(n, 5);
  DeviceVector<float> dx(x), dy(y);
  mgpu_test::saxpy(n, 2.5f, dx.get(), dy.get(), 3, 64, nullptr);  // 192 threads stride over n
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  const auto got = dy.download();
  for (int i = 0; i < n; ++i) ASSERT_EQ(got[i], 2.5f * x[i] + y[i]) << "i = " << i;
}

TEST_F(Emu, ThousandBlocksReuseOneBlockOfFibers) {
  const int blocks = 1000, threads = 256, n = blocks * threads;
  const auto x = random_floats(n, 6);
  DeviceVector<float> dx(x), dy(std::vector<float>(n, 1.0f));
  const uint64_t before = mgpu::emu::fiber_switches();
  const auto start = std::chrono::steady_clock::now();
  mgpu_test::saxpy(n, -1.0f, dx.get(), dy.get(), blocks, threads, nullptr);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(mgpu::emu::fiber_pool_size(), size_t(threads));
  EXPECT_EQ(mgpu::emu::fiber_switches() - before, uint64_t(n));  // one run to completion each
  const auto got = dy.download();
  for (int i = 0; i < n; ++i) ASSERT_EQ(got[i], 1.0f - x[i]) << "i = " << i;
  std::printf("[ info     ] %d blocks x %d threads: %.3f s\n", blocks, threads, seconds);
}

TEST_F(Emu, DynamicSharedMemoryReversesEachChunk) {
  for (int threads : {96, 128, 1}) {
    const int n = 1000;
    const auto x = random_floats(n, 7);
    DeviceVector<float> din(x), dout(n);
    mgpu_test::reverse_chunks(din.get(), dout.get(), n, threads, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
    const auto got = dout.download();
    for (int base = 0; base < n; base += threads) {
      const int len = std::min(threads, n - base);
      for (int j = 0; j < len; ++j) {
        ASSERT_EQ(got[base + j], x[base + len - 1 - j]) << threads << " threads, i = " << base + j;
      }
    }
  }
}

// __shared__ is static thread_local: blocks on two OS threads at once (two devices' workers) keep
// their own copies, while all fibers of one block share one.
TEST_F(Emu, SharedMemoryIsPrivateToEachOsThread) {
  const int m = 40, n = 37, k = 50;
  const auto a = random_floats(size_t(m) * k, 8), b = random_floats(size_t(k) * n, 9);
  const auto want = matmul_reference(a, b, m, n, k);
  std::vector<std::string> errors(2);
  auto worker = [&](int device) {
    try {
      MGPU_CUDA_CHECK(cudaSetDevice(device));
      DeviceVector<float> da(a), db(b), dc(size_t(m) * n);
      for (int rep = 0; rep < 20; ++rep) {
        mgpu_test::matmul(da.get(), db.get(), dc.get(), m, n, k, nullptr);
        MGPU_CUDA_CHECK_LAUNCH();
        const auto c = dc.download();
        for (size_t i = 0; i < c.size(); ++i) {
          if (std::abs(c[i] - want[i]) > 1e-4f)
            throw std::runtime_error("wrong C[" + std::to_string(i) + "]");
        }
      }
    } catch (const std::exception& e) {
      errors[device] = e.what();
    }
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Kernels only this file needs (g++ only): barrier predicates, recorded fiber order, misuse.
__global__ void barrier_predicates(int* out) {
  const int t = threadIdx.x;
  out[0] = __syncthreads_count(t % 3 == 0);
  out[1] = __syncthreads_and(t < 1000);
  out[2] = __syncthreads_or(t == 17);
  out[3] = __syncthreads_and(t != 5);
}
__global__ void record_order(int* order, int* counter) {
  order[threadIdx.x] = atomicAdd(counter, 1);
  __syncthreads();
  order[blockDim.x + threadIdx.x] = atomicAdd(counter, 1);
}
__global__ void two_barrier_sites(float* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 0.0f;
}
__global__ void full_mask_in_partial_warp(float* out) {
  out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
}
__global__ void throwing_kernel(float* out) {
  if (threadIdx.x == 3) throw std::runtime_error("kernel-side failure");
  out[threadIdx.x] = 1.0f;
}
__global__ void spin_on_other_block(int* flag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    while (atomicCAS(flag, 1, 2) != 1) {
    }
  }
  if (blockIdx.x == 1 && threadIdx.x == 0) atomicExch(flag, 1);
}
__global__ void spin_lock_in_block(int* lock, int* counter) {
  while (atomicCAS(lock, 0, 1) != 0) {
  }
  const int seen = *counter;
  atomicCAS(lock, 0, 1);  // fails (we hold the lock), so the other threads run meanwhile
  *counter = seen + 1;
  atomicExch(lock, 0);
}
__global__ void noop(float*) {}

TEST_F(Emu, BarrierPredicatesCountAndReduce) {
  DeviceVector<int> out(4);
  MGPU_LAUNCH(barrier_predicates, 1, 100, 0, nullptr)(out.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(out.download(), (std::vector<int>{34, 1, 1, 0}));
}

TEST_F(Emu, FiberOrderIsAscendingForSeedZeroAndShuffledPerPhaseOtherwise) {
  const int threads = 64;
  DeviceVector<int> order(2 * threads), counter(1);
  auto run = [&](uint64_t seed) {
    mgpu::emu::set_seed(seed);
    MGPU_CUDA_CHECK(cudaMemset(counter.get(), 0, sizeof(int)));
    MGPU_LAUNCH(record_order, 1, threads, 0, nullptr)(order.get(), counter.get());
    MGPU_CUDA_CHECK_LAUNCH();
    return order.download();
  };
  const auto ascending = run(0);
  for (int t = 0; t < threads; ++t) {
    EXPECT_EQ(ascending[t], t);
    EXPECT_EQ(ascending[threads + t], threads + t);
  }
  const auto shuffled = run(1);
  const std::vector<int> phase0(shuffled.begin(), shuffled.begin() + threads);
  std::vector<int> phase1(shuffled.begin() + threads, shuffled.end());
  for (int& p : phase1) p -= threads;
  EXPECT_NE(phase0, std::vector<int>(ascending.begin(), ascending.begin() + threads));
  EXPECT_NE(phase0, phase1) << "both barrier phases ran in the same order";
  EXPECT_EQ(run(1), shuffled) << "a seed must give the same order every time";
  EXPECT_NE(run(2), shuffled);
}

// ---- Misuse becomes a launch error, not a hang or a crash
// -------------------------------------------

TEST_F(Emu, BarrierInDivergentBranchIsReportedNotHung) {
  DeviceVector<float> out(64);
  mgpu_test::divergent_barrier(out.get(), nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("divergent_barrier_kernel"));
  EXPECT_THAT(last_error_detail(), HasSubstr("__syncthreads"));
  EXPECT_THAT(last_error_detail(), HasSubstr("emu_kernels.cu"));
  // The device's next synchronisation reports it too, once.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "a failing call sets the last error";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The fibers were unwound and are reusable.
  const auto x = small_integers(512);
  DeviceVector<float> dx(x), dpartial(2);
  mgpu_test::block_sums(dx.get(), dpartial.get(), 512, true, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(dpartial.download(), block_sums_reference(x, 256));
}

TEST_F(Emu, DeadlockBetweenBarrierAndShuffleNamesKernelBlockAndWaiters) {
  DeviceVector<float> out(32);
  mgpu_test::barrier_shuffle_deadlock(out.get(), nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  const std::string detail = last_error_detail();
  EXPECT_THAT(detail, HasSubstr("deadlock"));
  EXPECT_THAT(detail, HasSubstr("barrier_shuffle_deadlock_kernel"));
  EXPECT_THAT(detail, HasSubstr("block (0,0,0)"));
  EXPECT_THAT(detail, HasSubstr("1 of 32 threads wait at __syncthreads"));
  EXPECT_THAT(detail, HasSubstr("__shfl_sync(mask 0xffffffff)"));
}

TEST_F(Emu, MisusedBarriersAndMasksFailTheLaunch) {
  DeviceVector<float> out(64);
  MGPU_LAUNCH(two_barrier_sites, 1, 64, 0, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("divergent barriers"));
  MGPU_LAUNCH(full_mask_in_partial_warp, 1, 48, 0, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("lanes that do not exist"));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
}

TEST_F(Emu, DeviceAssertAndExceptionsFailTheLaunch) {
#ifdef NDEBUG
  GTEST_SKIP() << "built with NDEBUG: assert() is compiled out (build this test with -UNDEBUG)";
#endif
  const std::vector<float> x{1, 2, 3};
  DeviceVector<float> dx(x), dout(3);
  DeviceVector<int> good(std::vector<int>{2, 0, 1}), bad(std::vector<int>{2, 3, 1});
  mgpu_test::gather(dx.get(), good.get(), dout.get(), 3, 3, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(dout.download(), (std::vector<float>{3, 1, 2}));
  mgpu_test::gather(dx.get(), bad.get(), dout.get(), 3, 3, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorAssert);
  EXPECT_THAT(last_error_detail(), HasSubstr("index[i] >= 0 && index[i] < n"));
  EXPECT_THAT(last_error_detail(), HasSubstr("thread (1,0,0)"));
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaErrorAssert);
  cudaGetLastError();

  MGPU_LAUNCH(throwing_kernel, 2, 8, 0, nullptr)(dout.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("kernel-side failure"));
  try {
    MGPU_CUDA_CHECK(cudaDeviceSynchronize());
    ADD_FAILURE() << "MGPU_CUDA_CHECK did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cudaErrorLaunchFailure"));
    EXPECT_THAT(e.what(), HasSubstr("cudaDeviceSynchronize()"));
    EXPECT_THAT(e.what(), HasSubstr("kernel-side failure"));
  }
}

TEST_F(Emu, SpinningOnAnotherBlockIsALivelockErrorWhileSpinLocksInABlockWork) {
  DeviceVector<int> flag(std::vector<int>{0});
  MGPU_LAUNCH(spin_on_other_block, 2, 32, 0, nullptr)(flag.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("livelock"));
  DeviceVector<int> lock(std::vector<int>{0}), counter(std::vector<int>{0});
  MGPU_LAUNCH(spin_lock_in_block, 1, 64, 0, nullptr)(lock.get(), counter.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(counter.download()[0], 64);
}

TEST_F(Emu, BadLaunchConfigurationsAndPointersAreRejected) {
  DeviceVector<float> out(4);
  MGPU_LAUNCH(noop, 0, 32, 0, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  MGPU_LAUNCH(noop, 1, 2048, 0, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  MGPU_LAUNCH(noop, 1, dim3(1, 1, 128), 0, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  MGPU_LAUNCH(noop, 1, 32, 64 * 1024, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_THAT(last_error_detail(), HasSubstr("cudaFuncSetAttribute"));
  ASSERT_EQ(cudaFuncSetAttribute(noop, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
            cudaSuccess);
  MGPU_LAUNCH(noop, 1, 32, 64 * 1024, nullptr)(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();

  std::vector<float> host(4);
  MGPU_LAUNCH(noop, 1, 32, 0, nullptr)(host.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_THAT(last_error_detail(), HasSubstr("argument 0"));
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 16), cudaSuccess);
  MGPU_LAUNCH(noop, 1, 32, 0, nullptr)(pinned);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "pinned host memory is mapped for kernels";
  ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
  float* freed = nullptr;
  ASSERT_EQ(cudaMalloc(&freed, 16), cudaSuccess);
  ASSERT_EQ(cudaFree(freed), cudaSuccess);
  MGPU_LAUNCH(noop, 1, 32, 0, nullptr)(freed);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
}

// ---- Runtime API
// ------------------------------------------------------------------------------------

TEST_F(Emu, DeviceCountComesFromTheEnvironment) {
  int count = -1;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count,
            std::getenv("MGPU_EMULATED_GPUS") ? std::atoi(std::getenv("MGPU_EMULATED_GPUS")) : 2);
  const char* saved = std::getenv("MGPU_EMULATED_GPUS");
  const std::string saved_value = saved ? saved : "";
  setenv("MGPU_EMULATED_GPUS", "3", 1);
  mgpu::emu::reset_from_env();
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 3);
  EXPECT_EQ(cudaSetDevice(2), cudaSuccess);
  EXPECT_EQ(cudaSetDevice(3), cudaErrorInvalidDevice);
  EXPECT_THAT(last_error_detail(), HasSubstr("3 emulated GPUs"));
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 2), cudaSuccess);
  EXPECT_EQ(prop.warpSize, 32);
  EXPECT_EQ(prop.maxThreadsPerBlock, 1024);
  EXPECT_EQ(prop.sharedMemPerBlock, size_t(48 * 1024));
  EXPECT_GE(prop.major, 7);
  EXPECT_THAT(std::string(prop.name), HasSubstr("emulated"));
  setenv("MGPU_EMULATED_GPUS", "0", 1);
  mgpu::emu::reset_from_env();
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaErrorNoDevice);
  EXPECT_EQ(count, 0);
  setenv("MGPU_EMULATED_GPUS", "two", 1);
  mgpu::emu::reset_from_env();
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaErrorInitializationError);
  EXPECT_THAT(last_error_detail(), HasSubstr("MGPU_EMULATED_GPUS"));
  if (saved) {
    setenv("MGPU_EMULATED_GPUS", saved_value.c_str(), 1);
  } else {
    unsetenv("MGPU_EMULATED_GPUS");
  }
}

TEST_F(Emu, LastErrorIsStickyUntilRead) {
  EXPECT_EQ(cudaSetDevice(99), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_STREQ(cudaGetErrorName(cudaErrorIllegalAddress), "cudaErrorIllegalAddress");
  EXPECT_STREQ(cudaGetErrorString(cudaSuccess), "no error");
}

TEST_F(Emu, MemcpyOfEveryKindMovesTheBytes) {
  const std::vector<int> src{1, 2, 3, 4, 5, 6, 7, 8};
  const size_t bytes = src.size() * sizeof(int);
  int *d1 = nullptr, *d2 = nullptr, *pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&d1, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d2, bytes), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, bytes), cudaSuccess);
  std::vector<int> h(src.size(), 0);
  EXPECT_EQ(cudaMemcpy(d1, src.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d2, d1, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(pinned, d2, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), pinned, bytes, cudaMemcpyHostToHost), cudaSuccess);
  EXPECT_EQ(h, src);
  std::vector<int> h2(src.size(), 0);
  EXPECT_EQ(cudaMemcpy(d2 + 4, src.data(), bytes / 2, cudaMemcpyDefault), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h2.data(), d2, bytes, cudaMemcpyDefault), cudaSuccess);
  EXPECT_EQ(h2, (std::vector<int>{1, 2, 3, 4, 1, 2, 3, 4}));
  EXPECT_EQ(cudaMemcpy(d1, nullptr, 0, cudaMemcpyHostToDevice), cudaSuccess)
      << "0 bytes is a no-op";
  EXPECT_EQ(cudaMemcpyAsync(h.data(), d1, bytes, cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  EXPECT_EQ(h, src);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(d1), cudaSuccess);
  EXPECT_EQ(cudaFree(d2), cudaSuccess);
}

TEST_F(Emu, BadCopiesSetsAndFreesAreErrors) {
  std::vector<char> host(64);
  char* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 32), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 32, 8, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_THAT(last_error_detail(), HasSubstr("not device memory"));
  EXPECT_EQ(cudaMemcpy(d, host.data(), 33, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_THAT(last_error_detail(), HasSubstr("overruns"));
  EXPECT_EQ(cudaMemcpy(d + 16, host.data(), 17, cudaMemcpyDefault), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), d, 8, cudaMemcpyHostToHost), cudaErrorInvalidValue);
  EXPECT_THAT(last_error_detail(), HasSubstr("kind says host"));
  EXPECT_EQ(cudaMemcpy(d, host.data(), 8, cudaMemcpyKind(7)), cudaErrorInvalidMemcpyDirection);
  EXPECT_EQ(cudaMemcpy(d, nullptr, 8, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(host.data(), 0, 8), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(d + 8, 0, 25), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(d, 7, 32), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), d, 32, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::vector<char>(host.begin(), host.begin() + 32), std::vector<char>(32, 7));
  EXPECT_EQ(cudaFree(d + 1), cudaErrorInvalidDevicePointer);
  EXPECT_EQ(cudaFreeHost(d), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidDevicePointer) << "double free";
  EXPECT_EQ(cudaFree(nullptr), cudaSuccess);
  void* empty = &host;
  EXPECT_EQ(cudaMalloc(&empty, 0), cudaSuccess);
  EXPECT_EQ(empty, nullptr);
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d, total + 1), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaMalloc(&d, 1 << 20), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(free_before - free_after, size_t(1 << 20));
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST_F(Emu, StreamsAndEventsOrderWorkAcrossStreams) {
  const int n = 1000;
  const auto x = random_floats(n, 10);
  std::vector<float> y(n, 0.0f);
  DeviceVector<float> dx(n), dy(std::vector<float>(n, 1.0f));
  cudaStream_t copy = nullptr, compute = nullptr;
  cudaEvent_t copied = nullptr, start = nullptr, stop = nullptr;
  ASSERT_EQ(cudaStreamCreate(&copy), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(start, compute), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(dx.get(), x.data(), dx.bytes(), cudaMemcpyHostToDevice, copy),
            cudaSuccess);
  EXPECT_EQ(cudaEventRecord(copied, copy), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(compute, copied, 0), cudaSuccess);
  mgpu_test::saxpy(n, 3.0f, dx.get(), dy.get(), 4, 128, compute);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(cudaMemcpyAsync(y.data(), dy.get(), dy.bytes(), cudaMemcpyDeviceToHost, compute),
            cudaSuccess);
  EXPECT_EQ(cudaEventRecord(stop, compute), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(stop), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(copy), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(y[i], 3.0f * x[i] + 1.0f);
  float ms = -1.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  EXPECT_GE(ms, 0.0f);
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, copied), cudaErrorInvalidResourceHandle)
      << "timing disabled";

  // Handles belong to a device; destroyed handles are errors.
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(start, nullptr), cudaErrorInvalidResourceHandle);
  mgpu_test::saxpy(n, 3.0f, dx.get(), dy.get(), 4, 128, compute);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  EXPECT_THAT(last_error_detail(), HasSubstr("cudaSetDevice(0)"));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(copy), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(copy), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
  for (cudaEvent_t e : {copied, start, stop}) EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(stop), cudaErrorInvalidResourceHandle);
}

TEST_F(Emu, PeerCopiesAndPeerAccessBetweenDevices) {
  const std::vector<float> x{1, 2, 3, 4};
  DeviceVector<float> on0(x);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  DeviceVector<float> on1(x.size());
  cudaStream_t s1 = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s1), cudaSuccess);
  EXPECT_EQ(cudaMemcpyPeerAsync(on1.get(), 1, on0.get(), 0, on0.bytes(), s1), cudaSuccess);
  EXPECT_EQ(on1.download(), x);
  EXPECT_EQ(cudaMemcpyPeerAsync(on1.get(), 0, on0.get(), 0, on0.bytes(), s1), cudaErrorInvalidValue)
      << "dst is not memory of device 0";
  EXPECT_EQ(cudaMemcpyPeer(on1.get(), 1, on0.get(), 5, on0.bytes()), cudaErrorInvalidDevice);
  // A kernel on device 1 reading device 0's memory needs peer access, as on a GPU.
  int can = 0;
  EXPECT_EQ(cudaDeviceCanAccessPeer(&can, 1, 0), cudaSuccess);
  EXPECT_EQ(can, 1);
  mgpu_test::saxpy(4, 1.0f, on0.get(), on1.get(), 1, 32, s1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_THAT(last_error_detail(), HasSubstr("cudaDeviceEnablePeerAccess(0, 0)"));
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaErrorIllegalAddress);
  ASSERT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaSuccess);
  EXPECT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaErrorPeerAccessAlreadyEnabled);
  EXPECT_EQ(cudaGetLastError(), cudaErrorPeerAccessAlreadyEnabled);
  mgpu_test::saxpy(4, 1.0f, on0.get(), on1.get(), 1, 32, s1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(on1.download(), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(cudaDeviceDisablePeerAccess(0), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s1), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST_F(Emu, CapturedGraphReplaysCopiesAndKernels) {
  const int n = 777;
  std::vector<float> x = random_floats(n, 11), out(n, -7.0f);
  DeviceVector<float> dx(n), dy(n);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaMemcpyAsync(dx.get(), x.data(), dx.bytes(), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(dy.get(), 0, dy.bytes(), s), cudaSuccess);
  mgpu_test::saxpy(n, 2.0f, dx.get(), dy.get(), 2, 128, s);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(cudaMemcpyAsync(out.data(), dy.get(), dy.bytes(), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  EXPECT_EQ(out, std::vector<float>(n, -7.0f)) << "capturing must not run the work";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const std::vector<float> first = out;
  for (int i = 0; i < n; ++i) ASSERT_EQ(first[i], 2.0f * x[i]);
  std::fill(out.begin(), out.end(), 0.0f);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  EXPECT_EQ(out, first) << "a replay gives the same result";
  // Replays read the captured host pointers anew, as CUDA graphs do.
  for (float& v : x) v += 1.0f;
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(out[i], 2.0f * x[i]);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, s), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST_F(Emu, CaptureRejectsSynchronisingCalls) {
  DeviceVector<float> d(16);
  std::vector<float> h(16);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal),
            cudaErrorStreamCaptureUnsupported);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaErrorIllegalState);
  EXPECT_EQ(cudaMemcpy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost),
            cudaErrorStreamCaptureImplicit);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 64), cudaSuccess) << "relaxed mode allows cudaMalloc";
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorIllegalState);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// CUDA's rules in both modes: an event last recorded in a capture cannot be waited on or queried
// outside it, and a capture not begun in relaxed mode is ended by the thread that began it.
TEST_F(Emu, CapturedEventsAndTheCapturingThreadFollowCudasRules) {
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  cudaGraph_t g = nullptr;
  cudaError_t from_other = cudaSuccess;
  std::thread([&] { from_other = cudaStreamEndCapture(s, &g); }).join();
  EXPECT_EQ(from_other, cudaErrorStreamCaptureWrongThread);
  EXPECT_EQ(cudaEventSynchronize(e), cudaErrorCapturedEvent) << "during the capture";
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess) << "the capture went on";
  EXPECT_EQ(cudaEventSynchronize(e), cudaErrorCapturedEvent) << "after it";
  EXPECT_EQ(cudaEventQuery(e), cudaErrorCapturedEvent);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(other, e, 0), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaEventRecord(e, s), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(e), cudaSuccess) << "recorded outside: a point in time again";
  // Relaxed mode: any thread may end it.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  cudaGraph_t g2 = nullptr;
  std::thread([&] { from_other = cudaStreamEndCapture(s, &g2); }).join();
  EXPECT_EQ(from_other, cudaSuccess);
  cudaGraphDestroy(g);
  cudaGraphDestroy(g2);
  cudaEventDestroy(e);
  cudaStreamDestroy(other);
  cudaStreamDestroy(s);
}

TEST_F(Emu, PeerAccessCanBeSwitchedOffAndLiveHandlesAreCounted) {
  const mgpu::emu::LiveCounts base = mgpu::emu::live_counts();
  setenv("MGPU_EMU_PEER_ACCESS", "0", 1);
  mgpu::emu::reset_from_env();
  unsetenv("MGPU_EMU_PEER_ACCESS");
  int can = 1;
  EXPECT_EQ(cudaDeviceCanAccessPeer(&can, 1, 0), cudaSuccess);
  EXPECT_EQ(can, 0);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaErrorPeerAccessUnsupported);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    DeviceVector<float> x(100);
    cudaStream_t s = nullptr;
    cudaEvent_t e = nullptr;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&e), cudaSuccess);
    const mgpu::emu::LiveCounts c = mgpu::emu::live_counts();
    EXPECT_EQ(c.streams, base.streams + 1);
    EXPECT_EQ(c.events, base.events + 1);
    EXPECT_EQ(c.device_allocations, base.device_allocations + 1);
    EXPECT_EQ(c.device_bytes, base.device_bytes + 400);
    cudaEventDestroy(e);
    cudaStreamDestroy(s);
  }
  const mgpu::emu::LiveCounts end = mgpu::emu::live_counts();
  EXPECT_EQ(end.streams, base.streams);
  EXPECT_EQ(end.events, base.events);
  EXPECT_EQ(end.device_bytes, base.device_bytes);
}

// A struct argument's padding bytes hold whatever the caller's memory held there, here device 1's
// address (as a stale pointer on a host thread's stack does): they are no pointer of the kernel,
// so a launch on device 0 without peer access to device 1 runs and is not an illegal address.
TEST_F(Emu, PaddingOfAStructArgumentIsNoPointer) {
  DeviceVector<float> x(std::vector<float>{1, 2, 3, 4}), y(4);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  DeviceVector<float> on1(4);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  mgpu_test::ScaleIf f;
  void* words[4] = {x.get(), on1.get(), y.get(), on1.get()};
  static_assert(sizeof f == sizeof words, "ScaleIf is four words with padding");
  std::memcpy(&f, words, sizeof f);
  // The fields' own bytes; the padding keeps device 1's address but for its lowest bytes.
  f.s = -2.0f;
  f.scale = true;
  mgpu_test::scale_if(4, f, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << last_error_detail();
  EXPECT_EQ(y.download(), (std::vector<float>{-2, -4, -6, -8}));
}

}  // namespace
