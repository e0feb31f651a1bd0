// tests/cpp/emu_test_strict.cpp -- the CUDA emulator in strict mode (MGPU_EMU_STRICT=1): blocks
// in a random order, streams behind the host, freed memory poisoned, so a missing stream wait, an
// event recorded too early or a kernel that depends on block order shows as wrong data or an
// error, with the seed to replay it. Not named test_*.cpp: it needs -DMGPU_CUDA_EMULATION and
// its own target.
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

// ---- Strict mode (MGPU_EMU_STRICT=1) --------------------------------------------------------------
class StrictEmu : public ::testing::Test {
 protected:
  void SetUp() override { strict(1); }
  void TearDown() override {
    cudaGetLastError();
    unsetenv("MGPU_EMU_STRICT");
    unsetenv("MGPU_EMU_SEED");
    mgpu::emu::reset_from_env();
  }
  static void strict(uint64_t seed) {
    setenv("MGPU_EMU_STRICT", "1", 1);
    setenv("MGPU_EMU_SEED", std::to_string(seed).c_str(), 1);
    mgpu::emu::reset_from_env();
  }
};

// Streams a and b (non-blocking) and an event without timing, destroyed at the end of the scope.
struct TwoStreams {
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t written = nullptr;
  TwoStreams() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);
  }
  ~TwoStreams() {
    cudaEventDestroy(written);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
  TwoStreams(const TwoStreams&) = delete;
  TwoStreams& operator=(const TwoStreams&) = delete;
};

// run(seed, planted) for seeds 1..8: without the planted bug every seed gives the right result
// (`right` names that run); with it, some seed must not (`never` says what no seed did).
template <class Run>
void expect_the_plant_shows_for_some_seed(Run run, const char* right, const char* never) {
  int wrong = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    EXPECT_TRUE(run(seed, false)) << "seed " << seed << ", " << right;
    wrong += run(seed, true) ? 0 : 1;
  }
  EXPECT_GT(wrong, 0) << never;
}

TEST_F(StrictEmu, BlocksOfAGridRunInARandomOrderEveryBlockOnce) {
  constexpr int kBlocks = 64;
  DeviceVector<int> turns(std::vector<int>(kBlocks, -1)), counter(std::vector<int>{0});
  mgpu_test::block_turns(turns.get(), counter.get(), kBlocks, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << last_error_detail();
  std::vector<int> got = turns.download(), sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (int b = 0; b < kBlocks; ++b) EXPECT_EQ(sorted[b], b) << "every block runs once";
  int in_place = 0;
  for (int b = 0; b < kBlocks; ++b) in_place += got[b] == b;
  EXPECT_LT(in_place, kBlocks / 2) << "the blocks ran (nearly) in ascending order";
  // The lenient emulator runs them in ascending order.
  unsetenv("MGPU_EMU_STRICT");
  mgpu::emu::reset_from_env();
  DeviceVector<int> turns2(std::vector<int>(kBlocks, -1)), counter2(std::vector<int>{0});
  mgpu_test::block_turns(turns2.get(), counter2.get(), kBlocks, nullptr);
  std::vector<int> ascending(kBlocks);
  for (int b = 0; b < kBlocks; ++b) ascending[b] = b;
  EXPECT_EQ(turns2.download(), ascending);
}

// Stream B reads what stream A writes. With the event wait the result is right for every seed;
// without it (a planted missing stream wait) some seed runs B before A, as a GPU may.
TEST_F(StrictEmu, AMissingStreamWaitShowsAsAWrongResultForSomeSeed) {
  constexpr int kN = 1000;
  auto run = [](uint64_t seed, bool missing_wait) {
    strict(seed);
    TwoStreams streams;
    cudaStream_t a = streams.a, b = streams.b;
    cudaEvent_t written = streams.written;
    DeviceVector<float> x(std::vector<float>(kN, 1.0f)), y(std::vector<float>(kN, 0.0f));
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 4, 64, a);  // x = 2 on stream a
    EXPECT_EQ(cudaEventRecord(written, a), cudaSuccess);
    if (!missing_wait) {
      EXPECT_EQ(cudaStreamWaitEvent(b, written, 0), cudaSuccess);
    }
    mgpu_test::saxpy(kN, 1.0f, x.get(), y.get(), 4, 64, b);  // y = x on stream b
    EXPECT_EQ(cudaStreamSynchronize(b), cudaSuccess);
    std::vector<float> got = y.download();
    EXPECT_EQ(cudaStreamSynchronize(a), cudaSuccess);
    bool right = true;
    for (float v : got) right = right && v == 2.0f;
    return right;
  };
  expect_the_plant_shows_for_some_seed(run, "with the wait",
                                       "no seed ran stream b ahead of stream a");
}

