// tests/cpp/emu_test_kernels_cuda_elementwise.cpp -- the ops' per-element CUDA bodies, sum_all,
// the dtype conversions and correct_count on emulated GPUs, each against the host loop or the cpu::
// kernel, exactly; ctest runs it under two fiber orders (MGPU_EMU_SEED). Not named test_*.cpp: it
// needs -DMGPU_CUDA_EMULATION and its own target.
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

// ================================ per-element bodies ================================
// The same body runs on both sides: the CUDA grid-stride kernel must give exactly the host loop's
// bits. n = 1000 crosses a block (256 threads) boundary mid-way; n = 3 leaves most threads idle.

template <class MakeBody>
void check_body(cudaStream_t stream, const std::string& what, int64_t n, int num_inputs,
                MakeBody make_body) {
  SCOPED_TRACE(what + " n=" + std::to_string(n));
  std::vector<Floats> in;
  for (int i = 0; i < num_inputs; ++i) in.push_back(random_floats(n, 81 + i, -2.0f, 2.0f));
  Floats want = random_floats(n, 99);  // also the initial output, for in-place bodies
  std::vector<const float*> host_in;
  for (const Floats& v : in) host_in.push_back(v.data());
  const auto host_body = make_body(host_in, want.data());
  for (int64_t i = 0; i < n; ++i) host_body(i);

  std::vector<DeviceVector<float>*> dev;
  std::vector<const float*> dev_in;
  for (const Floats& v : in) {
    dev.push_back(new DeviceVector<float>(v));
    dev_in.push_back(dev.back()->get());
  }
  DeviceVector<float> out(random_floats(n, 99));
  gpu::for_each_index(n, make_body(dev_in, out.get()), stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(close(what, out.download(), want, kExact));
  for (DeviceVector<float>* d : dev) delete d;
}

template <mgpu::ops::BinaryOp op>
void check_binary(cudaStream_t stream, const std::string& name) {
  using namespace mgpu::ops;
  for (const int64_t n : {int64_t{1000}, int64_t{3}}) {
    check_body(stream, name + " same", n, 2, [](const std::vector<const float*>& in, float* out) {
      return BinarySameOut<op>{in[0], in[1], out};
    });
    // b broadcast over rows of 5 (a bias); n = 1000 and 3 are not both multiples: na = n.
    check_body(stream, name + " broadcast", n, 2,
               [n](const std::vector<const float*>& in, float* out) {
                 return BinaryOut<op>{in[0], in[1], out, n, n % 5 == 0 ? 5 : 1};
               });
    for (const bool first : {false, true}) {
      check_body(stream, name + " scalar", n, 1,
                 [first](const std::vector<const float*>& in, float* out) {
                   return BinaryScalarOut<op>{in[0], 0.75f, out, first};
                 });
    }
  }
}

TEST_F(CudaKernels, PerElementBodiesEqualTheHostLoopExactly) {
  using namespace mgpu::ops;
  for (const int64_t n : {int64_t{1000}, int64_t{3}}) {
    check_body(stream_, "relu", n, 1, [](const std::vector<const float*>& in, float* out) {
      return ReluOut{in[0], out};
    });
    check_body(stream_, "relu grad", n, 2, [](const std::vector<const float*>& in, float* out) {
      return ReluGradInput{in[0], in[1], out};
    });
    check_body(stream_, "sgd", n, 1, [](const std::vector<const float*>& in, float* out) {
      return SgdStep{out, in[0], nullptr, 1.0f, 0.1f / 256.0f, 0.0f, 0.0f};
    });
    check_body(stream_, "fill", n, 0, [](const std::vector<const float*>&, float* out) {
      return FillOut{out, -1.5f};
    });
  }
  check_binary<BinaryOp::Add>(stream_, "add");
  check_binary<BinaryOp::Sub>(stream_, "sub");
  check_binary<BinaryOp::Mul>(stream_, "mul");
  check_binary<BinaryOp::Div>(stream_, "div");
}

// The optimizer bodies write several arrays (parameter, momentum, Adam's moments, amsgrad's
// maximum) and read the clip factor through a pointer: each array must come back with the host
// loop's bits.
TEST_F(CudaKernels, OptimizerBodiesEqualTheHostLoopExactly) {
  using namespace mgpu::ops;
  for (const int64_t n : {int64_t{1000}, int64_t{3}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Floats grad = random_floats(n, 5, -30.0f, 30.0f);
    Floats p = random_floats(n, 6, -1.0f, 1.0f), m = random_floats(n, 7, -0.5f, 0.5f);
    Floats v = random_floats(n, 8, 0.0f, 0.3f), buf = random_floats(n, 9, -1.0f, 1.0f);
    Floats vmax = random_floats(n, 10, 0.0f, 0.3f);
    const Floats clip = {0.625f};
    DeviceVector<float> grad_(grad), p_(p), m_(m), v_(v), buf_(buf), clip_(clip), vmax_(vmax);
    DeviceVector<float> q_(p);  // the SGD step's parameter
    Floats q = p;
    // Adam with L2 (decay 1) and AdamW (decay < 1, no L2), at step 3 with bias corrections;
    // then AdamW with amsgrad (the running maximum vmax, about half of it above v).
    for (const int form : {0, 1, 2}) {
      const bool decoupled = form > 0;
      auto body = [&](float* pp, const float* g, float* mm, float* vv, const float* c,
                      float* vm) {
        return AdamStep{pp, g, mm, vv, c, 32.0f, 0.1f, 0.999f, 0.001f, 1e-8f,
                        decoupled ? 0.0f : 0.01f, decoupled ? 0.9995f : 1.0f,
                        0.01f / 0.271f, 0.0547449f, form == 2 ? vm : nullptr};
      };
      const auto host = body(p.data(), grad.data(), m.data(), v.data(), clip.data(),
                             vmax.data());
      for (int64_t i = 0; i < n; ++i) host(i);
      gpu::for_each_index(n, body(p_.get(), grad_.get(), m_.get(), v_.get(), clip_.get(),
                                  vmax_.get()),
                          stream_);
    }
    const auto sgd = [&](float* pp, const float* g, float* b, const float* c) {
      return SgdStep{pp, g, b, 32.0f, 0.1f, 0.9f, 1e-3f, c};
    };
    const auto host_sgd = sgd(q.data(), grad.data(), buf.data(), clip.data());
    for (int64_t i = 0; i < n; ++i) host_sgd(i);
    gpu::for_each_index(n, sgd(q_.get(), grad_.get(), buf_.get(), clip_.get()), stream_);
    // The book's forms on top: dampened, then Nesterov's first step (buf = g).
    for (const bool nesterov : {false, true}) {
      auto book = [&](float* pp, const float* g, float* b) {
        SgdStep s{pp, g, b, 1.0f, 0.05f, 0.9f, 1e-3f};
        s.dampening = nesterov ? 0.0f : 0.3f;
        s.nesterov = s.first = nesterov;
        return s;
      };
      const auto host = book(q.data(), grad.data(), buf.data());
      for (int64_t i = 0; i < n; ++i) host(i);
      gpu::for_each_index(n, book(q_.get(), grad_.get(), buf_.get()), stream_);
    }
    // The clip factor from a sum of squares: clipped (norm 8 > 2) and not (norm 0.5 < 2).
    Floats sq = {4096.0f, 16.0f}, factor = {kNaN, kNaN};
    DeviceVector<float> sq_(sq), factor_(factor);
    for (int j = 0; j < 2; ++j) {
      ClipFactor{sq.data() + j, factor.data() + j, 1.0f / 8.0f, 2.0f}(0);
      gpu::for_each_index(1, ClipFactor{sq_.get() + j, factor_.get() + j, 1.0f / 8.0f, 2.0f},
                          stream_);
    }
    sync();
    EXPECT_TRUE(close("adam param", p_.download(), p, kExact));
    EXPECT_TRUE(close("adam m", m_.download(), m, kExact));
    EXPECT_TRUE(close("adam v", v_.download(), v, kExact));
    EXPECT_TRUE(close("amsgrad vmax", vmax_.download(), vmax, kExact));
    EXPECT_TRUE(close("sgd param", q_.download(), q, kExact));
    EXPECT_TRUE(close("sgd momentum", buf_.download(), buf, kExact));
    EXPECT_TRUE(close("clip factor", factor_.download(), factor, kExact));
    EXPECT_FLOAT_EQ(factor[0], 2.0f / (8.0f + 1e-6f));
    EXPECT_EQ(factor[1], 1.0f);
  }
}

TEST_F(CudaKernels, LaunchersRunOnTheGivenStreamAndDefaultStream) {
  // for_each_index with n == 0 launches nothing; the default stream (0) works like any other.
  DeviceVector<float> y(Floats(4, 0.0f));
  gpu::for_each_index(0, mgpu::ops::FillOut{y.get(), 1.0f}, stream_);
  gpu::for_each_index(4, mgpu::ops::FillOut{y.get(), 2.0f}, nullptr);
  MGPU_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(y.download(), Floats(4, 2.0f));
}

// ================================ sum_all ================================
// One block of 256 threads: n = 255, 256, 257 straddle "every thread has one element"; 100000
// gives each thread ~390 in-order terms. The reference is a double sum in index order (ops::sum's
// CPU order); the GPU adds the same doubles in another order, so the two differ by double rounding
// (~n * 2^-53 * sum |x|) before both round to float (half an ulp of the result each way).

::testing::AssertionResult sum_close(const Floats& x, float got) {
  double want = 0.0, abs_sum = 0.0;
  for (const float v : x) {
    want += v;
    abs_sum += std::fabs(v);
  }
  const double tol = std::ldexp(std::fabs(want), -23) + 1e-12 * abs_sum;
  if (std::fabs(got - want) <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "sum_all of " << x.size() << " elements: got " << got
                                       << ", want " << want << " (tolerance " << tol << ")";
}

float run_sum_all(cudaStream_t stream, const Floats& x) {
  DeviceVector<float> x_(x), out_(Floats(1, kNaN));  // the NaN shows an unwritten result
  gpu::sum_all(static_cast<int64_t>(x.size()), x_.get(), out_.get(), stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out_.download()[0];
}

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

TEST_F(CudaKernels, SumAllMatchesADoubleSum) {
  for (const int64_t n : {0, 1, 2, 255, 256, 257, 1000, 100000}) {
    const Floats x = random_floats(n, 91 + static_cast<unsigned>(n % 97), -3.0f, 5.0f);
    const float got = run_sum_all(stream_, x);
    EXPECT_TRUE(sum_close(x, got)) << "n=" << n;
    if (n == 0) {
      EXPECT_EQ(bits_of(got), bits_of(0.0f));
    }
  }
  // Accumulated in double, as on the CPU: in float the 1s would vanish next to 1e8 (sum 0).
  Floats big(1002, 1.0f);
  big.front() = 1e8f;
  big.back() = -1e8f;
  EXPECT_EQ(run_sum_all(stream_, big), 1000.0f);
}

TEST_F(CudaKernels, SumAllIsBitwiseReproducibleWhateverTheFiberOrder) {
  const Floats x = random_floats(100000, 92, -1.0f, 1.0f);
  const uint32_t first = bits_of(run_sum_all(stream_, x));
  EXPECT_EQ(bits_of(run_sum_all(stream_, x)), first) << "second run, same seed";
  // The tree is fixed, so the fiber order (MGPU_EMU_SEED) must not change a bit. TearDown
  // restores the environment's seed.
  for (const uint64_t seed : {0, 3, 1234567}) {
    mgpu::emu::set_seed(seed);
    EXPECT_EQ(bits_of(run_sum_all(stream_, x)), first) << "fiber seed " << seed;
  }
  EXPECT_THROW(gpu::sum_all(-1, nullptr, nullptr, stream_), std::invalid_argument);
}

// ================================ convert (astype) ================================
// All 16 pairs of float, int32, int64, uint8, exactly (bytes compared, so NaN, -0 and rounding
// show): the same static_cast as the CPU's loop. Integer sources include negatives and values
// that wrap in a narrower type (defined behaviour, wraps alike on both). A float source keeps to
// values the target can hold: outside that range C++ leaves the result undefined, and x86 and
// GPUs do differ there (the GPU saturates). 300 elements (the list repeated) cross a 256-thread
// block.

// The values converted from From to To; float sources depend on what To can hold.
template <class From, class To>
std::vector<From> convert_source() {
  std::vector<double> v;
  if constexpr (std::is_same_v<From, float>) {
    if constexpr (std::is_same_v<To, uint8_t>) {
      v = {0.0, 0.5, 0.99, 1.0, 1.5, 2.5, 37.25, 127.9, 128.0, 200.75, 254.99, 255.0};
    } else if constexpr (std::is_same_v<To, int32_t>) {
      v = {0.0, -0.0, 0.4, -0.6, 1.5, -1.5, 2.5, -2.7, 1e6 + 0.5, -16777216.0,
           2147483520.0 /* the largest float below 2^31 */, -2147483648.0};
    } else if constexpr (std::is_same_v<To, int64_t>) {
      v = {0.0, -0.0, 0.4, -0.6, 1.5, -2.5, 3.75, -1e6 - 0.25, 16777216.0, 1e12, -9.2e18,
           2147483648.0};
    } else {  // float to float: the bits survive, NaN, infinities, -0 and subnormals included
      v = {0.0, -0.0, 1.5, -2.5, 1e-40, -1e-45, 3.4e38, HUGE_VAL, -HUGE_VAL, NAN, 1e12, -7.0};
    }
  } else if constexpr (std::is_same_v<From, uint8_t>) {
    v = {0, 1, 2, 127, 128, 200, 254, 255};
  } else if constexpr (std::is_same_v<From, int32_t>) {
    // Negatives, and values that wrap in uint8 or round in float.
    v = {0, 1, -1, 2, -128, 127, 255, 256, -257, 16777217, 2147483647.0, -2147483648.0};
  } else {
    // Also values that wrap in int32 (2^31, 2^40 + 5) and 2^53 + 1 below (not a double).
    v = {0, 1, -1, 255, -256, 300, 16777217, 2147483647.0, 2147483648.0, -2147483649.0,
         1099511627781.0, 0};
  }
  std::vector<From> out;
  for (size_t i = 0; i < 300; ++i) out.push_back(static_cast<From>(v[i % v.size()]));
  if constexpr (std::is_same_v<From, int64_t>) out[11] = -((int64_t{1} << 53) + 1);
  return out;
}

template <class To, class From>
void check_convert(cudaStream_t stream, const char* name) {
  SCOPED_TRACE(name);
  const std::vector<From> x = convert_source<From, To>();
  std::vector<To> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = static_cast<To>(x[i]);
  DeviceVector<From> x_(x);
  DeviceVector<To> y_(x.size());
  MGPU_CUDA_CHECK(cudaMemset(y_.get(), 0x5a, y_.bytes()));  // garbage where nothing is written
  gpu::convert<To, From>(static_cast<int64_t>(x.size()), x_.get(), y_.get(), stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<To> got = y_.download();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(To)), 0)
        << "index " << i << ": from " << +x[i] << " got " << +got[i] << ", want " << +want[i];
  }
  gpu::convert<To, From>(0, nullptr, nullptr, stream);  // n == 0 launches nothing
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
}

template <class To>
void check_convert_to(cudaStream_t stream, const std::string& to) {
  check_convert<To, float>(stream, (to + " <- float").c_str());
  check_convert<To, int32_t>(stream, (to + " <- int32").c_str());
  check_convert<To, int64_t>(stream, (to + " <- int64").c_str());
  check_convert<To, uint8_t>(stream, (to + " <- uint8").c_str());
}

TEST_F(CudaKernels, ConvertAllSixteenDtypePairsExactly) {
  check_convert_to<float>(stream_, "float");
  check_convert_to<int32_t>(stream_, "int32");
  check_convert_to<int64_t>(stream_, "int64");
  check_convert_to<uint8_t>(stream_, "uint8");
}

// ================================ correct_count ================================
// The reference is the CPU op's: cpu::argmax_rows, then count the rows whose label matches. Rows
// with ties (first maximum wins), NaNs (the first NaN is the maximum), labels that match by
// construction, and labels that must never match (-1, m, and for int64 2^32 + the argmax).

template <class Label>
void check_correct_count(cudaStream_t stream, int64_t n, int64_t m, unsigned seed) {
  SCOPED_TRACE("n=" + std::to_string(n) + " m=" + std::to_string(m) +
               " label bytes=" + std::to_string(sizeof(Label)));
  Floats z = random_floats(n * m, seed, -2.0f, 2.0f);
  for (int64_t i = 0; i < n; ++i) {
    float* row = z.data() + i * m;
    switch (i % 6) {
      case 1:  // a tie between a column early and one late in the row
        row[m / 3] = row[m - 1] = 7.0f;
        break;
      case 2:  // two NaNs: the first counts
        row[m - 1] = kNaN;
        row[m / 2] = kNaN;
        break;
      case 3:  // all equal: column 0
        for (int64_t j = 0; j < m; ++j) row[j] = 0.25f;
        break;
      default:
        break;
    }
  }
  std::vector<int64_t> pred(n);
  if (n > 0) cpu::argmax_rows(n, m, z.data(), pred.data());
  std::mt19937 gen(seed + 1);
  std::vector<Label> y(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (i % 5) {
      case 0:
      case 1:  // right
        y[i] = static_cast<Label>(pred[i]);
        break;
      case 2:  // random: right one time in m
        y[i] = static_cast<Label>(gen() % m);
        break;
      case 3:  // out of range: never right
        y[i] = static_cast<Label>(i % 2 == 0 ? -1 : m);
        break;
      default:  // wrong, or for int64 right only if truncated to 32 bits
        y[i] = std::is_same_v<Label, int64_t> ? static_cast<Label>((int64_t{1} << 32) + pred[i])
                                              : static_cast<Label>((pred[i] + 1) % (m + 1));
        break;
    }
  }
  int64_t hits = 0;
  for (int64_t i = 0; i < n; ++i) hits += pred[i] == static_cast<int64_t>(y[i]);

  DeviceVector<float> z_(z), out_(Floats(1, kNaN));
  DeviceVector<Label> y_(y);
  gpu::correct_count(n, m, z_.get(), y_.get(), out_.get(), stream);
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float got = out_.download()[0];
  EXPECT_EQ(got, static_cast<float>(hits));
  if (n > 0) {
    EXPECT_GT(hits, 0);  // the test itself: some rows do match
  }
}

TEST_F(CudaKernels, CorrectCountMatchesCpuArgmaxWithTiesNaNAndBothLabelTypes) {
  // m = 10 (LeNet), 40 (more columns than lanes), 1; n not a multiple of the block's 8 warps,
  // and n = 1000 (many rows per warp).
  for (const auto& [n, m] : {std::pair<int64_t, int64_t>{37, 10}, {1000, 10}, {9, 40}, {5, 1},
                             {1, 10}, {8, 3}}) {
    check_correct_count<int64_t>(stream_, n, m, 101);
    check_correct_count<int32_t>(stream_, n, m, 111);
  }
}

TEST_F(CudaKernels, CorrectCountOfNoRowsIsZero) {
  DeviceVector<float> out_(Floats(1, kNaN));
  gpu::correct_count(0, 10, nullptr, static_cast<const int64_t*>(nullptr), out_.get(), stream_);
  sync();
  EXPECT_EQ(bits_of(out_.download()[0]), bits_of(0.0f));
  DeviceVector<float> out32_(Floats(1, kNaN));
  gpu::correct_count(0, 10, nullptr, static_cast<const int32_t*>(nullptr), out32_.get(), stream_);
  sync();
  EXPECT_EQ(bits_of(out32_.download()[0]), bits_of(0.0f));
  DeviceVector<float> z_(Floats(4, 0.0f));
  DeviceVector<int64_t> y_(std::vector<int64_t>(4, 0));
  EXPECT_THROW(gpu::correct_count(4, 0, z_.get(), y_.get(), out32_.get(), stream_),
               std::invalid_argument);
}

}  // namespace
