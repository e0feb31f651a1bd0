// cpp/core/dtype.h -- the element types mgpu knows: float32 for math, bfloat16 for storage and
// interop of mixed-precision data (its raw 16 bits), int32/int64 for labels, uint8 for raw images.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define MGPU_DTYPE_HD __host__ __device__
#else
#define MGPU_DTYPE_HD
#endif

namespace mgpu {

enum class DType : int8_t { F32 = 0, I32 = 1, I64 = 2, U8 = 3, BF16 = 4 };

// float32 -> bfloat16 bits: round to nearest, ties to even, on the 32 bits (the top 16 kept).
// Denormals round like every other value (the smallest bfloat16 denormal is 2^-133), a value
// past the largest bfloat16 becomes an infinity, +-inf stay, and a NaN stays a NaN of its sign
// with its top 7 payload bits and the quiet bit set (never rounded into an infinity). That is
// PyTorch's and ml_dtypes' rounding, NaN payloads aside (they give one canonical quiet NaN).
// The bf16 products of ops/bf16.h round their packed operands the way vcvtneps2bf16 does, which
// differs in one thing: there, float32 denormals become zeros.
MGPU_DTYPE_HD inline uint16_t bf16_bits_from_float(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu))
    return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// bfloat16 bits -> float32, exact (bfloat16 is the top half of a float32).
MGPU_DTYPE_HD inline float float_from_bf16_bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

// One bfloat16 element: its bits, converted to and from float32 as above (through float for
// the integer types, as static_cast does for float).
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  MGPU_DTYPE_HD explicit BFloat16(float x) : bits(bf16_bits_from_float(x)) {}
  MGPU_DTYPE_HD operator float() const { return float_from_bf16_bits(bits); }
};
static_assert(sizeof(BFloat16) == 2, "bfloat16 is 2 bytes");

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::BF16: return 2;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
    case DType::BF16: return "bfloat16";
  }
  return "?";
}

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::BF16; }

}  // namespace mgpu