// An event covers exactly the work issued on its stream before its record. Stream a writes
// x = 2 and stream b copies x to y after waiting on the event. Recorded after the write, every
// seed gives y = 2; recorded before it (the write it should cover comes after the record), some
// seed runs b's copy before a's write, as a GPU may: y keeps x's old value.
TEST_F(StrictEmu, AnEventRecordedTooEarlyShowsAsWrongDataForSomeSeed) {
  constexpr int kN = 1000;
  auto run = [](uint64_t seed, bool early) {
    strict(seed);
    TwoStreams streams;
    cudaStream_t a = streams.a, b = streams.b;
    cudaEvent_t written = streams.written;
    DeviceVector<float> x(std::vector<float>(kN, 1.0f)), y(std::vector<float>(kN, 0.0f));
    if (early) {
      EXPECT_EQ(cudaEventRecord(written, a), cudaSuccess);
    }
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 4, 64, a);  // x = 2 on stream a
    if (!early) {
      EXPECT_EQ(cudaEventRecord(written, a), cudaSuccess);
    }
    EXPECT_EQ(cudaStreamWaitEvent(b, written, 0), cudaSuccess);
    mgpu_test::saxpy(kN, 1.0f, x.get(), y.get(), 4, 64, b);  // y = x on stream b
    EXPECT_EQ(cudaStreamSynchronize(b), cudaSuccess) << last_error_detail();
    std::vector<float> got = y.download();
    EXPECT_EQ(cudaStreamSynchronize(a), cudaSuccess);
    EXPECT_EQ(x.download(), std::vector<float>(kN, 2.0f));
    for (float v : got) EXPECT_TRUE(v == 2.0f || v == 1.0f) << "y is x, before or after a's write";
    return got == std::vector<float>(kN, 2.0f);
  };
  expect_the_plant_shows_for_some_seed(
      run, "recorded after the write",
      "no seed ran b's copy before a's write recorded after the event");
}

// cudaEventSynchronize and cudaEventQuery run the work before the record (never less), and no
// work issued after it: x = 2 before the record, x = 4 after; the legacy stream's cudaMemcpy
// (which waits for nothing) then sees 2, or 4 where the seed ran the later write anyway.
TEST_F(StrictEmu, SynchronizingOnAnEventRunsOnlyTheWorkBeforeItsRecord) {
  constexpr int kN = 64;
  for (bool query : {false, true}) {
    int only_before = 0;
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      strict(seed);
      cudaStream_t a = nullptr;
      cudaEvent_t e = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
      ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
      DeviceVector<float> x(std::vector<float>(kN, 1.0f));
      mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);  // x = 2
      ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
      mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);  // x = 4, after the record
      ASSERT_EQ(query ? cudaEventQuery(e) : cudaEventSynchronize(e), cudaSuccess);
      const float seen = x.download()[0];
      EXPECT_TRUE(seen == 2.0f || seen == 4.0f) << "seed " << seed << ": x = " << seen;
      only_before += seen == 2.0f;
      ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
      EXPECT_EQ(x.download(), std::vector<float>(kN, 4.0f));
      cudaEventDestroy(e);
      cudaStreamDestroy(a);
    }
    EXPECT_GT(only_before, 0) << (query ? "cudaEventQuery" : "cudaEventSynchronize")
                              << " ran the work issued after the record for every seed";
  }
}

// A wait covers the event's record made before the call, never less (y is never x's value from
// before that record's write), and the event recorded again later (after x = 4) does not make
// every seed's copy wait for the later write too. (Whether the wait took the record at the call
// or when it ran does not show here, as a wait that ran early took the first record either way;
// emu_test_nccl.cpp shows it by holding the streams back with a collective.)
TEST_F(StrictEmu, AWaitCoversTheRecordBeforeItNotALaterOne) {
  constexpr int kN = 64;
  int before_later_write = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    strict(seed);
    cudaStream_t a = nullptr, b = nullptr;
    cudaEvent_t e = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    DeviceVector<float> x(std::vector<float>(kN, 1.0f)), y(std::vector<float>(kN, 0.0f));
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);  // x = 2
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);  // x = 4
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
    mgpu_test::saxpy(kN, 1.0f, x.get(), y.get(), 1, 64, b);  // y = x
    ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
    const float seen = y.download()[0];
    EXPECT_TRUE(seen == 2.0f || seen == 4.0f) << "seed " << seed << ": y = " << seen;
    before_later_write += seen == 2.0f;
    ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
    cudaEventDestroy(e);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
  EXPECT_GT(before_later_write, 0) << "every seed's wait covered the later record too";
}

