// cpp/ops/cpu_isa.cpp -- picks the kernels' instruction-set path once and forwards every kernel
// of MGPU_CPU_ISA_KERNELS (cpu_isa.h) to it. Both paths add in the same order with the same FMAs
// (the AVX2 path runs the 16-lane layout as two 8-lane halves), so they give bitwise-equal results.
#include "ops/cpu_isa.h"

#include <cpuid.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace mgpu::ops::cpu {

namespace {

std::string trim(std::string s) {
  const size_t b = s.find_first_not_of(' ');
  const size_t e = s.find_last_not_of(' ');
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

IsaChoice choose() {
  __builtin_cpu_init();
  const bool v3 = cpu_has_avx2(), v4 = cpu_has_avx512();
  const std::string cpu = cpu_model().empty() ? std::string("this CPU") : cpu_model();
  if (!v3) {
    throw std::runtime_error(
        "mgpu needs an x86-64-v3 CPU (AVX2, FMA, BMI1/2: Intel Haswell, AMD Zen or newer); " + cpu +
        " lacks them");
  }
  const char* env = std::getenv("MGPU_ISA");
  const std::string want = env ? trim(env) : std::string();
  if (want.empty() || want == "auto") {
    const std::string how = want.empty() ? "auto (MGPU_ISA unset)" : "auto (MGPU_ISA=auto)";
    if (v4 && cpu_has_avx512_bf16()) {
      return {Isa::AVX512, "avx512",
              how + ": the CPU has AVX-512 F/BW/DQ/VL, and AVX512_BF16 for the bf16 products",
              true};
    }
    if (v4) return {Isa::AVX512, "avx512", how + ": the CPU has AVX-512 F/BW/DQ/VL"};
    return {Isa::AVX2, "avx2", how + ": the CPU has AVX2 + FMA but not AVX-512 F/BW/DQ/VL"};
  }
  if (want == "avx2") return {Isa::AVX2, "avx2", "forced by MGPU_ISA=avx2"};
  if (want == "avx512_bf16") {
    if (!cpu_has_avx512_bf16()) {
      throw std::invalid_argument("MGPU_ISA=avx512_bf16, but " + cpu +
                                  " lacks AVX-512 F/BW/DQ/VL with AVX512_BF16 (or the OS does not "
                                  "enable it); unset MGPU_ISA or set MGPU_ISA=avx512 or avx2");
    }
    return {Isa::AVX512, "avx512", "forced by MGPU_ISA=avx512_bf16", true};
  }
  if (want == "avx512") {
#if defined(MGPU_AVX512_EMULATED)
    // A test build's kernels (tests/cpp/avx512_emulated.h): the AVX-512 path compiled for AVX2.
    return {Isa::AVX512, "avx512",
            "forced by MGPU_ISA=avx512, emulated with AVX2 instructions (a test build)"};
#endif
    if (!v4) {
      throw std::invalid_argument("MGPU_ISA=avx512, but " + cpu +
                                  " lacks AVX-512 F/BW/DQ/VL (or the OS does not enable it); "
                                  "unset MGPU_ISA or set MGPU_ISA=avx2");
    }
    return {Isa::AVX512, "avx512", "forced by MGPU_ISA=avx512"};
  }
  throw std::invalid_argument("MGPU_ISA='" + want +
                              "' is not a CPU kernel path; use auto, avx2, avx512 or avx512_bf16");
}

}  // namespace

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

bool bf16_hardware_dot() { return isa_choice().bf16_dot; }

std::string cpu_model() {
  unsigned regs[12] = {};
  unsigned top = __get_cpuid_max(0x80000000u, nullptr);
  if (top < 0x80000004u) return "";
  for (unsigned i = 0; i < 3; ++i) {
    __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2],
                &regs[4 * i + 3]);
  }
  char brand[49] = {};
  std::memcpy(brand, regs, 48);
  return trim(brand);
}

const IsaChoice& isa_choice() {
  static const IsaChoice choice = choose();  // a throw leaves it unset: the next call throws too
  return choice;
}

#define MGPU_CPU_ISA_FORWARD(ret, name, params, args)                                   \
  ret name params {                                                                     \
    return active_isa() == Isa::AVX512 ? avx512::name args : avx2::name args;           \
  }
MGPU_CPU_ISA_KERNELS(MGPU_CPU_ISA_FORWARD)
#undef MGPU_CPU_ISA_FORWARD

}  // namespace mgpu::ops::cpu
