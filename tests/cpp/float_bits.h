// tests/cpp/float_bits.h -- a float's 32 bits and back (a bit cast, C++20's std::bit_cast in
// C++17), for the tests that compare results bit for bit or build floats from their fields.
#pragma once

#include <cstdint>
#include <cstring>

namespace mgpu_test {

template <typename To, typename From>
To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: the two types differ in size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

inline uint32_t to_bits(float f) { return bit_cast<uint32_t>(f); }
inline float from_bits(uint32_t u) { return bit_cast<float>(u); }

}  // namespace mgpu_test
