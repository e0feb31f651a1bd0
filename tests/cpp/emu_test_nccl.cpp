// tests/cpp/emu_test_nccl.cpp -- the emulated NCCL (cpp/cuda/emu/nccl_emu.h) on 3 emulated GPUs:
// all-reduce, broadcast and all-gather against host loops (sums in rank order, compared exactly),
// the bfloat16 all-reduce against hand-computed bits,
// communicators from ncclCommInitRank on threads and from ncclCommInitAll driven by one thread in
// a group, the strict emulator (streams behind the host), a mismatched call, ncclCommAbort
// releasing ranks that wait for a rank that never arrives and freeing the communicator (a later
// or concurrent call on it is a reported use after free), and a cycle of streams waiting for each
// other through a collective and an event (a deadlock, reported). Part of mgpu_cuda_emu_tests.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda/emu/nccl_emu.h"
#include "cuda/runtime.cuh"
#include "emu_test_util.h"

namespace mgpu_test {  // tests/cpp/emu_kernels.cu
void saxpy(int n, float a, const float* x, float* y, int blocks, int threads, cudaStream_t stream);
}  // namespace mgpu_test

namespace {

using mgpu::emu::last_error_detail;
using mgpu_test::DeviceVector;
using ::testing::HasSubstr;

constexpr int kRanks = 3;

std::vector<float> rank_values(int rank, size_t n) {
  std::mt19937 gen(100u + unsigned(rank));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// What every rank must hold after the all-reduce: float sums in rank order 0, 1, 2.
std::vector<float> rank_order_sum(size_t n) {
  std::vector<float> acc = rank_values(0, n);
  for (int r = 1; r < kRanks; ++r) {
    std::vector<float> x = rank_values(r, n);
    for (size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
  return acc;
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("MGPU_EMULATED_GPUS", "3", 1);
    mgpu::emu::reset_from_env();
  }
  void TearDown() override {
    unsetenv("MGPU_EMULATED_GPUS");
    unsetenv("MGPU_EMU_STRICT");
    unsetenv("MGPU_EMU_NCCL_STALL");
    unsetenv("MGPU_EMU_NCCL_FAIL");
    unsetenv("MGPU_EMU_SEED");
    cudaGetLastError();
    mgpu::emu::reset_from_env();
  }
};

TEST_F(Nccl, RanksOnThreadsReduceBroadcastAndGather) {
  const size_t n = 1000;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::vector<float>> reduced(kRanks), broadcast(kRanks), gathered(kRanks);
  std::vector<ncclResult_t> results(kRanks, ncclInternalError);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      ncclComm_t comm = nullptr;
      ncclResult_t res = ncclCommInitRank(&comm, kRanks, id, r);
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      DeviceVector<float> x(rank_values(r, n)), y(std::vector<float>(n, 0.0f));
      DeviceVector<float> all(std::vector<float>(n * kRanks, 0.0f));
      if (res == ncclSuccess) res = ncclAllReduce(x.get(), x.get(), n, ncclFloat, ncclSum, comm, s);
      // Root 2 sends its reduced buffer; every rank receives it in y.
      if (res == ncclSuccess) res = ncclBroadcast(x.get(), y.get(), n, ncclFloat, 2, comm, s);
      if (res == ncclSuccess) res = ncclAllGather(y.get(), all.get(), n / 4, ncclFloat, comm, s);
      cudaStreamSynchronize(s);
      reduced[r] = x.download();
      broadcast[r] = y.download();
      gathered[r] = all.download();
      cudaStreamDestroy(s);
      if (res == ncclSuccess) res = ncclCommDestroy(comm);
      results[r] = res;
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<float> sum = rank_order_sum(n);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(results[r], ncclSuccess) << "rank " << r;
    EXPECT_EQ(reduced[r], sum) << "rank " << r;
    EXPECT_EQ(broadcast[r], sum) << "rank " << r;
    for (int q = 0; q < kRanks; ++q)
      for (size_t i = 0; i < n / 4; ++i) ASSERT_EQ(gathered[r][q * (n / 4) + i], sum[i]);
  }
}

// One host thread drives every rank in a group, as mgpu's all-reduce does: rank r all-reduces
// in[r] (of `type`), and every rank must end with `want`. Rank 0's stream is synchronised first,
// from this thread: on the strict emulator, where the collectives wait in the streams until one
// of them is synchronised, it must run the other ranks' work.
template <class T>
void grouped_allreduce(const std::vector<std::vector<T>>& in, ncclDataType_t type,
                       const std::vector<T>& want) {
  const size_t n = want.size();
  std::vector<ncclComm_t> comms(kRanks);
  const int devices[kRanks] = {0, 1, 2};
  ASSERT_EQ(ncclCommInitAll(comms.data(), kRanks, devices), ncclSuccess);
  std::vector<cudaStream_t> streams(kRanks);
  std::vector<std::unique_ptr<DeviceVector<T>>> data;
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
    data.push_back(std::make_unique<DeviceVector<T>>(in[size_t(r)]));
  }
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < kRanks; ++r)  // the group is ended whatever a call returns
    EXPECT_EQ(ncclAllReduce(data[r]->get(), data[r]->get(), n, type, ncclSum, comms[r],
                            streams[r]),
              ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(streams[0]), cudaSuccess);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess);
    EXPECT_EQ(data[r]->download(), want) << "rank " << r;
    ncclResult_t state = ncclInternalError;
    ASSERT_EQ(ncclCommGetAsyncError(comms[r], &state), ncclSuccess);
    EXPECT_EQ(state, ncclSuccess);
    EXPECT_EQ(ncclCommDestroy(comms[r]), ncclSuccess);
    cudaStreamDestroy(streams[r]);
  }
}

