// cpp/cuda/emu/runtime_api.cpp -- the CUDA runtime API slice on host memory: errors, devices and
// peer access, memory and copies (every pointer checked against its allocation and device),
// streams that run work when it is issued, events, and graph capture that records and replays.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/emu/internal.h"

using mgpu::emu::cat;
using mgpu::emu::fail;
using mgpu::emu::runtime;
using mgpu::emu::tls;

namespace {
struct ErrorText {
  cudaError_t code;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorPeerAccessUnsupported, "cudaErrorPeerAccessUnsupported",
     "peer access is not supported between these two devices"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState",
     "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled",
     "peer access is already enabled"},
    {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled",
     "peer access has not been enabled"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorCapturedEvent, "cudaErrorCapturedEvent",
     "operation not permitted on an event last recorded in a capturing stream"},
    {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
const ErrorText* find_error(cudaError_t e) {
  for (const ErrorText& t : kErrors) {
    if (t.code == e) return &t;
  }
  return nullptr;
}

template <typename Set, typename Handle>
bool live(Set& set, Handle h) {
  std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
  return set.count(h) != 0;
}
}  // namespace

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* t = find_error(error);
  return t ? t->name : "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* t = find_error(error);
  return t ? t->text : "unrecognized error code";
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = tls.last_error;
  tls.last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return tls.last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: count is null");
  auto& r = runtime();
  *count = r.device_count;
  if (!r.config_error.empty()) return fail(cudaErrorInitializationError, r.config_error);
  if (r.device_count == 0) {
    return fail(cudaErrorNoDevice, "cudaGetDeviceCount: MGPU_EMULATED_GPUS=0 emulates no GPU");
  }
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (!mgpu::emu::valid_device(device)) return mgpu::emu::bad_device("cudaSetDevice", device);
  tls.device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDevice: device is null");
  *device = tls.device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is null");
  if (!mgpu::emu::valid_device(device))
    return mgpu::emu::bad_device("cudaGetDeviceProperties", device);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "mgpu emulated GPU %d (CPU fibers)", device);
  prop->totalGlobalMem = runtime().device_memory;
  prop->sharedMemPerBlock = mgpu::emu::kDefaultDynamicSharedLimit;
  prop->regsPerBlock = 65536;
  prop->warpSize = warpSize;
  prop->memPitch = size_t(1) << 31;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 8;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->canMapHostMemory = 1;
  prop->concurrentKernels = 1;
  prop->pciBusID = device;
  prop->asyncEngineCount = 1;
  prop->unifiedAddressing = 1;
  prop->memoryBusWidth = 64;
  prop->l2CacheSize = 1 << 20;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerMultiprocessor = mgpu::emu::kSharedOptinLimit;
  prop->regsPerMultiprocessor = 65536;
  prop->sharedMemPerBlockOptin = mgpu::emu::kSharedOptinLimit;
  prop->maxBlocksPerMultiProcessor = 32;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceSynchronize", tls.device);
  if (mgpu::emu::g_strict.load()) mgpu::emu::flush_device(tls.device);
  {
    auto& r = runtime();
    std::lock_guard<std::mutex> lock(r.mu);
    for (CUstream_st* s : r.streams) {
      if (s->capturing && s->device == tls.device) {
        s->invalidated = true;
        return fail(cudaErrorStreamCaptureUnsupported,
                    cat("cudaDeviceSynchronize while a stream of device ", tls.device,
                        " is capturing a graph; end the capture first"));
      }
    }
  }
  return mgpu::emu::take_pending(tls.device);
}
cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (canAccessPeer == nullptr)
    return fail(cudaErrorInvalidValue, "cudaDeviceCanAccessPeer: result pointer is null");
  if (!mgpu::emu::valid_device(device))
    return mgpu::emu::bad_device("cudaDeviceCanAccessPeer", device);
  if (!mgpu::emu::valid_device(peerDevice))
    return mgpu::emu::bad_device("cudaDeviceCanAccessPeer", peerDevice);
  *canAccessPeer = device != peerDevice && runtime().peer_supported;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  if (flags != 0) return fail(cudaErrorInvalidValue, "cudaDeviceEnablePeerAccess: flags must be 0");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceEnablePeerAccess", tls.device);
  if (!mgpu::emu::valid_device(peerDevice) || peerDevice == tls.device) {
    return mgpu::emu::bad_device("cudaDeviceEnablePeerAccess", peerDevice);
  }
  auto& r = runtime();
  if (!r.peer_supported) {
    return fail(cudaErrorPeerAccessUnsupported,
                cat("cudaDeviceEnablePeerAccess: device ", tls.device, " cannot access device ",
                    peerDevice, " (MGPU_EMU_PEER_ACCESS=0 emulates GPUs without peer access)"));
  }
  std::lock_guard<std::mutex> lock(r.mu);
  char& on = r.peer[tls.device][peerDevice];
  if (on) {
    return fail(cudaErrorPeerAccessAlreadyEnabled,
                cat("cudaDeviceEnablePeerAccess: device ", tls.device, " already accesses device ",
                    peerDevice));
  }
  on = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  if (!mgpu::emu::valid_device(peerDevice))
    return mgpu::emu::bad_device("cudaDeviceDisablePeerAccess", peerDevice);
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaDeviceDisablePeerAccess", tls.device);
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  char& on = r.peer[tls.device][peerDevice];
  if (!on) {
    return fail(cudaErrorPeerAccessNotEnabled,
                cat("cudaDeviceDisablePeerAccess: device ", tls.device, " has no access to device ",
                    peerDevice));
  }
  on = 0;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (func == nullptr) return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: func is null");
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    return fail(cudaErrorNotSupported,
                cat("cudaFuncSetAttribute: attribute ", int(attr), " is not emulated"));
  }
  if (value < 0 || size_t(value) > mgpu::emu::kSharedOptinLimit) {
    return fail(cudaErrorInvalidValue, cat("cudaFuncSetAttribute: ", value,
                                           " bytes of dynamic shared memory; "
                                           "the limit is ",
                                           mgpu::emu::kSharedOptinLimit));
  }
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.max_dynamic_shared[func] = size_t(value);
  return cudaSuccess;
}

