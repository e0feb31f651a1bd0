// cpp/core/error.h -- the exceptions mgpu throws and the checks that build their messages.
// Each exception maps to the Python exception a Python user expects (see cpp/bind/module.cpp):
// ValueError, TypeError, IndexError, FileNotFoundError, mgpu.DeviceError (a RuntimeError) and
// mgpu.OutOfMemoryError (a MemoryError).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mgpu {

struct ValueError : std::invalid_argument { using std::invalid_argument::invalid_argument; };
struct TypeError : std::invalid_argument { using std::invalid_argument::invalid_argument; };
struct IndexError : std::out_of_range { using std::out_of_range::out_of_range; };
// A device or library failure (CUDA, NCCL, MPI, a failed task on a device queue).
struct DeviceError : std::runtime_error { using std::runtime_error::runtime_error; };
// A device ran out of memory (Python: mgpu.OutOfMemoryError, a subclass of MemoryError).
struct OutOfMemoryError : std::runtime_error { using std::runtime_error::runtime_error; };
// A broken invariant of mgpu itself: always a bug worth reporting.
struct InternalError : std::logic_error { using std::logic_error::logic_error; };

namespace detail {
// Shapes print like Python tuples: (2, 3), (5,), ().
inline void put(std::ostream& out, const std::vector<int64_t>& shape) {
  out << '(';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
}
template <typename T>
void put(std::ostream& out, const T& x) {
  out << x;
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (put(out, args), ...);
  return out.str();
}
}  // namespace detail

}  // namespace mgpu

#define MGPU_CHECK_AS(kind, cond, ...)                       \
  do {                                                       \
    if (!(cond)) throw kind(::mgpu::detail::cat(__VA_ARGS__)); \
  } while (0)
#define MGPU_CHECK_VALUE(cond, ...) MGPU_CHECK_AS(::mgpu::ValueError, cond, __VA_ARGS__)
#define MGPU_CHECK_TYPE(cond, ...) MGPU_CHECK_AS(::mgpu::TypeError, cond, __VA_ARGS__)
#define MGPU_CHECK_INDEX(cond, ...) MGPU_CHECK_AS(::mgpu::IndexError, cond, __VA_ARGS__)
#define MGPU_ASSERT(cond, ...)                                                                  \
  MGPU_CHECK_AS(::mgpu::InternalError, cond, "internal error (a bug in mgpu, please report): ", \
                __FILE__, ":", __LINE__, ": ", #cond, " ", ##__VA_ARGS__)
