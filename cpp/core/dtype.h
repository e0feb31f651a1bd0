// cpp/core/dtype.h -- the element types mgpu knows: float32 for math, int32/int64 for labels,
// uint8 for raw images.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mgpu {

enum class DType : int8_t { F32 = 0, I32 = 1, I64 = 2, U8 = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
  }
  return "?";
}

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

}  // namespace mgpu
