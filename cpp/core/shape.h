// cpp/core/shape.h -- a tensor's shape: a short list of non-negative extents, row-major.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "core/error.h"

namespace mgpu {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Prints like a Python tuple: (2, 3), (5,), ().
inline std::ostream& operator<<(std::ostream& out, const Shape& s) {
  detail::put(out, s);
  return out;
}

}  // namespace mgpu