// float32 sums in rank order; `strict` runs them on the strict emulator.
void grouped_allreduce(bool strict) {
  const size_t n = 777;
  if (strict) {
    setenv("MGPU_EMU_STRICT", "1", 1);
    mgpu::emu::reset_from_env();
  }
  std::vector<std::vector<float>> in;
  for (int r = 0; r < kRanks; ++r) in.push_back(rank_values(r, n));
  grouped_allreduce(in, ncclFloat, rank_order_sum(n));
}

// ncclBfloat16: every rank's bfloat16 values widened, added in float32 in rank order 0, 1, 2,
// the sum rounded to bfloat16 once (nearest, ties to even). Columns: one rounding where a
// rounding per addition gives 1.0 (1 + 2^-8 + 2^-8); ties to even, down and up; rank order (2^24
// + 1 rounds to 2^24 in float32 before -2^24 comes); a sum below half a bfloat16 step of 2.
TEST_F(Nccl, Bfloat16SumsInFloat32InRankOrderRoundedOnce) {
  const std::vector<std::vector<uint16_t>> in = {
      {0x3f80, 0x3f80, 0x3f81, 0x4b80, 0x3f80, 0xbf80},   // 1, 1, 1 + 2^-7, 2^24, 1, -1
      {0x3b80, 0x3b80, 0x3b80, 0x3f80, 0x3f80, 0xbb80},   // 2^-8 .., 1, 1, -2^-8
      {0x3b80, 0x0000, 0x0000, 0xcb80, 0x3b80, 0xbb80}};  // 2^-8, 0, 0, -2^24, 2^-8, -2^-8
  grouped_allreduce<uint16_t>(in, ncclBfloat16, {0x3f81, 0x3f80, 0x3f82, 0x0000, 0x4000, 0xbf81});
  // Half precision is not emulated.
  ncclComm_t comm = nullptr;
  const int device = 0;
  ASSERT_EQ(ncclCommInitAll(&comm, 1, &device), ncclSuccess);
  uint16_t x = 0;
  EXPECT_EQ(ncclAllReduce(&x, &x, 1, ncclFloat16, ncclSum, comm, nullptr), ncclInvalidArgument);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}

TEST_F(Nccl, OneThreadDrivesEveryRankInAGroup) { grouped_allreduce(false); }
TEST_F(Nccl, OneThreadDrivesEveryRankOnTheStrictEmulator) { grouped_allreduce(true); }

