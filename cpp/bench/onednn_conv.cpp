// cpp/bench/onednn_conv.cpp -- oneDNN's convolution timed at one 3x3 stride-1 layer, for
// `python -m mgpu bench conv --onednn PATH` (a peer, like PyTorch: built by `.ci/peers.sh onednn`
// against oneDNN from PyPI, never part of mgpu's build or tests).
//
// Usage: onednn_conv_bench BATCH CHANNELS SIDE REPEAT WARMUP
// Prints one JSON line: the forward (training) and backward (data gradient + weight and bias
// gradients) times in ms of REPEAT calls each after WARMUP untimed ones, and the implementation
// oneDNN chose. Memory formats are oneDNN's own choice ("any"), so the times are the primitives'
// best case: a framework that keeps NCHW tensors also pays reorders, which are not timed here.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace {

using dnnl::memory;

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

template <class F>
std::vector<double> times(F f, int warmup, int repeat) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const double a = now_ms();
    f();
    t.push_back(now_ms() - a);
  }
  return t;
}

std::string json_list(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char b[32];
    std::snprintf(b, sizeof b, "%s%.4f", i ? ", " : "", v[i]);
    s += b;
  }
  return s + "]";
}

// Deterministic values in [-1, 1) so no denormals or NaNs skew the timing.
void fill(const memory& m) {
  float* p = static_cast<float*>(m.get_data_handle());
  const size_t n = m.get_desc().get_size() / sizeof(float);
  for (size_t i = 0; i < n; ++i) p[i] = 0.01f * static_cast<float>((i * 7919) % 200) - 1.0f;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s BATCH CHANNELS SIDE REPEAT WARMUP\n", argv[0]);
    return 2;
  }
  const memory::dim N = std::atol(argv[1]), C = std::atol(argv[2]), H = std::atol(argv[3]);
  const int repeat = std::atoi(argv[4]), warmup = std::atoi(argv[5]);
  if (N < 1 || C < 1 || H < 1 || repeat < 1 || warmup < 0) {
    std::fprintf(stderr, "onednn_conv_bench: BATCH, CHANNELS, SIDE and REPEAT must be >= 1\n");
    return 2;
  }
  try {
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream s(eng);
    auto any = [](memory::dims d) {
      return memory::desc(d, memory::data_type::f32, memory::format_tag::any);
    };
    const memory::dims x{N, C, H, H}, w{C, C, 3, 3}, b{C}, st{1, 1}, pad{1, 1};
    const auto algo = dnnl::algorithm::convolution_auto;
    dnnl::convolution_forward::primitive_desc fpd(eng, dnnl::prop_kind::forward_training, algo,
                                                  any(x), any(w), any(b), any(x), st, pad, pad);
    dnnl::convolution_backward_data::primitive_desc dpd(eng, algo, any(x), any(w), any(x), st,
                                                        pad, pad, fpd);
    dnnl::convolution_backward_weights::primitive_desc wpd(eng, algo, any(x), any(w), any(b),
                                                           any(x), st, pad, pad, fpd);
    memory src(fpd.src_desc(), eng), wei(fpd.weights_desc(), eng), bias(fpd.bias_desc(), eng),
        dst(fpd.dst_desc(), eng), ddst(dpd.diff_dst_desc(), eng), dwei(dpd.weights_desc(), eng),
        dsrc(dpd.diff_src_desc(), eng), wsrc(wpd.src_desc(), eng),
        wddst(wpd.diff_dst_desc(), eng), gw(wpd.diff_weights_desc(), eng),
        gb(wpd.diff_bias_desc(), eng);
    for (const memory* m : {&src, &wei, &bias, &dst, &ddst, &dwei, &dsrc, &wsrc, &wddst, &gw, &gb})
      fill(*m);
    dnnl::convolution_forward fwd(fpd);
    dnnl::convolution_backward_data bwd_data(dpd);
    dnnl::convolution_backward_weights bwd_weights(wpd);
    const auto f = times([&] {
      fwd.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_BIAS, bias},
                      {DNNL_ARG_DST, dst}});
      s.wait();
    }, warmup, repeat);
    const auto bwd = times([&] {
      bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, ddst}, {DNNL_ARG_WEIGHTS, dwei},
                           {DNNL_ARG_DIFF_SRC, dsrc}});
      bwd_weights.execute(s, {{DNNL_ARG_SRC, wsrc}, {DNNL_ARG_DIFF_DST, wddst},
                              {DNNL_ARG_DIFF_WEIGHTS, gw}, {DNNL_ARG_DIFF_BIAS, gb}});
      s.wait();
    }, warmup, repeat);
    const dnnl::version_t* v = dnnl::version();
    std::printf("{\"forward_ms\": %s, \"backward_ms\": %s, \"impl\": \"%s\", "
                "\"version\": \"%d.%d.%d\"}\n",
                json_list(f).c_str(), json_list(bwd).c_str(), fpd.impl_info_str(), v->major,
                v->minor, v->patch);
  } catch (const dnnl::error& e) {
    std::fprintf(stderr, "onednn_conv_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
