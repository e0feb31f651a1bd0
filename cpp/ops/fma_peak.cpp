// cpp/ops/fma_peak.cpp -- runs the per-path FMA loop (fma_peak_cpu.cpp) on N threads at once and
// times it: the CPU's measured single-precision FMA peak for that path and thread count.
#include "ops/fma_peak.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "ops/cpu_isa.h"

namespace mgpu::ops {

namespace {

using Loop = double (*)(int64_t, float, float);

struct Path {
  std::string name;
  Loop loop;
  int lanes;
};

Path path(const std::string& isa) {
  std::string want = isa;
  if (want.empty() || want == "auto") want = cpu::isa_choice().name;
  if (want == "avx2") return {"avx2", &cpu::avx2::fma_loop, cpu::avx2::fma_lanes()};
  if (want == "avx512") {
    if (!cpu::cpu_has_avx512()) {
      throw std::invalid_argument("fma_peak: this CPU (or its OS) lacks AVX-512 F/BW/DQ/VL; "
                                  "use isa='avx2'");
    }
    return {"avx512", &cpu::avx512::fma_loop, cpu::avx512::fma_lanes()};
  }
  throw std::invalid_argument("fma_peak: isa must be 'auto', 'avx2' or 'avx512', got '" + isa +
                              "'");
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One run: `threads` threads wait at a start line, then each runs the loop; the wall time from
// the start to the last thread's end.
double run(const Path& p, int threads, int64_t iters) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> sums(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      sums[t] = p.loop(iters, 1.0f, 1e-7f);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const double t0 = now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  const double dt = now() - t0;
  volatile double keep = 0.0;  // the results stay observable
  for (double s : sums) keep = keep + s;
  return dt;
}

}  // namespace

FmaLoopResult fma_loop(const std::string& isa, int64_t iters, float a, float b) {
  if (iters < 0) throw std::invalid_argument("fma_loop: iters must be >= 0");
  const Path p = path(isa);
  return {p.loop(iters, a, b), 2.0 * p.lanes * static_cast<double>(iters)};
}

FmaPeak fma_peak(const std::string& isa, int threads, double seconds, int repeat) {
  if (threads < 1) throw std::invalid_argument("fma_peak: threads must be >= 1");
  if (!(seconds > 0.0) || seconds > 60.0) {
    throw std::invalid_argument("fma_peak: seconds must be in (0, 60]");
  }
  if (repeat < 1) throw std::invalid_argument("fma_peak: repeat must be >= 1");
  const Path p = path(isa);
  // Size the loop on one thread: double the rounds until a run takes a tenth of `seconds`, then
  // scale to `seconds` (the clock and the threads' start cost a few microseconds). Each size
  // takes the fastest of 3 runs, so a run descheduled by other jobs does not size the loop
  // far too small.
  auto fastest = [&](int64_t n) {
    double t = run(p, 1, n);
    for (int r = 0; r < 2; ++r) t = std::min(t, run(p, 1, n));
    return t;
  };
  int64_t iters = 1 << 12;
  double dt = fastest(iters);
  while (dt < seconds / 10 && iters < (int64_t{1} << 40)) {
    iters *= 2;
    dt = fastest(iters);
  }
  iters = std::max<int64_t>(1, static_cast<int64_t>(iters * seconds / dt));
  double best = 0.0;
  for (int r = 0; r < repeat; ++r) {
    const double t = run(p, threads, iters);
    if (r == 0 || t < best) best = t;
  }
  const double flops = 2.0 * p.lanes * static_cast<double>(iters) * threads;
  return {p.name, threads, iters, flops, best, flops / best / 1e9};
}

}  // namespace mgpu::ops
