// cpp/ops/fma_peak.h -- the CPU's measured FMA peak: a loop of independent vector FMAs per
// instruction set (AVX2: 8 lanes, AVX-512: 16 lanes), run on 1..N threads at once. The yardstick
// that `bench train --parts layers` reports each layer's GFLOP/s against.
#pragma once

#include <cstdint>
#include <string>

namespace mgpu::ops {

// One thread's loop, compiled per instruction set (fma_peak_cpu.cpp): `iters` rounds of
// kFmaAccumulators independent vector FMAs acc = acc * a + b, every accumulator starting at 0.
// Returns the sum of every lane of every accumulator (with a = b = 1 it is lanes * iters, which
// proves how many FMAs ran); lanes() is the FMAs of one round (accumulators x vector width).
constexpr int kFmaAccumulators = 12;
namespace cpu::avx2 {
double fma_loop(int64_t iters, float a, float b);
int fma_lanes();
}  // namespace cpu::avx2
namespace cpu::avx512 {
double fma_loop(int64_t iters, float a, float b);
int fma_lanes();
}  // namespace cpu::avx512

struct FmaLoopResult {
  double lane_sum;  // what the loop returned
  double flops;     // 2 x lanes x iters: the FLOPs it did
};

// One run of the loop on this thread with the path `isa` ("avx2", "avx512", or "auto": the path
// the kernels run). std::invalid_argument for an unknown path or one this CPU lacks, or iters < 0.
FmaLoopResult fma_loop(const std::string& isa, int64_t iters, float a, float b);

struct FmaPeak {
  std::string isa;  // the path that ran
  int threads;
  int64_t iters;    // rounds of each thread's loop
  double flops;     // of all threads, one run
  double seconds;   // the fastest run's wall time (all threads started together)
  double gflops;    // flops / seconds / 1e9
};

// Runs the loop on `threads` threads at once (each its own std::thread, started together),
// sized so that one run takes about `seconds`, `repeat` times; the fastest run is the peak.
FmaPeak fma_peak(const std::string& isa, int threads, double seconds, int repeat);

}  // namespace mgpu::ops
