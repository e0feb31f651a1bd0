// cpp/cuda/emu/fibers.cpp -- how a kernel runs: one fiber per CUDA thread (pooled stacks with a
// guard page, switched by our own x86-64 routine or by ucontext), blocks one after another on the
// launching OS thread, barriers and warp collectives as scheduler waits. A block's fibers run in a
// seeded order, re-shuffled at every barrier, so a read of another thread's write without a
// barrier sees it only by luck; a sweep in which no fiber can run while some have not exited is a
// deadlock and fails the launch.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "cuda/emu/internal.h"

#if MGPU_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// x86-64 without ASan: fibers switch with our own routine, which saves the callee-saved registers
// and the FPU/SSE control words on the stack and swaps stack pointers. swapcontext also saves
// and restores the signal mask with a system call at every switch: that was about 80% of a LeNet
// step's time on the emulator (one switch out and in per CUDA thread). Elsewhere, and under ASan
// (whose fiber hooks are written against ucontext), ucontext stays.
#if defined(__x86_64__) && !MGPU_EMU_ASAN
#define MGPU_EMU_FAST_SWITCH 1
extern "C" {
// Saves this context's registers on its stack, stores its stack pointer in *save_sp, and resumes
// the context whose stack pointer is load_sp.
void mgpu_emu_switch(void** save_sp, void* load_sp);
// Where a new fiber's first switch returns to: calls mgpu_emu_fiber_main, which never returns.
void mgpu_emu_fiber_start();
void mgpu_emu_fiber_main();
}
asm(R"(
  .text
  .p2align 4
  .globl mgpu_emu_switch
  .hidden mgpu_emu_switch
  .type mgpu_emu_switch,@function
mgpu_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mgpu_emu_switch,.-mgpu_emu_switch

  .p2align 4
  .globl mgpu_emu_fiber_start
  .hidden mgpu_emu_fiber_start
  .type mgpu_emu_fiber_start,@function
mgpu_emu_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  andq $-16, %rsp
  call mgpu_emu_fiber_main@PLT
  ud2
  .cfi_endproc
  .size mgpu_emu_fiber_start,.-mgpu_emu_fiber_start
)");
#else
#define MGPU_EMU_FAST_SWITCH 0
#endif

namespace mgpu::emu {
namespace {

enum class FiberState { runnable, at_barrier, at_warp, exited };

struct Fiber {
#if MGPU_EMU_FAST_SWITCH
  void* sp = nullptr;  // its saved stack pointer while it does not run
#else
  ucontext_t context;
#endif
  char* mapping = nullptr;  // guard page + stack
  size_t mapping_size = 0;
  char* stack = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;  // ASan's bookkeeping for this stack
  FiberState state = FiberState::runnable;
  bool abort = false;
  unsigned tid = 0;
  uint3 index{0, 0, 0};
  // This lane's part in a warp collective.
  WarpOp op = WarpOp::shfl;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  const char* file = "";
  int line = 0;
  uint64_t result = 0;