TEST_F(Nccl, AbortReleasesRanksWaitingForOneThatNeverArrives) {
  setenv("MGPU_EMU_NCCL_STALL", "1", 1);
  std::vector<ncclComm_t> comms(2);
  ASSERT_EQ(ncclCommInitAll(comms.data(), 2, nullptr), ncclSuccess);
  std::vector<std::unique_ptr<DeviceVector<float>>> data;
  std::vector<cudaStream_t> streams(2);
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
    data.push_back(std::make_unique<DeviceVector<float>>(rank_values(r, 16)));
  }
  std::atomic<int> launched{ncclInternalError};
  std::thread host([&] {
    ncclGroupStart();
    for (int r = 0; r < 2; ++r)
      ncclAllReduce(data[r]->get(), data[r]->get(), 16, ncclFloat, ncclSum, comms[r], streams[r]);
    launched = ncclGroupEnd();  // the lenient streams run the collectives here: they hang
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(launched.load(), ncclInternalError) << "the collective finished without rank 1";
  EXPECT_EQ(ncclCommAbort(comms[0]), ncclSuccess);
  host.join();
  EXPECT_EQ(launched.load(), ncclUnhandledCudaError);
  // The clique is gone: a new call on its other communicator is refused, not hung.
  EXPECT_EQ(ncclAllReduce(data[1]->get(), data[1]->get(), 16, ncclFloat, ncclSum, comms[1],
                          streams[1]),
            ncclInvalidUsage);
  ncclCommAbort(comms[1]);
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
}

TEST_F(Nccl, MismatchedCallsFailEveryRankAndFaultsAreInjected) {
  std::vector<ncclComm_t> comms(2);
  ASSERT_EQ(ncclCommInitAll(comms.data(), 2, nullptr), ncclSuccess);
  std::vector<std::unique_ptr<DeviceVector<float>>> data;
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    data.push_back(std::make_unique<DeviceVector<float>>(rank_values(r, 16)));
  }
  // A stream of device 0 for rank 1's communicator is refused.
  cudaSetDevice(0);
  EXPECT_EQ(ncclAllReduce(data[1]->get(), data[1]->get(), 16, ncclFloat, ncclSum, comms[1], 0),
            ncclInvalidArgument);
  ncclGroupStart();
  cudaSetDevice(0);
  ncclAllReduce(data[0]->get(), data[0]->get(), 16, ncclFloat, ncclSum, comms[0], 0);
  cudaSetDevice(1);
  ncclAllReduce(data[1]->get(), data[1]->get(), 8, ncclFloat, ncclSum, comms[1], 0);
  EXPECT_EQ(ncclGroupEnd(), ncclUnhandledCudaError);
  setenv("MGPU_EMU_NCCL_FAIL", "allreduce:1", 1);
  cudaSetDevice(1);
  EXPECT_EQ(ncclAllReduce(data[1]->get(), data[1]->get(), 16, ncclFloat, ncclSum, comms[1], 0),
            ncclUnhandledCudaError);
  for (ncclComm_t c : comms) ncclCommDestroy(c);
}

// A wait takes the event's most recent record at the time of the call, not the one it has when
// the wait runs. Streams a and b are held back by rank 0's part of an all-reduce (on b) whose
// rank 1 is issued last (on c), so nothing of theirs runs before every call below is made: the
// event is recorded after x = 2, b waits on it, then it is recorded again after x = 4. b's copy
// must see 2 for every seed (the later write need not have run); a wait that took the record
// current when it ran would see 4.
TEST_F(Nccl, AWaitTakesTheRecordCurrentAtTheCallNotWhenItRuns) {
  constexpr int kN = 64;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    setenv("MGPU_EMU_STRICT", "1", 1);
    setenv("MGPU_EMU_SEED", std::to_string(seed).c_str(), 1);
    mgpu::emu::reset_from_env();
    std::vector<ncclComm_t> comms(2);
    const int devices[2] = {1, 2};
    ASSERT_EQ(ncclCommInitAll(comms.data(), 2, devices), ncclSuccess);
    cudaStream_t a = nullptr, b = nullptr, c = nullptr;
    cudaEvent_t reduced = nullptr, e = nullptr;
    cudaSetDevice(2);
    ASSERT_EQ(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking), cudaSuccess);
    DeviceVector<float> on2(rank_values(1, 16));
    cudaSetDevice(1);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaSuccess);  // b's copy reads device 0's x
    DeviceVector<float> on1(rank_values(0, 16)), y(std::vector<float>(kN, 0.0f));
    ASSERT_EQ(ncclAllReduce(on1.get(), on1.get(), 16, ncclFloat, ncclSum, comms[0], b),
              ncclSuccess);
    ASSERT_EQ(cudaEventRecord(reduced, b), cudaSuccess);
    cudaSetDevice(0);
    ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    DeviceVector<float> x(std::vector<float>(kN, 1.0f));
    ASSERT_EQ(cudaStreamWaitEvent(a, reduced, 0), cudaSuccess);  // a waits for the all-reduce
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);      // x = 2
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
    mgpu_test::saxpy(kN, 1.0f, x.get(), x.get(), 1, 64, a);  // x = 4
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
    cudaSetDevice(1);
    mgpu_test::saxpy(kN, 1.0f, x.get(), y.get(), 1, 64, b);  // y = x, after the wait
    cudaSetDevice(2);
    ASSERT_EQ(ncclAllReduce(on2.get(), on2.get(), 16, ncclFloat, ncclSum, comms[1], c),
              ncclSuccess);
    cudaSetDevice(1);
    ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess) << last_error_detail();
    EXPECT_EQ(y.download(), std::vector<float>(kN, 2.0f)) << "seed " << seed;
    cudaSetDevice(0);
    ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
    EXPECT_EQ(x.download(), std::vector<float>(kN, 4.0f)) << "seed " << seed;
    cudaSetDevice(2);
    ASSERT_EQ(cudaStreamSynchronize(c), cudaSuccess);
    for (cudaStream_t s : {a, b, c}) cudaStreamDestroy(s);
    cudaEventDestroy(reduced);
    cudaEventDestroy(e);
    for (ncclComm_t comm : comms) ncclCommDestroy(comm);
    cudaSetDevice(0);
  }
}

