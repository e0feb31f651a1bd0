// cpp/emu/cuda_emulation.h -- what CUDA sources see when g++ compiles them with
// MGPU_CUDA_EMULATION: the CUDA keywords, built-in variables, device intrinsics and the slice of
// the CUDA runtime API the backend uses, run on the CPU. Each CUDA thread of a block is a fiber (a
// cooperatively switched user-space context); blocks run one after another on the calling OS
// thread. Test builds only (DESIGN.md, "Running CUDA code without a GPU"). Include it through
// ops/launch_cuda.cuh.
//
// Semantics worth knowing (details in cuda_emulation.cpp):
// - Streams run their work synchronously, in the calling thread, when it is issued; events,
//   waits and synchronisation are therefore trivially ordered. A stream that is capturing records
//   instead, and cudaGraphLaunch replays the recording.
// - Device memory is host memory. Every cudaMalloc'ed range remembers its device, so copies with
//   a wrong kind or size, and kernels handed another device's (or pageable host) pointers, fail.
// - A kernel's failure (an exception, a failed assert, a barrier reached by only some threads, a
//   deadlock) fails its launch: cudaGetLastError() and the device's next synchronisation return
//   the error, and mgpu::emu::last_error_detail() says what happened, where.
// - Between barrier phases the fibers of a block run in a seeded pseudo-random order
//   (MGPU_EMU_SEED, default 1; 0 keeps ascending thread order), so a missing __syncthreads shows.
// Not emulated: __device__ / __constant__ variables (one host copy for all devices; no
// cudaMemcpyToSymbol), dynamic parallelism, cooperative groups, textures, __activemask, capture
// across streams (event fork/join), and blocks running concurrently (a block that spins waiting
// for another block fails as a livelock).
#pragma once

#if defined(__CUDACC__)
#error \
    "cuda_emulation.h is for host compilers; nvcc uses <cuda_runtime.h> (see ops/launch_cuda.cuh)"
#endif

#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- Keywords
// ------------------------------------------------------------------------------------ (No
// __noinline__: libstdc++ spells its own attribute that way, so the macro would break it.)
// __shared__ storage is static thread_local: one copy per OS thread, so all fibers of the block
// running on that thread share it, and blocks running at the same time on other threads (another
// emulated device's worker) do not. Like real shared memory it is not initialised per block.
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
#define __CUDA_ARCH_EMULATED__ 800

// ---- Vector types and built-in variables
// ----------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct int2 {
  int x, y;
};
struct int4 {
  int x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// Set by the scheduler before it switches to a fiber; meaningless on the host side.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---- Runtime types (names, values and signatures as in CUDA 13's driver_types.h) ----------------
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorPeerAccessNotEnabled = 705,
  cudaErrorAssert = 710,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorUnknown = 999,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00

// The members of CUDA's cudaDeviceProp that an emulated device can fill meaningfully; same names
// and types, so backend code reading them compiles against either. Add members as code needs them.
struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int regsPerBlock;
  int warpSize;
  size_t memPitch;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  size_t totalConstMem;
  int major;
  int minor;
  int multiProcessorCount;
  int integrated;
  int canMapHostMemory;
  int concurrentKernels;
  int ECCEnabled;
  int pciBusID;
  int pciDeviceID;
  int pciDomainID;
  int asyncEngineCount;
  int unifiedAddressing;
  int memoryBusWidth;
  int l2CacheSize;
  int maxThreadsPerMultiProcessor;
  size_t sharedMemPerMultiprocessor;
  int regsPerMultiprocessor;
  int managedMemory;
  int cooperativeLaunch;
  size_t sharedMemPerBlockOptin;
  int maxBlocksPerMultiProcessor;
};

// ---- Runtime API --------------------------------------------------------------------------------
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice);
cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags);
cudaError_t cudaDeviceDisablePeerAccess(int peerDevice);
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value);
template <typename T>
cudaError_t cudaFuncSetAttribute(T* func, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(func), attr, value);
}

cudaError_t cudaMalloc(void** devPtr, size_t size);
cudaError_t cudaFree(void* devPtr);
cudaError_t cudaMallocHost(void** ptr, size_t size);
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemGetInfo(size_t* free, size_t* total);
template <typename T>
cudaError_t cudaMalloc(T** devPtr, size_t size) {
  return cudaMalloc(reinterpret_cast<void**>(devPtr), size);
}
template <typename T>
cudaError_t cudaMallocHost(T** ptr, size_t size) {
  return cudaMallocHost(reinterpret_cast<void**>(ptr), size);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream = 0);
cudaError_t cudaMemcpyPeer(void* dst, int dstDevice, const void* src, int srcDevice, size_t count);
cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream = 0);
cudaError_t cudaMemset(void* devPtr, int value, size_t count);
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream = 0);

cudaError_t cudaStreamCreate(cudaStream_t* pStream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* pCaptureStatus);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

