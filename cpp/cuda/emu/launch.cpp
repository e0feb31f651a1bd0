// cpp/cuda/emu/launch.cpp -- a kernel launch: the configuration checked as CUDA checks it (block
// and grid limits, dynamic shared memory against the kernel's limit), every pointer argument
// checked against the launching device's memory, then the grid run (fibers.cpp) or recorded.
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cuda/emu/internal.h"

namespace mgpu::emu {

std::string launch_name(const LaunchSpec& s) {
  return cat("kernel '", s.site.kernel, "' (launched at ", s.site.file, ":", s.site.line, ")");
}

cudaError_t report_kernel_failure(int device, cudaError_t code, std::string message) {
  Runtime& r = runtime();
  if (g_strict.load()) {
    message += cat(" [strict emulator: replay with MGPU_EMU_STRICT=1 MGPU_EMU_SEED=", g_seed.load(),
                   "]");
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (device >= 0 && device < int(r.pending.size()) && r.pending[device] == cudaSuccess) {
      r.pending[device] = code;
      r.pending_detail[device] = message;
    }
  }
  return fail(code, std::move(message));
}

namespace {

cudaError_t check_pointers(const LaunchSpec& s) {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const PointerArg& p : s.pointers) {
    auto* alloc = find_allocation(p.value, true);
    if (p.embedded) {
      // A word of a struct argument: a pointer only if it lies in an allocation.
      if (alloc == nullptr) continue;
      int owner = alloc->second.device;
      if (owner >= 0 && owner != s.device && !r.peer[s.device][owner]) {
        return fail(cudaErrorIllegalAddress,
                    cat(launch_name(s), ": argument ", p.index, " holds a pointer to ",
                        where(*alloc), ", but the kernel runs on device ", s.device,
                        " without peer access to it; call cudaDeviceEnablePeerAccess(", owner,
                        ", 0) on device ", s.device, ", or copy the data first"));
      }
      continue;
    }
    if (alloc == nullptr) {
      return fail(cudaErrorIllegalAddress,
                  cat(launch_name(s), ": argument ", p.index, " is ", ptr_str(p.value),
                      ", which is not memory from cudaMalloc or cudaMallocHost (pageable host "
                      "memory, or a freed buffer); a kernel cannot dereference it"));
    }
    int owner = alloc->second.device;
    if (owner >= 0 && owner != s.device && !r.peer[s.device][owner]) {
      return fail(cudaErrorIllegalAddress,
                  cat(launch_name(s), ": argument ", p.index, " is ", where(*alloc),
                      ", but the kernel runs on device ", s.device,
                      " without peer access to it; call cudaDeviceEnablePeerAccess(", owner,
                      ", 0) on device ", s.device, ", or copy the data first"));
    }
  }
  return cudaSuccess;
}

cudaError_t check_config(const LaunchSpec& s) {
  const dim3 g = s.grid, b = s.block;
  uint64_t threads = uint64_t(b.x) * b.y * b.z;
  const char* why = nullptr;
  if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0) {
    why = "a grid or block dimension is 0";
  } else if (threads > 1024) {
    why = "more than 1024 threads per block";
  } else if (b.x > 1024 || b.y > 1024 || b.z > 64) {
    why = "block dimensions exceed (1024, 1024, 64)";
  } else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    why = "grid dimensions exceed (2^31-1, 65535, 65535)";
  }
  if (why != nullptr) {
    return fail(cudaErrorInvalidConfiguration, cat(launch_name(s), ": invalid configuration grid ",
                                                   dim_str(g), " block ", dim_str(b), ": ", why));
  }
  size_t limit = kDefaultDynamicSharedLimit;
  {
    Runtime& r = runtime();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.max_dynamic_shared.find(s.site.kernel_address);
    if (it != r.max_dynamic_shared.end()) limit = it->second;
  }
  if (s.shared_bytes > limit) {
    return fail(cudaErrorInvalidValue,
                cat(launch_name(s), ": ", s.shared_bytes,
                    " bytes of dynamic shared memory exceed "
                    "the kernel's limit of ",
                    limit,
                    "; raise it with cudaFuncSetAttribute(kernel, "
                    "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) (at most ",
                    kSharedOptinLimit, ")"));
  }
  return cudaSuccess;
}

}  // namespace

void launch(const LaunchSite& site, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            std::function<void()> body, const PointerArg* pointers, int num_pointers) {
  LaunchSpec spec{site,
                  grid,
                  block,
                  shared_bytes,
                  tls.device,
                  std::move(body),
                  std::vector<PointerArg>(pointers, pointers + num_pointers)};
  if (in_kernel()) {
    fail(cudaErrorNotSupported, cat(launch_name(spec),
                                    ": launching a kernel from a kernel "
                                    "(dynamic parallelism) is not emulated"));
    return;
  }
  CUstream_st* s = nullptr;
  if (resolve_stream("kernel launch", stream, &s)) return;
  if (s->device != tls.device) {
    fail(cudaErrorInvalidResourceHandle,
         cat(launch_name(spec), ": the stream belongs to device ", s->device,
             " but the current device is ", tls.device, "; call cudaSetDevice(", s->device,
             ") before launching"));
    return;
  }
  if (check_config(spec)) return;
  if (s->capturing) {
    // Fault injection for tests: MGPU_EMU_FAIL_CAPTURED_KERNEL=NAME refuses every launch of a
    // kernel whose name contains NAME into a capturing stream, as a launch refused before it
    // reaches the stream (the capture itself goes on). Read at each such launch, so a test may
    // set and unset it between steps.
    const char* name = std::getenv("MGPU_EMU_FAIL_CAPTURED_KERNEL");
    if (name != nullptr && *name != '\0' && std::strstr(spec.site.kernel, name) != nullptr) {
      fail(cudaErrorLaunchFailure,
           cat(launch_name(spec), ": refused on purpose while capturing a graph "
                                  "(MGPU_EMU_FAIL_CAPTURED_KERNEL=", name, ")"));
      return;
    }
  }
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  auto shared_spec = std::make_shared<const LaunchSpec>(std::move(spec));
  issue("kernel launch", s, legacy, [shared_spec] {
    if (cudaError_t e = check_pointers(*shared_spec)) {
      std::string detail = tls.detail;
      return report_kernel_failure(shared_spec->device, e, detail);
    }
    return run_grid(*shared_spec);
  });
}

}  // namespace mgpu::emu
