// tests/cpp/emu_test_nccl.cpp -- the emulated NCCL (cpp/cuda/emu/nccl_emu.h) on 3 emulated GPUs:
// all-reduce, broadcast and all-gather against host loops (sums in rank order, compared exactly),
// communicators from ncclCommInitRank on threads and from ncclCommInitAll driven by one thread in
// a group, the strict emulator (streams behind the host), a mismatched call, and ncclCommAbort
// releasing ranks that wait for a rank that never arrives. Part of mgpu_cuda_emu_tests.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "cuda/emu/nccl_emu.h"
#include "cuda/runtime.cuh"
#include "emu_test_util.h"

namespace {

using mgpu_test::DeviceVector;

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

// One host thread drives every rank in a group, as mgpu's all-reduce does; `strict` runs it on
// the strict emulator, where the collectives wait in the streams until one of them is
// synchronised (here only rank 0's, from this thread: it must run the other ranks' work).
void grouped_allreduce(bool strict) {
  const size_t n = 777;
  if (strict) {
    setenv("MGPU_EMU_STRICT", "1", 1);
    mgpu::emu::reset_from_env();
  }
  std::vector<ncclComm_t> comms(kRanks);
  const int devices[kRanks] = {0, 1, 2};
  ASSERT_EQ(ncclCommInitAll(comms.data(), kRanks, devices), ncclSuccess);
  std::vector<cudaStream_t> streams(kRanks);
  std::vector<std::unique_ptr<DeviceVector<float>>> data;
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
    data.push_back(std::make_unique<DeviceVector<float>>(rank_values(r, n)));
  }
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < kRanks; ++r)
    ASSERT_EQ(ncclAllReduce(data[r]->get(), data[r]->get(), n, ncclFloat, ncclSum, comms[r],
                            streams[r]),
              ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(streams[0]), cudaSuccess);
  const std::vector<float> sum = rank_order_sum(n);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess);
    EXPECT_EQ(data[r]->download(), sum) << "rank " << r;
    ncclResult_t state = ncclInternalError;
    ASSERT_EQ(ncclCommGetAsyncError(comms[r], &state), ncclSuccess);
    EXPECT_EQ(state, ncclSuccess);
    EXPECT_EQ(ncclCommDestroy(comms[r]), ncclSuccess);
    cudaStreamDestroy(streams[r]);
  }
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

}  // namespace