  ~Fiber() {
    if (mapping != nullptr) {
#if MGPU_EMU_ASAN
      __asan_unpoison_memory_region(stack, stack_size);
#endif
      munmap(mapping, mapping_size);
    }
  }
};

struct FiberAbort {};  // unwinds a waiting fiber when its block has failed

struct KernelError : std::runtime_error {
  cudaError_t code;
  KernelError(cudaError_t c, const std::string& what) : std::runtime_error(what), code(c) {}
};

struct BlockRun {
  const LaunchSite* site = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber*> fibers;
  unsigned n = 0;
  unsigned exited = 0;
  uint64_t events = 0;  // arrivals and exits: progress other than spinning on atomicCAS
  // __syncthreads
  unsigned arrived = 0;
  int bar_kind = 0;
  int bar_predicates = 0;
  int bar_result = 0;
  const char* bar_file = "";
  int bar_line = 0;
  unsigned bar_first = 0;
  bool phase_changed = false;
  // the first failure
  bool failed = false;
  cudaError_t code = cudaSuccess;
  std::string what;
  bool has_thread = false;
  unsigned failed_tid = 0;
};

struct Scheduler {
#if MGPU_EMU_FAST_SWITCH
  void* main_sp = nullptr;
#else
  ucontext_t main_context;
#endif
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* main_fake_stack = nullptr;
  Fiber* current = nullptr;
  BlockRun* block = nullptr;
  std::vector<std::unique_ptr<Fiber>> pool;
  size_t pool_stack_size = 0;
  unsigned char* dynamic_shared = nullptr;
  uint64_t switches = 0;
};
thread_local Scheduler sched;

std::string thread_str(const BlockRun& b, unsigned tid) {
  return cat("thread ", dim_str(dim3(b.fibers[tid]->index)));
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::shfl:
      return "__shfl_sync";
    case WarpOp::shfl_up:
      return "__shfl_up_sync";
    case WarpOp::shfl_down:
      return "__shfl_down_sync";
    case WarpOp::shfl_xor:
      return "__shfl_xor_sync";
    case WarpOp::ballot:
      return "__ballot_sync";
    case WarpOp::any:
      return "__any_sync";
    case WarpOp::all:
      return "__all_sync";
  }
  return "?";
}

void asan_start_switch(void** fake_save, const void* bottom, size_t size) {
#if MGPU_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save, (void)bottom, (void)size;
#endif
}
void asan_finish_switch(void* fake_save, const void** bottom_old, size_t* size_old) {
#if MGPU_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
  (void)fake_save, (void)bottom_old, (void)size_old;
#endif
}

// Scheduler side: run fiber f until it waits or exits.
void switch_to(Fiber* f) {
  sched.current = f;
  threadIdx = f->index;
  ++sched.switches;
  asan_start_switch(&sched.main_fake_stack, f->stack, f->stack_size);
#if MGPU_EMU_FAST_SWITCH
  mgpu_emu_switch(&sched.main_sp, f->sp);
#else
  swapcontext(&sched.main_context, &f->context);
#endif
  asan_finish_switch(sched.main_fake_stack, nullptr, nullptr);
  sched.current = nullptr;
}

// Fiber side: give control back to the scheduler.
void switch_to_scheduler(Fiber* f) {
  asan_start_switch(&f->fake_stack, sched.main_stack_bottom, sched.main_stack_size);
#if MGPU_EMU_FAST_SWITCH
  mgpu_emu_switch(&f->sp, sched.main_sp);
#else
  swapcontext(&f->context, &sched.main_context);
#endif
  asan_finish_switch(f->fake_stack, &sched.main_stack_bottom, &sched.main_stack_size);
}

// Fiber side: wait; the scheduler resumes us when our state is runnable again, or to abort.
void suspend(Fiber* f) {
  switch_to_scheduler(f);
  if (f->abort) throw FiberAbort{};
}

void record_failure(BlockRun& b, const Fiber* f, cudaError_t code, std::string what) {
  if (b.failed) return;
  b.failed = true;
  b.code = code;
  b.what = std::move(what);
  b.has_thread = f != nullptr;
  if (f != nullptr) b.failed_tid = f->tid;
}

void run_thread(Fiber* f) {
  BlockRun& b = *sched.block;
  try {
    (*b.body)();
  } catch (const FiberAbort&) {
  } catch (const KernelError& e) {
    record_failure(b, f, e.code, e.what());
  } catch (const std::exception& e) {
    record_failure(b, f, cudaErrorLaunchFailure, cat("uncaught exception: ", e.what()));
  } catch (...) {
    record_failure(b, f, cudaErrorLaunchFailure, "uncaught exception of unknown type");
  }
}

// Every fiber runs this loop for its whole life: one CUDA thread per iteration, then back to the
// scheduler, which reuses the fiber (and its stack) for a thread of a later block or launch.
void fiber_main() {
  asan_finish_switch(nullptr, &sched.main_stack_bottom, &sched.main_stack_size);
  Fiber* f = sched.current;
  for (;;) {
    if (!f->abort) run_thread(f);
    f->state = FiberState::exited;
    ++sched.block->exited;
    ++sched.block->events;
    switch_to_scheduler(f);
  }
}

std::unique_ptr<Fiber> make_fiber(size_t stack_size) {
  auto f = std::make_unique<Fiber>();
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  stack_size = (stack_size + page - 1) / page * page;
  f->mapping_size = stack_size + page;
  void* m = mmap(nullptr, f->mapping_size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  f->mapping = static_cast<char*>(m);
  mprotect(f->mapping, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  f->stack = f->mapping + page;
  f->stack_size = stack_size;
#if MGPU_EMU_FAST_SWITCH
  // The frame mgpu_emu_switch pops: the control words (x87 at +0, MXCSR at +8), six zeroed callee-saved registers, then the return address, the start routine.
  auto* top = reinterpret_cast<uint64_t*>(f->stack + f->stack_size) - 10;
  std::memset(top, 0, 10 * sizeof(uint64_t));
  // The creating thread's modes (fibers run on the thread that made them).
  uint16_t x87 = 0;
  asm volatile("fnstcw %0" : "=m"(x87));
  top[0] = x87;
  top[1] = _mm_getcsr();
  top[8] = reinterpret_cast<uint64_t>(&mgpu_emu_fiber_start);
  f->sp = top;
#else
  getcontext(&f->context);
  f->context.uc_stack.ss_sp = f->stack;
  f->context.uc_stack.ss_size = f->stack_size;
  f->context.uc_link = nullptr;
  makecontext(&f->context, fiber_main, 0);
#endif
  return f;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string describe_waiters(const BlockRun& b) {
  std::ostringstream out;
  if (b.arrived > 0) {
    out << b.arrived << " of " << b.n << " threads wait at __syncthreads (" << b.bar_file << ":"
        << b.bar_line << "), e.g. " << thread_str(b, b.bar_first) << "; ";
  }
  for (unsigned w = 0; w * 32 < b.n; ++w) {
    for (unsigned l = 0; l < 32 && w * 32 + l < b.n; ++l) {
      const Fiber* f = b.fibers[w * 32 + l];
      if (f->state != FiberState::at_warp) continue;
      out << "warp " << w << " lane " << l << " waits at " << op_name(f->op) << "(mask "
          << hex(f->mask) << ") (" << f->file << ":" << f->line << "); ";
      break;  // one lane per warp is enough to read the situation
    }
  }
  out << b.exited << " threads have exited";
  return out.str();
}

// After fiber f exited: nobody may be waiting for it.
void check_exit(BlockRun& b, const Fiber* f) {
  if (b.arrived > 0) {
    record_failure(b, f, cudaErrorLaunchFailure,
                   cat("exited while ", b.arrived, " threads wait at __syncthreads (", b.bar_file,
                       ":", b.bar_line,
                       "); every thread of a block must reach each barrier (on a "
                       "GPU this hangs or gives wrong results): guard the work instead of "
                       "returning early"));
    return;
  }
  unsigned warp = f->tid / 32, lane = f->tid % 32;
  for (unsigned l = 0; l < 32 && warp * 32 + l < b.n; ++l) {
    const Fiber* g = b.fibers[warp * 32 + l];
    if (g->state == FiberState::at_warp && (g->mask >> lane & 1u)) {
      record_failure(b, f, cudaErrorLaunchFailure,
                     cat("exited while lane ", l, " of its warp waits for it at ", op_name(g->op),
                         "(mask ", hex(g->mask), ") (", g->file, ":", g->line,
                         "); every lane named in the mask must take part"));
      return;
    }
  }
}

constexpr uint64_t kMaxIdleSweeps = 100000;

// Runs every thread of one block to completion (or to the block's failure).
void run_block(BlockRun& b, uint64_t block_linear) {
  uint64_t rng = g_seed.load() ^ (block_linear * 0xd1b54a32d192ed03ull);
  bool shuffle = g_seed.load() != 0;
  std::vector<unsigned> order(b.n);
  uint64_t idle_sweeps = 0;
  while (!b.failed && b.exited < b.n) {
    for (unsigned i = 0; i < b.n; ++i) order[i] = i;
    if (shuffle) {
      for (unsigned i = b.n; i > 1; --i) std::swap(order[i - 1], order[splitmix64(rng) % i]);
    }
    b.phase_changed = false;
    bool ran = false;
    uint64_t events_before = b.events;
    for (unsigned i = 0; i < b.n && !b.failed && !b.phase_changed; ++i) {
      Fiber* f = b.fibers[order[i]];
      if (f->state != FiberState::runnable) continue;
      switch_to(f);
      ran = true;
      if (f->state == FiberState::exited && !b.failed) check_exit(b, f);
    }
    if (b.failed || b.exited == b.n) break;
    if (!ran) {
      record_failure(b, nullptr, cudaErrorLaunchFailure,
                     cat("deadlock: no thread can proceed: ", describe_waiters(b)));
      break;
    }
    idle_sweeps = b.events == events_before ? idle_sweeps + 1 : 0;
    if (idle_sweeps > kMaxIdleSweeps) {
      record_failure(b, nullptr, cudaErrorLaunchFailure,
                     cat("livelock: threads keep failing atomicCAS and nothing else happens (",
                         describe_waiters(b),
                         "); blocks run one at a time here, so a block "
                         "cannot wait for another block"));
      break;
    }
  }
  if (!b.failed) return;
  // Unwind every fiber still inside the kernel, so its stack is clean for reuse.
  for (unsigned t = 0; t < b.n; ++t) {
    Fiber* f = b.fibers[t];
    if (f->state == FiberState::exited) continue;
    f->abort = true;
    switch_to(f);
  }
}

}  // namespace

cudaError_t run_grid(const LaunchSpec& s) {
  unsigned n = s.block.x * s.block.y * s.block.z;
  size_t stack_size = g_stack_size.load();
  if (sched.pool_stack_size != stack_size) {
    sched.pool.clear();
    sched.pool_stack_size = stack_size;
  }
  while (sched.pool.size() < n) sched.pool.push_back(make_fiber(stack_size));

  BlockRun b;
  b.site = &s.site;
  b.body = &s.body;
  b.n = n;
  b.fibers.resize(n);
  for (unsigned t = 0; t < n; ++t) {
    Fiber* f = sched.pool[t].get();
    f->tid = t;
    f->index = uint3{t % s.block.x, (t / s.block.x) % s.block.y, t / (s.block.x * s.block.y)};
    b.fibers[t] = f;
  }
  std::unique_ptr<unsigned char[]> shared(
      new unsigned char[s.shared_bytes > 0 ? s.shared_bytes : 1]);
  sched.dynamic_shared = shared.get();
  sched.block = &b;
  gridDim = s.grid;
  blockDim = s.block;
  // Blocks in ascending order; in strict mode in a random order per launch (an affine
  // permutation k -> (a k + c) mod blocks with a coprime to blocks), as a GPU's scheduler gives
  // no order: a kernel that depends on block order fails.
  const uint64_t gx = s.grid.x, gxy = gx * s.grid.y, blocks = gxy * s.grid.z;
  uint64_t a = 1, c = 0;
  if (g_strict.load() && blocks > 1 && blocks <= (uint64_t(1) << 32)) {  // a k + c fits 64 bits
    c = strict_draw() % blocks;
    do a = strict_draw() % blocks; while (a == 0 || std::gcd(a, blocks) != 1);
  }
  cudaError_t result = cudaSuccess;
  for (uint64_t k = 0; k < blocks; ++k) {
    const uint64_t linear = (a * k + c) % blocks;
    blockIdx = uint3{static_cast<unsigned>(linear % gx), static_cast<unsigned>(linear % gxy / gx),
                     static_cast<unsigned>(linear / gxy)};
    for (Fiber* f : b.fibers) {
      f->state = FiberState::runnable;
      f->abort = false;
    }
    b.exited = 0;
    b.arrived = 0;
    b.events = 0;
    std::memset(shared.get(), 0xff, s.shared_bytes);
    run_block(b, linear);
    if (b.failed) {
      std::string thread = b.has_thread ? cat(", ", thread_str(b, b.failed_tid)) : std::string();
      result = report_kernel_failure(
          s.device, b.code,
          cat(launch_name(s), " failed in block ", dim_str(dim3(blockIdx)), " of grid ",
              dim_str(s.grid), " (block size ", dim_str(s.block), ")", thread, ": ", b.what));
      break;
    }
  }
  sched.block = nullptr;
  sched.dynamic_shared = nullptr;
  return result;
}

bool in_kernel() { return sched.block != nullptr; }
uint64_t fiber_switches() { return sched.switches; }
size_t fiber_pool_size() { return sched.pool.size(); }

void* dynamic_shared_memory() {
  if (sched.block == nullptr) throw std::logic_error("dynamic shared memory used outside a kernel");
  return sched.dynamic_shared;
}

int syncthreads(int kind, int predicate, const char* file, int line) {
  Fiber* f = sched.current;
  if (f == nullptr) throw std::logic_error("__syncthreads called outside a kernel");
  BlockRun& b = *sched.block;
  if (b.exited > 0) {
    throw KernelError(
        cudaErrorLaunchFailure,
        cat("reached __syncthreads (", file, ":", line, ") after ", b.exited, " of ", b.n,
            " threads exited; every thread of a block must reach each barrier "
            "(on a GPU this hangs or gives wrong results): guard the work instead "
            "of returning early"));
  }
  if (b.arrived == 0) {
    b.bar_kind = kind;
    b.bar_file = file;
    b.bar_line = line;
    b.bar_first = f->tid;
    b.bar_predicates = 0;
  } else if (b.bar_line != line || b.bar_kind != kind ||
             (b.bar_file != file && std::strcmp(b.bar_file, file) != 0)) {  // same literal: equal
    throw KernelError(cudaErrorLaunchFailure,
                      cat("divergent barriers: this thread is at ", file, ":", line, " while ",
                          thread_str(b, b.bar_first), " waits at ", b.bar_file, ":", b.bar_line,
                          "; all threads of a block must reach the same __syncthreads"));
  }
  ++b.arrived;
  ++b.events;
  b.bar_predicates += predicate != 0;
  f->state = FiberState::at_barrier;
  if (b.arrived == b.n) {
    switch (b.bar_kind) {
      case 1:
        b.bar_result = b.bar_predicates;
        break;
      case 2:
        b.bar_result = unsigned(b.bar_predicates) == b.n;
        break;
      case 3:
        b.bar_result = b.bar_predicates > 0;
        break;
      default:
        b.bar_result = 0;
    }
    for (Fiber* g : b.fibers) g->state = FiberState::runnable;
    b.arrived = 0;
    b.phase_changed = true;  // the next phase starts in a new order, this thread included
  }
  suspend(f);
  return b.bar_result;
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line) {
  Fiber* f = sched.current;
  if (f == nullptr) throw std::logic_error("warp intrinsic called outside a kernel");
  BlockRun& b = *sched.block;
  const unsigned warp = f->tid / 32, lane = f->tid % 32;
  const unsigned lanes = std::min(32u, b.n - warp * 32);
  const unsigned existing = lanes == 32 ? ~0u : (1u << lanes) - 1;
  auto where_str = [&] { return cat(op_name(op), "(mask ", hex(mask), ") at ", file, ":", line); };
  if ((mask >> lane & 1u) == 0) {
    throw KernelError(cudaErrorLaunchFailure, cat(where_str(), ": lane ", lane,
                                                  " calls it with a mask that leaves it out"));
  }
  if ((mask & ~existing) != 0) {
    throw KernelError(cudaErrorLaunchFailure,
                      cat(where_str(), ": the mask names lanes that do not exist; warp ", warp,
                          " of this ", b.n, "-thread block has ", lanes, " lanes"));
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    throw KernelError(cudaErrorLaunchFailure,
                      cat(where_str(), ": width ", width, " is not a power of 2 in [1, 32]"));
  }
  Fiber* const* lane_fiber = &b.fibers[warp * 32];
  bool all_here = true;
  for (unsigned l = 0; l < lanes; ++l) {
    if (l == lane || (mask >> l & 1u) == 0) continue;
    const Fiber* g = lane_fiber[l];
    if (g->state == FiberState::exited) {
      throw KernelError(cudaErrorLaunchFailure, cat(where_str(), ": lane ", l,
                                                    " of the mask has already exited; every "
                                                    "lane named in the mask must take part"));
    }
    if (g->state == FiberState::at_warp && (g->op != op || g->mask != mask)) {
      throw KernelError(cudaErrorLaunchFailure,
                        cat(where_str(), ": lane ", l, " of the same warp waits at ",
                            op_name(g->op), "(mask ", hex(g->mask), ") at ", g->file, ":", g->line,
                            "; the lanes of a mask must meet at the same collective"));
    }
    all_here = all_here && g->state == FiberState::at_warp;
  }
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->file = file;
  f->line = line;
  ++b.events;
  if (!all_here) {
    f->state = FiberState::at_warp;
    suspend(f);
    return f->result;
  }
  // The last lane to arrive computes everyone's result.
  uint64_t ballot = 0;
  for (unsigned l = 0; l < lanes; ++l) {
    if ((mask >> l & 1u) && lane_fiber[l]->value != 0) ballot |= uint64_t(1) << l;
  }
  for (unsigned l = 0; l < lanes; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    Fiber* g = lane_fiber[l];
    const unsigned w = unsigned(g->width), segment = l & ~(w - 1);
    unsigned src = l;
    switch (op) {
      case WarpOp::ballot:
        g->result = ballot;
        break;
      case WarpOp::any:
        g->result = ballot != 0;
        break;
      case WarpOp::all:
        g->result = ballot == mask;
        break;
      case WarpOp::shfl:
        src = segment + (unsigned(g->arg) & (w - 1));
        break;
      case WarpOp::shfl_up:
        src = (l - segment) < unsigned(g->arg) ? l : l - unsigned(g->arg);
        break;
      case WarpOp::shfl_down:
        src = (l - segment) + unsigned(g->arg) >= w ? l : l + unsigned(g->arg);
        break;
      case WarpOp::shfl_xor:
        src = l ^ unsigned(g->arg);
        if (src >= segment + w) src = l;
        break;
    }
    if (op == WarpOp::shfl || op == WarpOp::shfl_up || op == WarpOp::shfl_down ||
        op == WarpOp::shfl_xor) {
      // A source lane outside the mask has no defined value: make that loud (NaN / -1).
      g->result = src < lanes && (mask >> src & 1u) ? lane_fiber[src]->value : ~uint64_t(0);
    }
    if (g != f) g->state = FiberState::runnable;
  }
  f->state = FiberState::runnable;
  return f->result;
}

void yield_after_failed_cas() {
  Fiber* f = sched.current;
  if (f == nullptr) return;
  suspend(f);
}

void assert_fail(const char* expr, const char* file, int line, const char* function) {
  if (sched.current != nullptr) {
    throw KernelError(cudaErrorAssert,
                      cat("assertion `", expr, "` failed at ", file, ":", line, " in ", function));
  }
  // Host code: what the C library's assert does (its __assert_fail is not declared under NDEBUG).
  std::fprintf(stderr, "%s:%d: %s: Assertion `%s' failed.\n", file, line, function, expr);
  std::abort();
}

}  // namespace mgpu::emu

#if MGPU_EMU_FAST_SWITCH
extern "C" void mgpu_emu_fiber_main() { mgpu::emu::fiber_main(); }
#endif