TEST_F(StrictEmu, WorkOnAStreamWaitsUntilTheHostSynchronises) {
  // Some seed leaves a launch pending after it returns (seed-dependent by design); sync runs it.
  bool seen_pending = false;
  for (uint64_t seed = 1; seed <= 8 && !seen_pending; ++seed) {
    strict(seed);
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    std::vector<float> host(16, 0.0f);
    DeviceVector<float> x(std::vector<float>(16, 1.0f));
    mgpu_test::saxpy(16, 1.0f, x.get(), x.get(), 1, 16, s);  // x = 2, maybe not yet
    // A plain cudaMemcpy (legacy stream) does not wait for a non-blocking stream.
    ASSERT_EQ(cudaMemcpy(host.data(), x.get(), 16 * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    seen_pending = host[0] == 1.0f;
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(x.download(), std::vector<float>(16, 2.0f)) << "seed " << seed;
    cudaStreamDestroy(s);
  }
  EXPECT_TRUE(seen_pending);
}

TEST_F(StrictEmu, AnEventRecordedInACaptureCannotBeWaitedOnOutsideIt) {
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(e), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaEventQuery(e), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaEventRecord(e, s), cudaSuccess);  // recorded outside: a point in time again
  EXPECT_EQ(cudaEventSynchronize(e), cudaSuccess);
  cudaGraphDestroy(g);
  cudaEventDestroy(e);
  cudaStreamDestroy(s);
}

TEST_F(StrictEmu, AKernelFailureNamesTheSeedToReplay) {
  DeviceVector<float> out(std::vector<float>(64, 0.0f));
  mgpu_test::divergent_barrier(out.get(), nullptr);
  cudaDeviceSynchronize();
  EXPECT_THAT(last_error_detail(), HasSubstr("MGPU_EMU_STRICT=1 MGPU_EMU_SEED=1"));
}

// On a GPU another thread's work on a capturing stream is recorded into the graph (not run);
// the strict emulator refuses it.
TEST_F(StrictEmu, WorkFromAnotherThreadOnACapturingStreamIsRefused) {
  DeviceVector<float> x(std::vector<float>(16, 1.0f));
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaError_t memset_error = cudaSuccess, launch_error = cudaSuccess;
  std::thread([&] {
    memset_error = cudaMemsetAsync(x.get(), 0, x.bytes(), s);
    mgpu_test::saxpy(16, 1.0f, x.get(), x.get(), 1, 16, s);
    launch_error = cudaGetLastError();
  }).join();
  EXPECT_EQ(memset_error, cudaErrorStreamCaptureWrongThread);
  EXPECT_EQ(launch_error, cudaErrorStreamCaptureWrongThread);
  mgpu_test::saxpy(16, 1.0f, x.get(), x.get(), 1, 16, s);  // the capturing thread may
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

// A copy or memset issued on device 1's stream that touches device 0's memory needs peer access
// (or cudaMemcpyPeerAsync) in strict mode; a kernel's pointer arguments need it in both modes.
TEST_F(StrictEmu, CopiesAndKernelsTouchOnlyTheirDevicesMemoryOrAPeers) {
  const std::vector<float> v{1, 2, 3, 4};
  DeviceVector<float> on0(v);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  DeviceVector<float> on1(v.size());
  cudaStream_t s1 = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(on1.get(), on0.get(), on0.bytes(), cudaMemcpyDeviceToDevice, s1),
            cudaErrorInvalidValue);
  EXPECT_THAT(last_error_detail(), HasSubstr("memory of device 0"));
  EXPECT_EQ(cudaMemsetAsync(on0.get(), 0, on0.bytes(), s1), cudaErrorInvalidValue);
  cudaGetLastError();
  mgpu_test::saxpy(4, 1.0f, on0.get(), on1.get(), 1, 32, s1);  // checked when it runs
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaErrorIllegalAddress);
  cudaGetLastError();
  // A pointer inside a struct argument is checked as well.
  mgpu_test::copy_span(on0.get(), on1.get(), 4, s1);
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaErrorIllegalAddress);
  EXPECT_THAT(last_error_detail(), HasSubstr("argument 0 holds a pointer to memory of device 0"));
  cudaGetLastError();
  EXPECT_EQ(cudaMemcpyPeerAsync(on1.get(), 1, on0.get(), 0, on0.bytes(), s1), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
  EXPECT_EQ(on1.download(), v);
  DeviceVector<float> copied(v.size());
  mgpu_test::copy_span(on1.get(), copied.get(), 4, s1);  // its own device's memory: fine
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaSuccess) << last_error_detail();
  EXPECT_EQ(copied.download(), v);
  ASSERT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(on1.get(), on0.get(), on0.bytes(), cudaMemcpyDeviceToDevice, s1),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
  EXPECT_EQ(cudaDeviceDisablePeerAccess(0), cudaSuccess);
  cudaStreamDestroy(s1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

}  // namespace
