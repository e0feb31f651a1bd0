// cpp/cuda/emu/device_functions.h -- what kernels call, as the emulator implements it:
// __syncthreads and its reductions, warp shuffles and votes, atomics, min/max, assert() and
// dynamic shared memory. Barriers and warp collectives are waits in the fiber scheduler.
#pragma once

#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/emu/builtins.h"

namespace mgpu::emu {

// The running block's dynamic shared memory (the launch's shared_bytes, filled with 0xff bytes at
// the start of every block, so reading it before writing gives NaN / -1).
void* dynamic_shared_memory();

// kind: 0 plain, 1 count, 2 and, 3 or. Returns the reduced predicate for 1..3.
int syncthreads(int kind, int predicate, const char* file, int line);

enum class WarpOp { shfl, shfl_up, shfl_down, shfl_xor, ballot, any, all };
// One lane's part in a warp collective: waits until every lane of mask has arrived at a collective
// of the same op and mask, then returns this lane's result (bits of the value it receives, or the
// ballot). A source lane outside the mask gives all-ones bits (NaN for float): undefined on a GPU.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line);

template <typename T>
T warp_shuffle(WarpOp op, unsigned mask, T var, int arg, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// A failed atomicCAS lets the other fibers run, so a spin lock between threads of a block works.
void yield_after_failed_cas();

// Called by assert() in code compiled with this header: inside a kernel it throws (the launch
// fails with cudaErrorAssert); on the host it behaves like the C library's assert.
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const char* function);

}  // namespace mgpu::emu

// ---- Device intrinsics ---------------------------------------------------------------------------
// Macros, so a barrier or collective knows its source line for error messages.
#define __syncthreads() ::mgpu::emu::syncthreads(0, 1, __FILE__, __LINE__)
#define __syncthreads_count(p) ::mgpu::emu::syncthreads(1, (p), __FILE__, __LINE__)
#define __syncthreads_and(p) ::mgpu::emu::syncthreads(2, (p), __FILE__, __LINE__)
#define __syncthreads_or(p) ::mgpu::emu::syncthreads(3, (p), __FILE__, __LINE__)
#define __shfl_sync(...) \
  ::mgpu::emu::detail_shfl<::mgpu::emu::WarpOp::shfl>(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) \
  ::mgpu::emu::detail_shfl<::mgpu::emu::WarpOp::shfl_up>(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) \
  ::mgpu::emu::detail_shfl<::mgpu::emu::WarpOp::shfl_down>(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) \
  ::mgpu::emu::detail_shfl<::mgpu::emu::WarpOp::shfl_xor>(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, p)                                                            \
  static_cast<unsigned>(::mgpu::emu::warp_collective(::mgpu::emu::WarpOp::ballot, (mask), \
                                                     (p) != 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, p)                                                                        \
  static_cast<int>(::mgpu::emu::warp_collective(::mgpu::emu::WarpOp::any, (mask), (p) != 0, 0, 32, \
                                                __FILE__, __LINE__))
#define __all_sync(mask, p)                                                                        \
  static_cast<int>(::mgpu::emu::warp_collective(::mgpu::emu::WarpOp::all, (mask), (p) != 0, 0, 32, \
                                                __FILE__, __LINE__))

namespace mgpu::emu {
// A non-deduced T (std::type_identity_t in C++20): atomicAdd(float*, 1.0) converts like CUDA's.
template <typename T>
struct SameType {
  using type = T;
};
template <typename T>
using Same = typename SameType<T>::type;

template <WarpOp op, typename T>
T detail_shfl(const char* file, int line, unsigned mask, T var, int arg, int width = warpSize) {
  return warp_shuffle(op, mask, var, arg, width, file, line);
}

// Atomics: fibers of a block never interleave inside one, but two emulated devices' worker
// threads may touch the same (peer) memory, so these are real atomic read-modify-writes.
template <typename T, typename F>
T atomic_update(T* address, F op) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4- or 8-byte values");
  T old;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  T desired = op(old);
  while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_RELAXED)) {
    desired = op(old);
  }
  return old;
}
}  // namespace mgpu::emu

template <typename T>
inline T atomicAdd(T* address, ::mgpu::emu::Same<T> val) {
  return ::mgpu::emu::atomic_update(address, [val](T old) { return T(old + val); });
}
template <typename T>
inline T atomicMax(T* address, ::mgpu::emu::Same<T> val) {
  return ::mgpu::emu::atomic_update(address, [val](T old) { return old < val ? val : old; });
}
template <typename T>
inline T atomicMin(T* address, ::mgpu::emu::Same<T> val) {
  return ::mgpu::emu::atomic_update(address, [val](T old) { return val < old ? val : old; });
}
template <typename T>
inline T atomicExch(T* address, ::mgpu::emu::Same<T> val) {
  return ::mgpu::emu::atomic_update(address, [val](T) { return val; });
}
template <typename T>
inline T atomicCAS(T* address, ::mgpu::emu::Same<T> compare, ::mgpu::emu::Same<T> val) {
  static_assert(std::is_integral_v<T>, "atomicCAS works on integers, as in CUDA");
  T expected = compare;
  __atomic_compare_exchange(address, &expected, &val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  if (expected != compare) ::mgpu::emu::yield_after_failed_cas();
  return expected;
}

// CUDA declares min/max for integers and floats in the global namespace, device and host.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// assert() inside kernels fails the launch instead of aborting the process (see assert_fail).
#ifndef NDEBUG
#undef assert
#define assert(e) \
  ((e) ? static_cast<void>(0) : ::mgpu::emu::assert_fail(#e, __FILE__, __LINE__, __func__))
#endif

// Dynamic shared memory: a pointer to the running block's buffer.
#define MGPU_EMU_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(::mgpu::emu::dynamic_shared_memory())
