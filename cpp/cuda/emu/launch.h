// cpp/cuda/emu/launch.h -- the emulator's own interface: MGPU_LAUNCH's launcher (a kernel call
// with copies of its arguments, run on every thread of every block), the error detail
// MGPU_CUDA_CHECK appends, and the settings tests change (device count, fiber order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/emu/builtins.h"
#include "cuda/emu/runtime_api.h"

namespace mgpu::emu {

// What went wrong in the last failed runtime call or launch on this OS thread, in words: the
// kernel, block, thread and reason. Empty if nothing failed yet. cudaGetErrorString can only give
// the generic text of a code; MGPU_CUDA_CHECK appends this.
const std::string& last_error_detail();

// Re-reads MGPU_EMULATED_GPUS (device count, default 2), MGPU_EMU_SEED (fiber order and the
// strict mode's choices, default 1), MGPU_EMU_STRICT (0 or 1, see strict()) and
// MGPU_EMU_STACK_KIB (fiber stack, default 64), MGPU_EMU_PEER_ACCESS (0: no device may enable
// peer access to another, as GPUs without P2P; default 1) and forgets all devices' state: allocations,
// streams, events, peer access, pending errors. Tests only; nothing may run on a device meanwhile.
void reset_from_env();
// Fiber order: 0 runs the threads of a block in ascending order in every phase; any other value
// seeds a shuffle per block and barrier phase. Takes effect at the next launch.
void set_seed(uint64_t seed);
// Whether strict mode is on (MGPU_EMU_STRICT=1): streams run behind the host in a seeded random
// interleaving, an event covers exactly the work issued on its stream before its record (a wait
// on it runs that work and nothing after), streams waiting for each other in a cycle are a
// reported deadlock, a grid's blocks run in a random order, freed memory is poisoned, captured
// events cannot be waited on. The caching allocator poisons the blocks it takes back when it is on.
bool strict();
// What the runtime holds now, for leak checks: live streams (not the default ones), events,
// graphs, executable graphs, and cudaMalloc / cudaMallocHost allocations with their bytes.
struct LiveCounts {
  size_t streams = 0, events = 0, graphs = 0, graph_execs = 0;
  size_t device_allocations = 0, device_bytes = 0, host_allocations = 0, host_bytes = 0;
};
LiveCounts live_counts();
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
  int index;              // position in the kernel's parameter list
  const void* value;      // the pointer passed
  bool embedded = false;  // a pointer-sized word inside a struct argument (maybe no pointer)
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
    clear_padding(params, std::index_sequence_for<Params...>{});
    std::vector<PointerArg> pointers;
    collect_pointers(params, pointers, std::index_sequence_for<Params...>{});
    auto kernel = kernel_;
    launch(
        site_, grid_, block_, shared_, stream_, [kernel, params] { std::apply(kernel, params); },
        pointers.data(), static_cast<int>(pointers.size()));
  }

 private:
  // A struct argument's padding bytes hold whatever the caller's memory held there (often a
  // stale pointer of a host thread's stack, with a field's bytes over its lowest ones), and its
  // copies may carry them along. They are no pointer of the kernel, so they are zeroed before
  // the words are checked: else such a word, lying in another device's allocation, fails a
  // correct launch on GPUs without peer access. (A compiler without __builtin_clear_padding,
  // GCC before 11 or an older Clang, keeps the padding and with it that false alarm.)
  template <typename Tuple, size_t... I>
  static void clear_padding([[maybe_unused]] Tuple& params, std::index_sequence<I...>) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
    (clear_padding_of(std::get<I>(params)), ...);
#endif
#endif
  }
  template <typename T>
  static void clear_padding_of([[maybe_unused]] T& value) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
    if constexpr (std::is_class_v<T> && std::is_trivially_copyable_v<T>)
      __builtin_clear_padding(&value);
#endif
#endif
  }
  template <typename Tuple, size_t... I>
  static void collect_pointers(const Tuple& params, std::vector<PointerArg>& out,
                               std::index_sequence<I...>) {
    (add_pointer(static_cast<int>(I), std::get<I>(params), out), ...);
  }
  // Pointer arguments, and every aligned pointer-sized word of a struct argument (a functor
  // holding its arrays' pointers): the launch checks the words that lie in a device allocation
  // as pointers, so a struct's pointer to another device's memory is caught too.
  template <typename T>
  static void add_pointer(int index, const T& value, std::vector<PointerArg>& out) {
    if constexpr (std::is_pointer_v<T> && !std::is_function_v<std::remove_pointer_t<T>>) {
      if (value != nullptr) out.push_back(PointerArg{index, static_cast<const void*>(value)});
    } else if constexpr (std::is_class_v<T> && std::is_trivially_copyable_v<T> &&
                         sizeof(T) >= sizeof(void*)) {
      const char* bytes = reinterpret_cast<const char*>(&value);
      for (size_t off = 0; off + sizeof(void*) <= sizeof(T); off += alignof(void*)) {
        const void* word = nullptr;
        std::memcpy(&word, bytes + off, sizeof word);
        if (word != nullptr) out.push_back(PointerArg{index, word, true});
      }
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

}  // namespace mgpu::emu
