// cpp/cuda/emu/bf16.h -- the slice of CUDA's cuda_bf16.h that mgpu's kernels use, as the emulator
// defines it for g++ (include it through cuda/bf16.cuh): the __nv_bfloat16 and __nv_bfloat162
// types and their conversions to and from float, with the real header's numbers:
// - float -> bfloat16 (__float2bfloat16_rn, __float2bfloat16, __floats2bfloat162_rn,
//   __float2bfloat162_rn) rounds to nearest, ties to even, on the bits: the kept top half goes up
//   when the dropped half is above 0x8000 or is 0x8000 with an odd kept half. Float32 denormals
//   round like any other bits (no flush to zero: cvt.rn.bf16.f32 keeps subnormals), a finite value
//   that rounds past the largest bfloat16 becomes inf of its sign, +-inf stays, and every NaN
//   becomes the canonical NaN 0x7fff (sign and payload dropped).
// - __float2bfloat16_rz truncates (drops the low half; a NaN becomes 0x7fff likewise).
// - bfloat16 -> float (__bfloat162float, __low2float, __high2float) is exact: the bits shifted
//   into the top half.
// __nv_bfloat162 holds .x in its low 16 bits and .y in its high 16 bits, as on a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/emu/builtins.h"

// The raw bits, as the real header's __nv_bfloat16_raw.
struct __nv_bfloat16_raw {
  unsigned short x;
};

// Storage only: kernels convert with the functions below (no arithmetic operators, no implicit
// conversions, which the real header offers only without __CUDA_NO_BFLOAT16_CONVERSIONS__).
struct __nv_bfloat16 {
  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : x_(r.x) {}
  constexpr operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{x_}; }

 private:
  unsigned short x_;
};

struct __nv_bfloat162 {
  __nv_bfloat16 x;  // low half
  __nv_bfloat16 y;  // high half
};

static_assert(sizeof(__nv_bfloat16) == 2 && sizeof(__nv_bfloat162) == 4,
              "bfloat16 types must have the GPU's sizes");

namespace mgpu::emu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The bfloat16 bits of f rounded to nearest even (the rule above).
inline unsigned short bf16_bits_rn(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN: the canonical one
  const uint32_t kept = u >> 16, dropped = u & 0xffffu;
  const bool up = dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u) != 0);
  return static_cast<unsigned short>(kept + (up ? 1u : 0u));
}

inline unsigned short bf16_bits_rz(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<unsigned short>(u >> 16);
}

inline __nv_bfloat16 bf16_of_bits(unsigned short bits) { return __nv_bfloat16_raw{bits}; }

}  // namespace mgpu::emu

__host__ __device__ inline unsigned short __bfloat16_as_ushort(const __nv_bfloat16 h) {
  return static_cast<__nv_bfloat16_raw>(h).x;
}
__host__ __device__ inline __nv_bfloat16 __ushort_as_bfloat16(const unsigned short i) {
  return ::mgpu::emu::bf16_of_bits(i);
}

__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rn(const float a) {
  return ::mgpu::emu::bf16_of_bits(::mgpu::emu::bf16_bits_rn(a));
}
__host__ __device__ inline __nv_bfloat16 __float2bfloat16(const float a) {
  return __float2bfloat16_rn(a);
}
__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rz(const float a) {
  return ::mgpu::emu::bf16_of_bits(::mgpu::emu::bf16_bits_rz(a));
}

__host__ __device__ inline float __bfloat162float(const __nv_bfloat16 a) {
  const uint32_t u = static_cast<uint32_t>(__bfloat16_as_ushort(a)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// .x = a, .y = b, each rounded to nearest even.
__host__ __device__ inline __nv_bfloat162 __floats2bfloat162_rn(const float a, const float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
__host__ __device__ inline __nv_bfloat162 __float2bfloat162_rn(const float a) {
  return __floats2bfloat162_rn(a, a);
}
__host__ __device__ inline float __low2float(const __nv_bfloat162 a) {
  return __bfloat162float(a.x);
}
__host__ __device__ inline float __high2float(const __nv_bfloat162 a) {
  return __bfloat162float(a.y);
}
