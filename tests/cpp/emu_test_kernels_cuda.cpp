// tests/cpp/emu_test_kernels_cuda.cpp -- every op's cuda:: kernels on emulated GPUs against its
// cpu:: kernels on the same random inputs: sums within rel 1e-4 / abs 1e-5, per-element bodies,
// conversions, argmax and counts exactly. Shapes include batch 1, odd and non-square images,
// strides, padding and LeNet's layers at small batches; ctest runs it under two fiber orders
// (MGPU_EMU_SEED). Not named test_*.cpp: it needs -DMGPU_CUDA_EMULATION and its own target.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/gpu.h"
#include "cuda/runtime.cuh"
#include "ops/argmax.h"
#include "ops/avg_pool2d.h"
#include "ops/batch_norm.h"
#include "ops/conv2d.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "ops/max_pool2d.h"
#include "ops/relu.h"
#include "ops/softmax_ce.h"
#include "cuda_kernels_test_util.h"
#include "emu_test_util.h"

namespace {

namespace cpu = mgpu::ops::cpu;
namespace gpu = mgpu::ops::cuda;
using namespace mgpu_test;  // cuda_kernels_test_util.h, emu_test_util.h
using mgpu::ops::Conv2dShape;

// ================================ conv2d ================================

struct ConvCase {
  const char* name;
  Conv2dShape s;  // N, C, H, W, K, R, S, stride, pad
};

const ConvCase kConvCases[] = {
    {"lenet_conv1_n2_14x14_pad2", {2, 1, 14, 14, 6, 5, 5, 1, 2}},
    {"lenet_conv1_real_n2", {2, 1, 28, 28, 6, 5, 5, 1, 2}},
    {"lenet_conv2_real_n2", {2, 6, 14, 14, 16, 5, 5, 1, 0}},
    {"batch1_odd_nonsquare_pad1", {1, 3, 9, 7, 5, 3, 3, 1, 1}},
    {"stride2_pad1", {2, 2, 11, 8, 3, 3, 3, 2, 1}},
    {"stride2_pad2_rect_kernel", {1, 3, 10, 13, 4, 3, 5, 2, 2}},
    {"stride3_1x1", {3, 5, 7, 6, 7, 1, 1, 3, 0}},
    {"several_tiles_20x35", {1, 2, 20, 35, 3, 3, 3, 1, 1}},
    {"kernel_larger_than_stride_gap_s2", {2, 1, 19, 21, 2, 5, 4, 2, 1}},
};

// gtest (and ctest's test names) print a parameter by its name, not its bytes.
void PrintTo(const ConvCase& c, std::ostream* out) { *out << c.name; }

class Conv2dCuda : public CudaKernels, public ::testing::WithParamInterface<ConvCase> {};

int64_t x_numel(const Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
int64_t w_numel(const Conv2dShape& s) { return s.K * s.C * s.R * s.S; }
int64_t y_numel(const Conv2dShape& s) { return s.N * s.K * s.P() * s.Q(); }

TEST_P(Conv2dCuda, ForwardMatchesCpu) {
  const Conv2dShape s = GetParam().s;
  const Floats x = random_floats(x_numel(s), 1), w = random_floats(w_numel(s), 2),
               b = random_floats(s.K, 3);
  Floats want(y_numel(s)), want_nobias(y_numel(s));
  cpu::conv2d_forward(s, x.data(), w.data(), b.data(), want.data());
  cpu::conv2d_forward(s, x.data(), w.data(), nullptr, want_nobias.data());

  DeviceVector<float> dx_(x), dw_(w), db_(b), dy_(Floats(y_numel(s), kNaN));
  gpu::conv2d_forward(s, dx_.get(), dw_.get(), db_.get(), dy_.get(), stream_);
  sync();
  EXPECT_TRUE(close("conv2d_forward y", dy_.download(), want, kSum));
  gpu::conv2d_forward(s, dx_.get(), dw_.get(), nullptr, dy_.get(), stream_);
  sync();
  EXPECT_TRUE(close("conv2d_forward y (no bias)", dy_.download(), want_nobias, kSum));
}

TEST_P(Conv2dCuda, BackwardMatchesCpu) {
  const Conv2dShape s = GetParam().s;
  const Floats x = random_floats(x_numel(s), 4), w = random_floats(w_numel(s), 5),
               dy = random_floats(y_numel(s), 6);
  Floats want_dx(x_numel(s)), want_dw(w_numel(s)), want_db(s.K);
  cpu::conv2d_backward(s, x.data(), w.data(), dy.data(), want_dx.data(), want_dw.data(),
                       want_db.data());

  DeviceVector<float> x_(x), w_(w), dy_(dy), dx_(Floats(x_numel(s), kNaN)),
      dw_(Floats(w_numel(s), kNaN)), db_(Floats(s.K, kNaN));
  gpu::conv2d_backward(s, x_.get(), w_.get(), dy_.get(), dx_.get(), dw_.get(), db_.get(), stream_);
  sync();
  EXPECT_TRUE(close("conv2d_backward dx", dx_.download(), want_dx, kSum));
  const Floats dw = dw_.download();
  EXPECT_TRUE(close("conv2d_backward dw", dw, want_dw, kSum));
  EXPECT_TRUE(close("conv2d_backward db", db_.download(), want_db, kSum));

  // Skipping dx and db (LeNet's first layer) leaves dw's bits unchanged, and a second run gives
  // the same bits: the sums have a fixed order.
  DeviceVector<float> dw_only(Floats(w_numel(s), kNaN));
  gpu::conv2d_backward(s, x_.get(), w_.get(), dy_.get(), nullptr, dw_only.get(), nullptr, stream_);
  sync();
  EXPECT_TRUE(close("conv2d_backward dw (dx, db skipped)", dw_only.download(), dw, kExact));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dCuda, ::testing::ValuesIn(kConvCases),
                         [](const ::testing::TestParamInfo<ConvCase>& param) {
                           return std::string(param.param.name);
                         });

TEST_F(CudaKernels, Conv2dBackwardOfEmptyBatchWritesZeroGradients) {
  const Conv2dShape s{0, 2, 5, 5, 3, 3, 3, 1, 0};
  DeviceVector<float> w_(Floats(w_numel(s), 1.0f)), dw_(Floats(w_numel(s), kNaN)),
      db_(Floats(s.K, kNaN));
  gpu::conv2d_backward(s, nullptr, w_.get(), nullptr, nullptr, dw_.get(), db_.get(), stream_);
  sync();
  EXPECT_TRUE(close("dw, N=0", dw_.download(), Floats(w_numel(s), 0.0f), kExact));
  EXPECT_TRUE(close("db, N=0", db_.download(), Floats(s.K, 0.0f), kExact));
}

TEST_F(CudaKernels, Conv2dRejectsWhatItCannotLaunch) {
  const Conv2dShape too_wide{1, 1, 20, 20, 1, 9, 9, 1, 0};  // R * S = 81 > 64
  DeviceVector<float> buf(Floats(400, 0.0f));
  EXPECT_THROW(gpu::conv2d_backward(too_wide, buf.get(), buf.get(), buf.get(), nullptr, buf.get(),
                                    nullptr, stream_),
               std::invalid_argument);
  EXPECT_THROW(gpu::conv2d_backward(Conv2dShape{1, 1, 5, 5, 1, 3, 3, 1, 0}, buf.get(), buf.get(),
                                    buf.get(), nullptr, nullptr, nullptr, stream_),
               std::invalid_argument);
}

// A failed runtime call is reported once, by its own check: the launch check after the next,
// good kernel does not find the old error and blame that kernel.
TEST_F(CudaKernels, AFailedCallIsNotReportedAgainByTheNextKernelsLaunchCheck) {
  float host = 0.0f;  // pageable host memory: cudaMemsetAsync refuses it
  EXPECT_THROW(MGPU_CUDA_CHECK(cudaMemsetAsync(&host, 0, sizeof host, stream_)), std::exception);
  const Floats x = random_floats(2 * 3 * 4 * 4, 7);
  DeviceVector<float> x_(x), y_(Floats(2 * 3 * 2 * 2, kNaN));
  EXPECT_NO_THROW(gpu::avg_pool2d_forward(2, 3, 4, 4, 2, 2, 2, 2, x_.get(), y_.get(), stream_));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// mgpu's allocator puts a block on the device asked for even when other code on the thread (PyTorch,
// CuPy, a user's cudaSetDevice) switched the current device since mgpu last set it, and leaves
// the thread's current device as that code set it.
TEST(GpuDevice, AllocationLandsOnItsDeviceAfterOtherCodeSwitchedTheCurrentDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs 2 emulated GPUs";
  mgpu::gpu::set_device(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);  // the other code's switch
  size_t capacity = 0;
  void* p = mgpu::gpu::allocate(1, (size_t(3) << 20) + 123, &capacity);  // a size no test caches
  // cudaMemcpyPeer checks that each side is memory of the device it names.
  EXPECT_EQ(cudaMemcpyPeer(p, 1, p, 1, 4), cudaSuccess) << mgpu::emu::last_error_detail();
  int current = -1;
  EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
  cudaGetLastError();
  // Straight back to the emulator, not into the cache: the fixtures' resets free every allocation.
  cudaFree(p);
}

// ================================ avg_pool2d ================================

struct PoolCase {
  const char* name;
  int64_t N, C, H, W, kh, kw, sh, sw;
};

const PoolCase kPoolCases[] = {
    {"lenet_pool1_n2", 2, 6, 28, 28, 2, 2, 2, 2},
    {"lenet_pool2_n2", 2, 16, 10, 10, 2, 2, 2, 2},
    {"batch1_floor_9_to_4", 1, 3, 9, 9, 2, 2, 2, 2},
    {"overlapping_3x2_s1x2_nonsquare", 2, 2, 7, 5, 3, 2, 1, 2},
    {"gaps_2x3_s3x2", 1, 1, 8, 7, 2, 3, 3, 2},
};

void PrintTo(const PoolCase& c, std::ostream* out) { *out << c.name; }

class AvgPool2dCuda : public CudaKernels, public ::testing::WithParamInterface<PoolCase> {};

TEST_P(AvgPool2dCuda, ForwardAndBackwardMatchCpu) {
  const PoolCase c = GetParam();
  const int64_t P = (c.H - c.kh) / c.sh + 1, Q = (c.W - c.kw) / c.sw + 1;
  const size_t nx = c.N * c.C * c.H * c.W, ny = c.N * c.C * P * Q;
  const Floats x = random_floats(nx, 7), dy = random_floats(ny, 8);
  Floats want_y(ny), want_dx(nx);
  cpu::avg_pool2d_forward(c.N, c.C, c.H, c.W, c.kh, c.kw, c.sh, c.sw, x.data(), want_y.data());
  cpu::avg_pool2d_backward(c.N, c.C, c.H, c.W, c.kh, c.kw, c.sh, c.sw, dy.data(), want_dx.data());

  DeviceVector<float> x_(x), dy_(dy), y_(Floats(ny, kNaN)), dx_(Floats(nx, kNaN));
  gpu::avg_pool2d_forward(c.N, c.C, c.H, c.W, c.kh, c.kw, c.sh, c.sw, x_.get(), y_.get(), stream_);
  gpu::avg_pool2d_backward(c.N, c.C, c.H, c.W, c.kh, c.kw, c.sh, c.sw, dy_.get(), dx_.get(),
                           stream_);
  sync();
  EXPECT_TRUE(close("avg_pool2d_forward y", y_.download(), want_y, kSum));
  EXPECT_TRUE(close("avg_pool2d_backward dx", dx_.download(), want_dx, kSum));
}

INSTANTIATE_TEST_SUITE_P(Shapes, AvgPool2dCuda, ::testing::ValuesIn(kPoolCases),
                         [](const ::testing::TestParamInfo<PoolCase>& param) {
                           return std::string(param.param.name);
                         });

// ================================ max_pool2d ================================

struct MaxPoolCase {
  const char* name;
  mgpu::ops::MaxPoolShape s;
};

const MaxPoolCase kMaxPoolCases[] = {
    {"resnet_stem_n2_odd", {2, 3, 11, 9, 3, 3, 2, 2, 1, 1}},
    {"batch1_2x2", {1, 4, 8, 8, 2, 2, 2, 2, 0, 0}},
    {"overlap_3x2_s1x2_pad1_nonsquare", {2, 2, 7, 5, 3, 2, 1, 2, 1, 1}},
    {"gaps_2x3_s3x2", {1, 1, 8, 7, 2, 3, 3, 2, 0, 1}},
};

void PrintTo(const MaxPoolCase& c, std::ostream* out) { *out << c.name; }

class MaxPool2dCuda : public CudaKernels, public ::testing::WithParamInterface<MaxPoolCase> {};

// The same winners, values and sums in the same order as the CPU: every bit equal, on data with
// ties (a coarse grid), a NaN and -inf.
TEST_P(MaxPool2dCuda, ForwardAndBackwardMatchCpuBitForBit) {
  const mgpu::ops::MaxPoolShape s = GetParam().s;
  const size_t nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P() * s.Q();
  Floats x = random_floats(nx, 7);
  for (float& v : x) v = std::floor(v * 2.0f);
  x[3] = kNaN;
  x[nx - 1] = -INFINITY;
  const Floats dy = random_floats(ny, 8);
  Floats want_y(ny), want_dx(nx);
  std::vector<int32_t> want_at(ny);
  cpu::max_pool2d_forward(s, x.data(), want_y.data(), want_at.data());
  cpu::max_pool2d_backward(s, want_at.data(), dy.data(), want_dx.data());

  DeviceVector<float> x_(x), dy_(dy), y_(Floats(ny, kNaN)), dx_(Floats(nx, kNaN));
  DeviceVector<int32_t> at_(std::vector<int32_t>(ny, -1));
  gpu::max_pool2d_forward(s, x_.get(), y_.get(), at_.get(), stream_);
  gpu::max_pool2d_backward(s, at_.get(), dy_.get(), dx_.get(), stream_);
  sync();
  const Floats y = y_.download(), dx = dx_.download();
  EXPECT_EQ(at_.download(), want_at);
  EXPECT_EQ(0, std::memcmp(y.data(), want_y.data(), ny * sizeof(float))) << "y differs";
  EXPECT_EQ(0, std::memcmp(dx.data(), want_dx.data(), nx * sizeof(float))) << "dx differs";
}

INSTANTIATE_TEST_SUITE_P(Shapes, MaxPool2dCuda, ::testing::ValuesIn(kMaxPoolCases),
                         [](const ::testing::TestParamInfo<MaxPoolCase>& param) {
                           return std::string(param.param.name);
                         });

// ================================ batch norm ================================
// The CUDA reductions cut each channel into 2048-element chunks (at most 128): the shapes give
// one chunk, a few with boundaries inside rows, HW = 1, and the 128-chunk cap.

struct BnCase {
  const char* name;
  int64_t N, C, HW;
  float loc;
};

const BnCase kBnCases[] = {
    {"one_chunk_n2_c3_7x5", 2, 3, 35, 0.0f},
    {"two_chunks_odd_33x33", 2, 3, 33 * 33, 0.5f},
    {"three_chunks_c2_37x41", 3, 2, 37 * 41, -2.0f},
    {"nc_2d", 5, 7, 1, 0.0f},
    {"batch1_one_channel_7x7", 1, 1, 49, 0.0f},
    {"mean_1e3_over_std", 2, 2, 1500, 1000.0f},
    {"chunk_cap_128", 1, 1, 300000, 0.0f},
};

void PrintTo(const BnCase& c, std::ostream* out) { *out << c.name; }

class BatchNormCuda : public CudaKernels, public ::testing::WithParamInterface<BnCase> {};

TEST_P(BatchNormCuda, AllFourKernelsMatchCpuAndRepeatBitwise) {
  const BnCase c = GetParam();
  const size_t n = static_cast<size_t>(c.N * c.C * c.HW), C = static_cast<size_t>(c.C);
  const double count = static_cast<double>(c.N * c.HW);
  const float eps = 1e-5f;
  Floats x = random_floats(n, 31), dy = random_floats(n, 32);
  for (float& v : x) v += c.loc;
  const Floats gamma = random_floats(C, 33, 0.5f, 1.5f), beta = random_floats(C, 34);

  Floats m(C), v(C), y(n), s1(C), s2(C), dxt(n), dxe(n);
  cpu::batch_norm_stats(c.N, c.C, c.HW, x.data(), m.data(), v.data());
  cpu::batch_norm_forward(c.N, c.C, c.HW, x.data(), m.data(), v.data(), gamma.data(), beta.data(),
                          eps, y.data());
  cpu::batch_norm_backward_reduce(c.N, c.C, c.HW, x.data(), dy.data(), m.data(), v.data(), eps,
                                  s1.data(), s2.data());
  cpu::batch_norm_backward(c.N, c.C, c.HW, x.data(), dy.data(), m.data(), v.data(), gamma.data(),
                           s1.data(), s2.data(), count, eps, true, dxt.data());
  cpu::batch_norm_backward(c.N, c.C, c.HW, x.data(), dy.data(), m.data(), v.data(), nullptr,
                           nullptr, nullptr, count, eps, false, dxe.data());

  DeviceVector<float> x_(x), dy_(dy), gamma_(gamma), beta_(beta), m_(Floats(C, kNaN)),
      v_(Floats(C, kNaN)), y_(Floats(n, kNaN)), s1_(Floats(C, kNaN)), s2_(Floats(C, kNaN)),
      dxt_(Floats(n, kNaN)), dxe_(Floats(n, kNaN));
  DeviceVector<unsigned char> ws(gpu::batch_norm_workspace_bytes(c.N, c.C, c.HW));
  gpu::batch_norm_stats(c.N, c.C, c.HW, x_.get(), m_.get(), v_.get(), ws.get(), stream_);
  sync();
  EXPECT_TRUE(close("batch_norm_stats mean", m_.download(), m, kSum));
  EXPECT_TRUE(close("batch_norm_stats var", v_.download(), v, kSum));
  // The later kernels take the CPU's statistics, so each is compared on its own.
  DeviceVector<float> mc(m), vc(v);
  gpu::batch_norm_forward(c.N, c.C, c.HW, x_.get(), mc.get(), vc.get(), gamma_.get(), beta_.get(),
                          eps, y_.get(), stream_);
  gpu::batch_norm_backward_reduce(c.N, c.C, c.HW, x_.get(), dy_.get(), mc.get(), vc.get(), eps,
                                  s1_.get(), s2_.get(), ws.get(), stream_);
  sync();
  EXPECT_TRUE(close("batch_norm_forward y", y_.download(), y, kSum));
  EXPECT_TRUE(close("batch_norm_backward_reduce sum_dy", s1_.download(), s1, kSum));
  EXPECT_TRUE(close("batch_norm_backward_reduce sum_dy_xhat", s2_.download(), s2, kSum));
  DeviceVector<float> s1c(s1), s2c(s2);
  gpu::batch_norm_backward(c.N, c.C, c.HW, x_.get(), dy_.get(), mc.get(), vc.get(), gamma_.get(),
                           s1c.get(), s2c.get(), count, eps, true, dxt_.get(), stream_);
  gpu::batch_norm_backward(c.N, c.C, c.HW, x_.get(), dy_.get(), mc.get(), vc.get(), nullptr,
                           nullptr, nullptr, count, eps, false, dxe_.get(), stream_);
  sync();
  EXPECT_TRUE(close("batch_norm_backward dx (training)", dxt_.download(), dxt, kSum));
  EXPECT_TRUE(close("batch_norm_backward dx (evaluation)", dxe_.download(), dxe, kSum));

  // No atomics, fixed trees: a second run gives the same bits.
  const Floats first_m = m_.download(), first_v = v_.download(), first_s2 = s2_.download();
  gpu::batch_norm_stats(c.N, c.C, c.HW, x_.get(), m_.get(), v_.get(), ws.get(), stream_);
  gpu::batch_norm_backward_reduce(c.N, c.C, c.HW, x_.get(), dy_.get(), mc.get(), vc.get(), eps,
                                  s1_.get(), s2_.get(), ws.get(), stream_);
  sync();
  EXPECT_TRUE(close("batch_norm_stats mean, rerun", m_.download(), first_m, kExact));
  EXPECT_TRUE(close("batch_norm_stats var, rerun", v_.download(), first_v, kExact));
  EXPECT_TRUE(close("sum_dy_xhat, rerun", s2_.download(), first_s2, kExact));
}

INSTANTIATE_TEST_SUITE_P(Shapes, BatchNormCuda, ::testing::ValuesIn(kBnCases),
                         [](const ::testing::TestParamInfo<BnCase>& param) {
                           return std::string(param.param.name);
                         });

TEST_F(CudaKernels, BatchNormChunksFollowTheShapeOnly) {
  EXPECT_EQ(gpu::batch_norm_chunks(1, 1), 1);
  EXPECT_EQ(gpu::batch_norm_chunks(1, 2048), 1);
  EXPECT_EQ(gpu::batch_norm_chunks(2, 1089), 2);
  EXPECT_EQ(gpu::batch_norm_chunks(256, 28 * 28), 98);
  EXPECT_EQ(gpu::batch_norm_chunks(256, 56 * 56), 128);
  EXPECT_EQ(gpu::batch_norm_workspace_bytes(256, 64, 28 * 28), 64u * 98 * 2 * sizeof(double));
}

// ================================ softmax cross-entropy ================================

template <class Label>
std::vector<Label> random_labels(size_t n, int64_t m, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, m - 1);
  std::vector<Label> v(n);
  for (Label& y : v) y = static_cast<Label>(dist(gen));
  return v;
}

template <class Label>
void check_softmax_ce(cudaStream_t stream, int64_t n, int64_t m, float scale, unsigned seed) {
  SCOPED_TRACE("n=" + std::to_string(n) + " m=" + std::to_string(m) +
               " scale=" + std::to_string(scale) + " label bytes=" + std::to_string(sizeof(Label)));
  const Floats z = random_floats(n * m, seed, -scale, scale);
  const std::vector<Label> y = random_labels<Label>(n, m, seed + 1);
  const Floats dloss = random_floats(n, seed + 2);
  Floats want_loss(n), want_dz(n * m);
  cpu::softmax_ce_forward(n, m, z.data(), y.data(), want_loss.data());
  cpu::softmax_ce_backward(n, m, z.data(), y.data(), dloss.data(), want_dz.data());

  DeviceVector<float> z_(z), dloss_(dloss), loss_(Floats(n, kNaN)), dz_(Floats(n * m, kNaN));
  DeviceVector<Label> y_(y);
  DeviceVector<int32_t> bad_(std::vector<int32_t>{-5});
  gpu::softmax_ce_forward(n, m, z_.get(), y_.get(), loss_.get(), bad_.get(), stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(bad_.download()[0], gpu::kNoBadRow);
  gpu::softmax_ce_backward(n, m, z_.get(), y_.get(), dloss_.get(), dz_.get(), nullptr, stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(close("softmax_ce_forward loss", loss_.download(), want_loss, kSum));
  EXPECT_TRUE(close("softmax_ce_backward dlogits", dz_.download(), want_dz, kSum));
}

TEST_F(CudaKernels, SoftmaxCeMatchesCpuForBothLabelTypes) {
  // m = 10 (LeNet), m = 37 (more columns than a warp's lanes), m = 1; rows not a multiple of a
  // block's 4; logits near +-1000 must neither overflow nor lose the small terms.
  for (const auto& [n, m, scale] : {std::tuple<int64_t, int64_t, float>{5, 10, 3.0f},
                                    {1, 10, 1.0f},
                                    {9, 37, 5.0f},
                                    {3, 1, 1.0f},
                                    {4, 10, 1000.0f}}) {
    check_softmax_ce<int64_t>(stream_, n, m, scale, 11);
    check_softmax_ce<int32_t>(stream_, n, m, scale, 21);
  }
}

TEST_F(CudaKernels, SoftmaxCeOutOfRangeLabelGivesNaNRowAndFlagsTheFirstBadRow) {
  const int64_t n = 6, m = 10;
  const Floats z = random_floats(n * m, 31);
  // Row 2: m (would read row 3's first logit); row 4: -1; row 5: 2^40 + 3 (3 if truncated to
  // int32: it must be compared as int64).
  const std::vector<int64_t> y = {1, 9, m, 0, -1, (int64_t{1} << 40) + 3};
  DeviceVector<float> z_(z), dloss_(Floats(n, 1.0f)), loss_(Floats(n, 0.0f)),
      dz_(Floats(n * m, 0.0f));
  DeviceVector<int64_t> y_(y);
  DeviceVector<int32_t> bad_(1);
  gpu::softmax_ce_forward(n, m, z_.get(), y_.get(), loss_.get(), bad_.get(), stream_);
  sync();
  const Floats loss = loss_.download();
  const int32_t bad = bad_.download()[0];
  EXPECT_EQ(bad, 2);
  for (int64_t i = 0; i < n; ++i) {
    const bool bad_label = y[i] < 0 || y[i] >= m;
    EXPECT_EQ(std::isnan(loss[i]), bad_label) << "row " << i;
  }
  EXPECT_THROW(gpu::check_bad_row("softmax_ce_forward", bad, y[bad], m), std::out_of_range);
  EXPECT_NO_THROW(gpu::check_bad_row("softmax_ce_forward", gpu::kNoBadRow, 0, m));
  try {
    gpu::check_bad_row("softmax_ce_forward", bad, y[bad], m);
  } catch (const std::out_of_range& e) {
    EXPECT_EQ(std::string(e.what()),
              "softmax_ce_forward: label 10 in row 2 is out of range for 10 classes; labels must "
              "be class indices in [0, 10)");
  }

  gpu::softmax_ce_backward(n, m, z_.get(), y_.get(), dloss_.get(), dz_.get(), bad_.get(), stream_);
  sync();
  const Floats dz = dz_.download();
  EXPECT_EQ(bad_.download()[0], 2);
  for (int64_t i = 0; i < n; ++i) {
    const bool bad_label = y[i] < 0 || y[i] >= m;
    for (int64_t j = 0; j < m; ++j)
      EXPECT_EQ(std::isnan(dz[i * m + j]), bad_label) << i << "," << j;
  }
}

// ================================ linear: argmax, bias grad, sgemm
// ================================

TEST_F(CudaKernels, ArgmaxMatchesCpuWithTiesAndNaN) {
  const int64_t m = 40;  // more columns than lanes: the warp combines strided scans
  Floats x = random_floats(7 * m, 41);
  x[0 * m + 3] = 5.0f;  // row 0: a tie, the first maximum wins
  x[0 * m + 35] = 5.0f;
  x[1 * m + 38] = kNaN;  // row 1: NaN counts as the maximum, the first one wins
  x[1 * m + 39] = kNaN;
  x[2 * m + 0] = kNaN;
  for (int64_t j = 0; j < m; ++j) x[3 * m + j] = 1.0f;  // row 3: all equal -> column 0
  x[4 * m + 33] = 9.0f;                                 // row 4: the max in lane 1's second pass
  for (const int64_t cols : {m, int64_t{1}, int64_t{10}}) {
    const int64_t n = static_cast<int64_t>(x.size()) / cols;
    std::vector<int64_t> want(n);
    cpu::argmax_rows(n, cols, x.data(), want.data());
    DeviceVector<float> x_(x);
    DeviceVector<int64_t> out_(std::vector<int64_t>(n, -7));
    gpu::argmax_rows(n, cols, x_.get(), out_.get(), stream_);
    sync();
    EXPECT_EQ(out_.download(), want) << "m=" << cols;
  }
}

TEST_F(CudaKernels, BiasGradRowsMatchesCpu) {
  for (const auto& [n, m] : {std::pair<int64_t, int64_t>{1, 10}, {37, 10}, {9, 70}, {0, 5}}) {
    const Floats dy = random_floats(n * m, 51);
    Floats want(m);
    cpu::bias_grad_rows(n, m, dy.data(), want.data());
    DeviceVector<float> dy_(dy), db_(Floats(m, kNaN));
    gpu::bias_grad_rows(n, m, dy_.get(), db_.get(), stream_);
    sync();
    EXPECT_TRUE(close("bias_grad_rows n=" + std::to_string(n) + " m=" + std::to_string(m),
                      db_.download(), want, kSum));
  }
}

TEST_F(CudaKernels, SgemmAllTransposesStridesAlphaBeta) {
  // Sizes that are not multiples of the 16 x 16 tile, padded row strides, alpha and beta.
  const int64_t m = 19, n = 23, k = 37, pad = 3;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      for (const auto& [alpha, beta] : {std::pair<float, float>{1.0f, 0.0f}, {0.5f, -2.0f}}) {
        SCOPED_TRACE(std::string("trans_a=") + (ta ? "1" : "0") + " trans_b=" + (tb ? "1" : "0") +
                     " alpha=" + std::to_string(alpha) + " beta=" + std::to_string(beta));
        const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
        const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
        const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
        const Floats a = random_floats(a_rows * lda, 61), b = random_floats(b_rows * ldb, 62);
        Floats c = random_floats(m * ldc, 63);
        if (beta == 0.0f) {
          for (float& v : c) v = kNaN;  // beta == 0 must not read C
        }
        Floats want = c;
        cpu::sgemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, want.data(), ldc);
        DeviceVector<float> a_(a), b_(b), c_(c);
        gpu::sgemm(ta, tb, m, n, k, alpha, a_.get(), lda, b_.get(), ldb, beta, c_.get(), ldc,
                   stream_);
        sync();
        Floats got = c_.download();
        // The padding columns of C are not part of the product: both leave them alone.
        EXPECT_TRUE(close("sgemm C", got, want, kSum));
      }
    }
  }
}

TEST_F(CudaKernels, SgemmEdgeCases) {
  // k == 0: C = beta C; m == 0: nothing happens; a short row stride throws before launching.
  Floats c = random_floats(6, 71), want = c;
  for (float& v : want) v *= 3.0f;
  DeviceVector<float> c_(c), one(Floats(1, 0.0f));
  gpu::sgemm(false, false, 2, 3, 0, 1.0f, one.get(), 1, one.get(), 3, 3.0f, c_.get(), 3, stream_);
  gpu::sgemm(false, false, 0, 3, 4, 1.0f, nullptr, 4, nullptr, 3, 0.0f, nullptr, 3, stream_);
  sync();
  EXPECT_TRUE(close("sgemm k=0", c_.download(), want, kSum));
  EXPECT_THROW(gpu::sgemm(false, false, 2, 3, 4, 1.0f, one.get(), 3, one.get(), 3, 0.0f, c_.get(),
                          3, stream_),
               std::invalid_argument);
}

}  // namespace