namespace {
cudaError_t allocate(const char* api, void** ptr, size_t size, int device) {
  if (ptr == nullptr) return fail(cudaErrorInvalidValue, cat(api, ": result pointer is null"));
  *ptr = nullptr;
  if (cudaError_t e = mgpu::emu::check_capture_safe(api, cudaErrorStreamCaptureUnsupported))
    return e;
  if (size == 0) return cudaSuccess;
  auto& r = runtime();
  if (device >= 0) {
    std::lock_guard<std::mutex> lock(r.mu);
    if (size > r.device_memory - r.allocated[device]) {
      return fail(cudaErrorMemoryAllocation,
                  cat(api, ": out of memory on device ", device, ": asked for ", size, " bytes, ",
                      r.device_memory - r.allocated[device], " of ", r.device_memory, " free"));
    }
  }
  size_t rounded = (size + 255) / 256 * 256;  // CUDA aligns allocations to 256 bytes
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr)
    return fail(cudaErrorMemoryAllocation,
                cat(api, ": host allocation of ", size, " bytes failed"));
  // Fresh device memory is garbage on a GPU; 0xff bytes (NaN, -1) make reading it before writing
  // show.
  if (device >= 0) std::memset(p, 0xff, rounded);
  std::lock_guard<std::mutex> lock(r.mu);
  r.allocations[reinterpret_cast<uintptr_t>(p)] = mgpu::emu::Allocation{size, device};
  if (device >= 0) r.allocated[device] += size;
  *ptr = p;
  return cudaSuccess;
}
cudaError_t release(const char* api, void* p, bool device_memory) {
  if (p == nullptr) return cudaSuccess;
  if (cudaError_t e = mgpu::emu::check_capture_safe(api, cudaErrorStreamCaptureUnsupported))
    return e;
  // cudaFree waits for the device to be idle (every stream's work so far), as on a real GPU.
  if (mgpu::emu::g_strict.load()) mgpu::emu::flush_device(-1);
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == r.allocations.end() || (it->second.device >= 0) != device_memory) {
    return fail(device_memory ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue,
                cat(api, ": ", mgpu::emu::ptr_str(p), " is not the start of a live ",
                    device_memory ? "cudaMalloc" : "cudaMallocHost", " allocation"));
  }
  if (it->second.device >= 0) r.allocated[it->second.device] -= it->second.size;
  // Strict mode: the memory is poisoned (NaN as floats) before it goes, for a use after free
  // that escapes the pointer checks (a kernel holding a pointer into a later allocation).
  if (mgpu::emu::g_strict.load()) std::memset(p, 0xff, it->second.size);
  r.allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (!mgpu::emu::valid_device(tls.device)) return mgpu::emu::bad_device("cudaMalloc", tls.device);
  return allocate("cudaMalloc", devPtr, size, tls.device);
}
cudaError_t cudaFree(void* devPtr) { return release("cudaFree", devPtr, true); }
cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return allocate("cudaMallocHost", ptr, size, -1);
}
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  (void)flags;  // every emulated host allocation is "pinned" and mapped
  return allocate("cudaHostAlloc", pHost, size, -1);
}
cudaError_t cudaFreeHost(void* ptr) { return release("cudaFreeHost", ptr, false); }
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (free == nullptr || total == nullptr)
    return fail(cudaErrorInvalidValue, "cudaMemGetInfo: null result pointer");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaMemGetInfo", tls.device);
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  *total = r.device_memory;
  *free = r.device_memory - r.allocated[tls.device];
  return cudaSuccess;
}