// How the emulator names a stream in its reports.
std::string stream_name(cudaStream_t s, int device) {
  std::ostringstream out;
  out << "stream 0x" << std::hex << reinterpret_cast<uintptr_t>(s) << std::dec << " of device "
      << device;
  return out.str();
}

// Rank 1's stream waits on an event recorded on rank 0's stream after rank 0's part of an
// all-reduce, and rank 1's part comes after that wait: each stream waits for the other. On a GPU
// both hang; the strict emulator reports a deadlock naming both streams, and both go on after.
TEST_F(Nccl, StreamsWaitingForEachOtherThroughACollectiveAreADeadlockNamingThem) {
  setenv("MGPU_EMU_STRICT", "1", 1);
  mgpu::emu::reset_from_env();
  std::vector<ncclComm_t> comms(2);
  ASSERT_EQ(ncclCommInitAll(comms.data(), 2, nullptr), ncclSuccess);
  std::vector<cudaStream_t> streams(2);
  std::vector<std::unique_ptr<DeviceVector<float>>> data;
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
    data.push_back(std::make_unique<DeviceVector<float>>(rank_values(r, 16)));
  }
  cudaEvent_t after0 = nullptr;
  cudaSetDevice(0);
  ASSERT_EQ(cudaEventCreateWithFlags(&after0, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(data[0]->get(), data[0]->get(), 16, ncclFloat, ncclSum, comms[0],
                          streams[0]),
            ncclSuccess);
  ASSERT_EQ(cudaEventRecord(after0, streams[0]), cudaSuccess);
  cudaSetDevice(1);
  ASSERT_EQ(cudaStreamWaitEvent(streams[1], after0, 0), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(data[1]->get(), data[1]->get(), 16, ncclFloat, ncclSum, comms[1],
                          streams[1]),
            ncclSuccess);
  // Rank 1's stream is synchronised on a thread of its own: if the deadlock is not reported, the
  // test aborts the communicators (which ends the wait) and fails instead of hanging.
  std::atomic<int> synced{-1};
  std::string detail;
  std::thread waiter([&] {
    cudaSetDevice(1);
    cudaError_t e = cudaStreamSynchronize(streams[1]);
    detail = last_error_detail();
    synced = e;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (synced.load() < 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (synced.load() < 0) {
    ncclCommAbort(comms[0]);
    waiter.join();
    FAIL() << "the wait cycle was not reported within 30 s (it hung)";
  }
  waiter.join();
  EXPECT_EQ(synced.load(), cudaErrorLaunchFailure);
  EXPECT_THAT(detail, HasSubstr("deadlock"));
  EXPECT_THAT(detail, HasSubstr(stream_name(streams[0], 0)));
  EXPECT_THAT(detail, HasSubstr(stream_name(streams[1], 1)));
  cudaSetDevice(0);
  EXPECT_EQ(cudaStreamSynchronize(streams[0]), cudaErrorLaunchFailure);
  EXPECT_THAT(last_error_detail(), HasSubstr("deadlock"));
  // Both streams go on: the next all-reduce, issued in one group, is exact.
  std::vector<std::unique_ptr<DeviceVector<float>>> fresh;
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    fresh.push_back(std::make_unique<DeviceVector<float>>(rank_values(r, 16)));
  }
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 2; ++r)
    ASSERT_EQ(ncclAllReduce(fresh[r]->get(), fresh[r]->get(), 16, ncclFloat, ncclSum, comms[r],
                            streams[r]),
              ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  std::vector<float> sum = rank_values(0, 16), one = rank_values(1, 16);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] += one[i];
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    ASSERT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess) << last_error_detail();
    EXPECT_EQ(fresh[r]->download(), sum) << "rank " << r;
    cudaStreamDestroy(streams[r]);
    ncclCommDestroy(comms[r]);
  }
  cudaSetDevice(0);
  cudaEventDestroy(after0);
}