// ---- The emulator's own interface (tests and ops/launch_cuda.cuh) -------------------------------
namespace mgpu::emu {

// What went wrong in the last failed runtime call or launch on this OS thread, in words: the
// kernel, block, thread and reason. Empty if nothing failed yet. cudaGetErrorString can only give
// the generic text of a code; MGPU_CUDA_CHECK appends this.
const std::string& last_error_detail();

// Re-reads MGPU_EMULATED_GPUS (device count, default 2), MGPU_EMU_SEED (fiber order, default 1)
// and MGPU_EMU_STACK_KIB (fiber stack, default 64) and forgets all devices' state: allocations,
// streams, events, peer access, pending errors. Tests only; nothing may run on a device meanwhile.
void reset_from_env();
// Fiber order: 0 runs the threads of a block in ascending order in every phase; any other value
// seeds a shuffle per block and barrier phase. Takes effect at the next launch.
void set_seed(uint64_t seed);
uint64_t seed();
// Stack of each fiber (each CUDA thread). Pooled per OS thread; takes effect at the next launch.
void set_stack_size(size_t bytes);
// Fail launches whose pointer arguments are not memory the launching device can access (on by
// default).
void set_pointer_checks(bool on);
// How many fiber switches this OS thread has made, and how many fibers (stacks) it keeps for
// reuse: as many as the largest block it ran, whatever the grid size.
uint64_t fiber_switches();
size_t fiber_pool_size();

// One launch: kernel name and call site for messages, configuration, stream.
struct LaunchSite {
  const char* kernel;
  const void* kernel_address;
  const char* file;
  int line;
};
struct PointerArg {
  int index;          // position in the kernel's parameter list
  const void* value;  // the pointer passed
};
// Runs the kernel body (a call of the kernel with copies of its arguments) on every thread of
// every block, or records it when the stream is capturing. Errors go to cudaGetLastError.
void launch(const LaunchSite& site, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            std::function<void()> body, const PointerArg* pointers, int num_pointers);

// Binds a kernel and its configuration; calling it with arguments launches. Arguments are
// converted to the kernel's parameter types and copied, as a CUDA launch copies them.
template <typename... Params>
class Launcher {
 public:
  Launcher(void (*kernel)(Params...), LaunchSite site, dim3 grid, dim3 block, size_t shared_bytes,
           cudaStream_t stream)
      : kernel_(kernel),
        site_(site),
        grid_(grid),
        block_(block),
        shared_(shared_bytes),
        stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params),
                  "MGPU_LAUNCH: wrong number of arguments for this kernel");
    std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    PointerArg pointers[sizeof...(Params) + 1];
    int num_pointers = 0;
    collect_pointers(params, pointers, num_pointers, std::index_sequence_for<Params...>{});
    auto kernel = kernel_;
    launch(
        site_, grid_, block_, shared_, stream_, [kernel, params] { std::apply(kernel, params); },
        pointers, num_pointers);
  }

 private:
  template <typename Tuple, size_t... I>
  static void collect_pointers(const Tuple& params, PointerArg* out, int& n,
                               std::index_sequence<I...>) {
    (add_pointer(static_cast<int>(I), std::get<I>(params), out, n), ...);
  }
  template <typename T>
  static void add_pointer(int index, const T& value, PointerArg* out, int& n) {
    if constexpr (std::is_pointer_v<T> && !std::is_function_v<std::remove_pointer_t<T>>) {
      if (value != nullptr) out[n++] = PointerArg{index, static_cast<const void*>(value)};
    }
  }

  void (*kernel_)(Params...);
  LaunchSite site_;
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

template <typename... Params>
Launcher<Params...> make_launcher(void (*kernel)(Params...), const char* name, const char* file,
                                  int line, dim3 grid, dim3 block, size_t shared_bytes,
                                  cudaStream_t stream) {
  return Launcher<Params...>(kernel,
                             LaunchSite{name, reinterpret_cast<const void*>(kernel), file, line},
                             grid, block, shared_bytes, stream);
}

// ---- Device side: called from fibers
// -------------------------------------------------------------- The running block's dynamic shared
// memory (the launch's shared_bytes, filled with 0xff bytes at the start of every block, so reading
// it before writing gives NaN / -1).
void* dynamic_shared_memory();

// kind: 0 plain, 1 count, 2 and, 3 or. Returns the reduced predicate for 1..3.
int syncthreads(int kind, int predicate, const char* file, int line);

enum class WarpOp { sync, shfl, shfl_up, shfl_down, shfl_xor, ballot, any, all };
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

// ---- Device intrinsics
// ---------------------------------------------------------------------------- Macros, so a barrier
// or collective knows its source line for error messages.
#define __syncthreads() ::mgpu::emu::syncthreads(0, 1, __FILE__, __LINE__)
#define __syncthreads_count(p) ::mgpu::emu::syncthreads(1, (p), __FILE__, __LINE__)
#define __syncthreads_and(p) ::mgpu::emu::syncthreads(2, (p), __FILE__, __LINE__)
#define __syncthreads_or(p) ::mgpu::emu::syncthreads(3, (p), __FILE__, __LINE__)
#define __syncwarp(...) ::mgpu::emu::detail_syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
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

inline void detail_syncwarp(const char* file, int line, unsigned mask = 0xffffffffu) {
  warp_collective(WarpOp::sync, mask, 0, 0, 32, file, line);
}
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
inline T atomicSub(T* address, ::mgpu::emu::Same<T> val) {
  return ::mgpu::emu::atomic_update(address, [val](T old) { return T(old - val); });
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

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// Fast-math intrinsics: the accurate host functions (a GPU's approximations differ in the last
// bits; tests compare with tolerances anyway).
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
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