namespace {
cudaError_t copy_async(const char* api, void* dst, const void* src, size_t count,
                       cudaMemcpyKind kind, cudaStream_t stream) {
  if (cudaError_t e = mgpu::emu::check_copy(api, dst, src, count, kind)) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  // A copy between two devices' memory on a stream of a third, or without peer access, is
  // refused; a copy to or from host memory may name any device's memory (unified addressing).
  if (mgpu::emu::g_strict.load() && count > 0 && mgpu::emu::is_device_memory(dst) &&
      mgpu::emu::is_device_memory(src)) {
    if (cudaError_t e = mgpu::emu::check_owner(api, "dst", dst, s->device)) return e;
    if (cudaError_t e = mgpu::emu::check_owner(api, "src", src, s->device)) return e;
  }
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = mgpu::emu::check_copy(api, dst, src, count, kind)) return e;
    if (count > 0) std::memmove(dst, src, count);
    return cudaSuccess;
  });
}
cudaError_t check_peer(const char* api, void* dst, int dstDevice, const void* src, int srcDevice,
                       size_t count) {
  if (!mgpu::emu::valid_device(dstDevice)) return mgpu::emu::bad_device(api, dstDevice);
  if (!mgpu::emu::valid_device(srcDevice)) return mgpu::emu::bad_device(api, srcDevice);
  if (count == 0) return cudaSuccess;
  if (cudaError_t e = mgpu::emu::check_side(api, "dst", dst, count, "device", dstDevice)) return e;
  return mgpu::emu::check_side(api, "src", src, count, "device", srcDevice);
}
cudaError_t peer_async(const char* api, void* dst, int dstDevice, const void* src, int srcDevice,
                       size_t count, cudaStream_t stream) {
  if (cudaError_t e = check_peer(api, dst, dstDevice, src, srcDevice, count)) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = check_peer(api, dst, dstDevice, src, srcDevice, count)) return e;
    if (count > 0) std::memmove(dst, src, count);
    return cudaSuccess;
  });
}
cudaError_t set_async(const char* api, void* devPtr, int value, size_t count, cudaStream_t stream) {
  auto check = [=] {
    return count == 0 ? cudaSuccess
                      : mgpu::emu::check_side(api, "pointer", devPtr, count, "device", -1);
  };
  if (cudaError_t e = check()) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream(api, stream, &s)) return e;
  if (mgpu::emu::g_strict.load() && count > 0) {
    if (cudaError_t e = mgpu::emu::check_owner(api, "pointer", devPtr, s->device)) return e;
  }
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue(api, s, legacy, [=] {
    if (cudaError_t e = check()) return e;
    if (count > 0) std::memset(devPtr, value, count);
    return cudaSuccess;
  });
}
}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy_async("cudaMemcpy", dst, src, count, kind, nullptr);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy_async("cudaMemcpyAsync", dst, src, count, kind, stream);
}
cudaError_t cudaMemcpyPeer(void* dst, int dstDevice, const void* src, int srcDevice, size_t count) {
  return peer_async("cudaMemcpyPeer", dst, dstDevice, src, srcDevice, count, nullptr);
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream) {
  return peer_async("cudaMemcpyPeerAsync", dst, dstDevice, src, srcDevice, count, stream);
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return set_async("cudaMemset", devPtr, value, count, nullptr);
}
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return set_async("cudaMemsetAsync", devPtr, value, count, stream);
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return cudaStreamCreateWithFlags(pStream, 0);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  if (pStream == nullptr)
    return fail(cudaErrorInvalidValue, "cudaStreamCreate: result pointer is null");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaStreamCreate", tls.device);
  auto* s = new CUstream_st;
  s->device = tls.device;
  s->flags = flags;
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams.insert(s);
  *pStream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  auto& r = runtime();
  if (live(r.streams, stream)) mgpu::emu::flush_stream(stream);  // its work still completes
  std::lock_guard<std::mutex> lock(r.mu);
  for (CUevent_st* e : r.events)
    if (e->stream == stream) e->stream = nullptr;
  if (r.streams.erase(stream) == 0) {
    return fail(cudaErrorInvalidResourceHandle,
                cat("cudaStreamDestroy: ", mgpu::emu::ptr_str(stream), " is not a live stream"));
  }
  r.retired.emplace_back(stream);  // a queued event wait may still read its progress
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamSynchronize", stream, &s)) return e;
  if (s->capturing) {
    s->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamSynchronize on a capturing stream; end the capture first");
  }
  mgpu::emu::flush_stream(s);
  return mgpu::emu::take_pending(s->device);
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamQuery", stream, &s)) return e;
  if (s->capturing) {
    s->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery on a capturing stream");
  }
  mgpu::emu::flush_stream(s);  // strict mode: its work is done by the time it says so
  return cudaSuccess;
}
namespace {
// An event's last record: the stream and the number of its item there (strict mode), or
// {nullptr, 0} when nothing is left to wait for.
std::pair<CUstream_st*, uint64_t> last_record(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
  if (event->stream == nullptr || event->target == 0 ||
      event->stream->completed.load() >= event->target)
    return {nullptr, 0};
  return {event->stream, event->target};
}

// Strict mode: the item cudaStreamWaitEvent queues on stream x. It finishes once item t of
// stream y (the event's record) has; until then it runs y's items up to t (nothing after them)
// where no other thread runs y, or blocks x until they have run.
Work event_wait(CUstream_st* x, CUstream_st* y, uint64_t t) {
  return [x, y, t]() -> cudaError_t {
    std::string deadlock = mgpu::emu::take_deadlock(x);
    if (!deadlock.empty()) return fail(cudaErrorLaunchFailure, "cudaStreamWaitEvent: " + deadlock);
    if (mgpu::emu::advance(y, t)) return cudaSuccess;
    mgpu::emu::block_stream([y, t] { mgpu::emu::drive(y, t); },
                            [y, t]() -> std::vector<mgpu::emu::Need> {
                              if (y->completed.load() >= t) return {};
                              return {mgpu::emu::Need{
                                  y, cat("an event (cudaStreamWaitEvent) recorded as item ", t)}};
                            });
    return cudaSuccess;
  };
}
}  // namespace

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  (void)flags;
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamWaitEvent", stream, &s)) return e;
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: not a live event");
  }
  // In a capture the order is the recording order, so the wait is a no-op.
  if (s->capturing) return cudaSuccess;
  // On a GPU a stream outside the capture that waits on a captured event joins the capture (or
  // fails once it has ended); the emulator does not join streams: refused in both modes.
  if (event->captured) {
    return fail(cudaErrorCapturedEvent,
                "cudaStreamWaitEvent outside the capture on an event last recorded in a "
                "capturing stream");
  }
  // Lenient: everything before the event's record has already run. Strict: as on a GPU, the
  // wait covers exactly the work issued on the event's stream before its most recent record at
  // the time of this call (a later record does not change it); work issued on that stream after
  // the record may run after what `stream` issues after this call. (A capturing stream's queue
  // holds only work issued before the capture.)
  if (!mgpu::emu::g_strict.load()) return cudaSuccess;
  auto [y, t] = last_record(event);
  if (y == nullptr || y == s) return cudaSuccess;
  // The legacy default stream runs its work as it is issued: the work before the record runs now.
  if (s->is_default && stream != cudaStreamPerThread) {
    mgpu::emu::drive(y, t);
    return cudaSuccess;
  }
  return mgpu::emu::issue("cudaStreamWaitEvent", s, false, event_wait(s, y, t));
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr)
    return fail(cudaErrorInvalidValue, "cudaEventCreate: result pointer is null");
  if (!mgpu::emu::valid_device(tls.device))
    return mgpu::emu::bad_device("cudaEventCreate", tls.device);
  auto* e = new CUevent_st;
  e->device = tls.device;
  e->flags = flags;
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: not a live event");
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaEventRecord", stream, &s)) return e;
  if (event->device != s->device) {
    return fail(cudaErrorInvalidResourceHandle,
                cat("cudaEventRecord: the event belongs to device ", event->device,
                    " but the stream to device ", s->device));
  }
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  uint64_t position = 0;
  cudaError_t e = mgpu::emu::issue("cudaEventRecord", s, legacy, [stamp = event->stamp] {
    stamp->ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    stamp->recorded = true;
    return cudaSuccess;
  }, &position);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mgpu::emu::rt().mu);
  event->stream = s;
  event->target = position;
  event->captured = s->capturing;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: not a live event");
  }
  // CUDA's rule in both modes: an event last recorded in a capture is a node of the graph, not
  // a point in time, until it is recorded again outside a capture.
  if (event->captured) {
    return fail(cudaErrorCapturedEvent,
                "cudaEventSynchronize on an event last recorded in a capturing stream (it is "
                "a node of the graph, not a point in time); record it outside the capture");
  }
  // Strict mode: the work issued before the record runs now, nothing after it. (A capturing
  // stream's queue holds only work issued before the capture.)
  if (mgpu::emu::g_strict.load()) {
    auto [y, t] = last_record(event);
    if (y != nullptr) mgpu::emu::drive(y, t);
  }
  return mgpu::emu::take_pending(event->device);
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!live(runtime().events, event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: not a live event");
  }
  if (event->captured) {
    return fail(cudaErrorCapturedEvent,
                "cudaEventQuery on an event last recorded in a capturing stream");
  }
  // Strict mode: as cudaEventSynchronize, the work before the record runs first (so the event
  // is complete when this says so); nothing after it.
  if (mgpu::emu::g_strict.load()) {
    auto [y, t] = last_record(event);
    if (y != nullptr) mgpu::emu::drive(y, t);
  }
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr) return fail(cudaErrorInvalidValue, "cudaEventElapsedTime: ms is null");
  if (!live(runtime().events, start) || !live(runtime().events, end)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not a live event");
  }
  if ((start->flags | end->flags) & cudaEventDisableTiming) {
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
  }
  if (!start->stamp->recorded || !end->stamp->recorded) {
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was never recorded");
  }
  using Ticks = std::chrono::steady_clock::duration;
  *ms = std::chrono::duration<float, std::milli>(Ticks(end->stamp->ticks.load()) -
                                                 Ticks(start->stamp->ticks.load()))
            .count();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.events.erase(event) == 0) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not a live event");
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamBeginCapture", stream, &s)) return e;
  if (s->is_default) {
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamBeginCapture: the default stream cannot capture; create a stream");
  }
  if (s->capturing)
    return fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  s->capturing = true;
  s->invalidated = false;
  s->mode = mode;
  s->capture_thread = std::this_thread::get_id();
  s->recorded.clear();
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  if (pGraph == nullptr) return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: pGraph is null");
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamEndCapture", stream, &s)) return e;
  if (!s->capturing)
    return fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  // CUDA's rule: a capture not begun in relaxed mode is ended by the thread that began it (the
  // capture goes on).
  if (s->mode != cudaStreamCaptureModeRelaxed && s->capture_thread != std::this_thread::get_id()) {
    return fail(cudaErrorStreamCaptureWrongThread,
                "cudaStreamEndCapture from another thread than the one that began the capture "
                "(only cudaStreamCaptureModeRelaxed allows that)");
  }
  s->capturing = false;
  *pGraph = nullptr;
  std::vector<Work> nodes = std::move(s->recorded);
  s->recorded.clear();
  if (s->invalidated) {
    return fail(cudaErrorStreamCaptureInvalidated,
                "cudaStreamEndCapture: the capture was invalidated by a call not allowed during "
                "capture (see the earlier error)");
  }
  auto* g = new CUgraph_st{std::move(nodes)};
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.graphs.insert(g);
  *pGraph = g;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* pCaptureStatus) {
  if (pCaptureStatus == nullptr)
    return fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: status is null");
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaStreamIsCapturing", stream, &s)) return e;
  *pCaptureStatus = !s->capturing    ? cudaStreamCaptureStatusNone
                    : s->invalidated ? cudaStreamCaptureStatusInvalidated
                                     : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags) {
  (void)flags;
  if (pGraphExec == nullptr)
    return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: pGraphExec is null");
  if (!live(runtime().graphs, graph)) {
    return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: not a live graph");
  }
  auto* x = new CUgraphExec_st{graph->nodes};
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  r.execs.insert(x);
  *pGraphExec = x;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  if (!live(runtime().execs, graphExec)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: not a live executable graph");
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = mgpu::emu::resolve_stream("cudaGraphLaunch", stream, &s)) return e;
  std::vector<Work> nodes = graphExec->nodes;  // the exec may be destroyed once launched
  bool legacy = s->is_default && stream != cudaStreamPerThread;
  return mgpu::emu::issue("cudaGraphLaunch", s, legacy, [nodes] {
    for (const Work& node : nodes) {
      if (cudaError_t e = node()) return e;
    }
    return cudaSuccess;
  });
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.execs.erase(graphExec) == 0) {
    return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: not a live executable graph");
  }
  delete graphExec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  auto& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.graphs.erase(graph) == 0)
    return fail(cudaErrorInvalidValue, "cudaGraphDestroy: not a live graph");
  delete graph;
  return cudaSuccess;
}