// ncclCommAbort frees the communicator, as NCCL does: a later call on the handle is a use after
// free, which the emulator refuses and reports (on stderr, and counted), never runs.
TEST_F(Nccl, AnAbortedCommunicatorIsFreedAndALaterCallOnItFailsLoudly) {
  std::vector<ncclComm_t> comms(2);
  ASSERT_EQ(ncclCommInitAll(comms.data(), 2, nullptr), ncclSuccess);
  DeviceVector<float> x(rank_values(0, 16));
  const uint64_t before = mgpu::emu::nccl_freed_uses();
  ASSERT_EQ(ncclCommAbort(comms[0]), ncclSuccess);
  ::testing::internal::CaptureStderr();
  cudaSetDevice(0);
  EXPECT_EQ(ncclAllReduce(x.get(), x.get(), 16, ncclFloat, ncclSum, comms[0], 0), ncclInvalidUsage);
  ncclResult_t state = ncclSuccess;
  EXPECT_EQ(ncclCommGetAsyncError(comms[0], &state), ncclInvalidUsage);
  EXPECT_EQ(ncclCommAbort(comms[0]), ncclInvalidUsage) << "freed twice";
  const std::string stderr_text = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(mgpu::emu::nccl_freed_uses() - before, 3u);
  EXPECT_THAT(stderr_text,
              HasSubstr("ncclAllReduce on a communicator that ncclCommAbort has freed"));
  EXPECT_THAT(stderr_text, HasSubstr("ncclCommAbort on a communicator that ncclCommAbort has freed"));
  // The clique's other communicator is not freed: its calls are refused as an aborted clique's,
  // which is no use after free; once destroyed, it is freed as well.
  cudaSetDevice(1);
  DeviceVector<float> y(rank_values(1, 16));
  EXPECT_EQ(ncclAllReduce(y.get(), y.get(), 16, ncclFloat, ncclSum, comms[1], 0), ncclInvalidUsage);
  EXPECT_EQ(mgpu::emu::nccl_freed_uses() - before, 3u);
  EXPECT_EQ(ncclCommDestroy(comms[1]), ncclSuccess);
  int rank = -1;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(ncclCommUserRank(comms[1], &rank), ncclInvalidUsage);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("ncclCommUserRank on a communicator that ncclCommDestroy has freed"));
  EXPECT_EQ(mgpu::emu::nccl_freed_uses() - before, 4u);
  cudaSetDevice(0);
}

// A watchdog's abort while another thread launches on the communicator: on the strict emulator
// a launch lasts long enough for the abort to land inside it, and the launch then fails as a use
// after free (reported) instead of running on a freed communicator. An abort that comes only
// after the launch has returned is no use after free.
TEST_F(Nccl, AnAbortWhileAnotherThreadLaunchesOnTheCommunicatorIsReported) {
  setenv("MGPU_EMU_STRICT", "1", 1);
  mgpu::emu::reset_from_env();
  int raced = 0;
  for (int attempt = 0; attempt < 20 && raced == 0; ++attempt) {
    std::vector<ncclComm_t> comms(2);
    ASSERT_EQ(ncclCommInitAll(comms.data(), 2, nullptr), ncclSuccess);
    cudaSetDevice(0);
    DeviceVector<float> x(rank_values(0, 16));
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    const uint64_t before = mgpu::emu::nccl_freed_uses();
    std::atomic<bool> calling{false};
    std::atomic<int> launched{-1};
    ::testing::internal::CaptureStderr();
    std::thread launcher([&] {
      cudaSetDevice(0);
      calling = true;
      launched = ncclAllReduce(x.get(), x.get(), 16, ncclFloat, ncclSum, comms[0], s);
    });
    while (!calling.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    EXPECT_EQ(ncclCommAbort(comms[0]), ncclSuccess);
    launcher.join();
    const std::string stderr_text = ::testing::internal::GetCapturedStderr();
    const uint64_t uses = mgpu::emu::nccl_freed_uses() - before;
    if (launched.load() == ncclSuccess) {
      EXPECT_EQ(uses, 0u) << "the launch returned before the abort: " << stderr_text;
    } else {
      EXPECT_EQ(launched.load(), ncclInvalidUsage);
      EXPECT_GE(uses, 1u);
      EXPECT_THAT(stderr_text, HasSubstr("use after free"));
      ++raced;
    }
    cudaStreamSynchronize(s);  // a launched collective fails: its clique was aborted
    cudaGetLastError();
    cudaStreamDestroy(s);
    ncclCommAbort(comms[1]);
  }
  EXPECT_GT(raced, 0) << "no abort landed inside (or before) the launch in 20 attempts";
}

}  // namespace
