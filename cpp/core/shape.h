// cpp/core/shape.h -- a tensor's shape: a short list of non-negative extents, row-major.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "core/error.h"

namespace mgpu {

using Shape = std::vector<int64_t>;

// The element count of a shape whose size is already known to fit (a tensor's shape).
inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Bytes of a shape's buffer with `itemsize`-byte elements, for shapes that come from a user or
// from an op's size arithmetic: every extent must be >= 0 and the element count and the bytes
// must fit in int64 (as NumPy's limit), or ValueError names `what`, the shape and the bytes.
// Checking where a shape becomes a buffer keeps a huge shape from wrapping to a tiny buffer.
inline int64_t checked_nbytes(const Shape& s, int64_t itemsize, const char* what) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t d : s) {
    MGPU_CHECK_VALUE(d >= 0, what, ": negative dimension ", d, " in shape ", s);
    overflow = overflow || __builtin_mul_overflow(n, d, &n);
  }
  int64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(n, itemsize, &bytes);
  if (overflow) {
    long double exact = static_cast<long double>(itemsize);
    for (int64_t d : s) exact *= static_cast<long double>(d);
    throw ValueError(detail::cat(what, ": shape ", s, " is too large: it needs ",
                                 static_cast<double>(exact), " bytes, more than the ",
                                 INT64_MAX, " a tensor can address"));
  }
  return bytes;
}

// Prints like a Python tuple: (2, 3), (5,), ().
inline std::ostream& operator<<(std::ostream& out, const Shape& s) {
  detail::put(out, s);
  return out;
}

}  // namespace mgpu
