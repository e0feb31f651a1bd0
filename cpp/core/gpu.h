// cpp/core/gpu.h -- the CUDA runtime as mgpu's GPU devices use it: which GPUs exist, each one's
// streams, its caching allocator, pinned staging for host-to-device copies, and the copies the
// engine needs. Real CUDA (nvcc found), the emulator (MGPU_CUDA_EMULATION: MGPU_EMULATED_GPUS
// devices, default 2), or in a CPU-only build (MGPU_GPU_BUILD = 0) stubs: device_count() is 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cuda/stream.h"

#ifndef MGPU_GPU_BUILD
#define MGPU_GPU_BUILD 0
#endif

// The model: a GPU device's Queue (queue.h) is a worker thread whose current device is that GPU;
// its tasks launch work on the device's compute stream and return at once. A waiter outside the
// queue (the host, another device) first waits for the task, then for the stream
// (synchronize()), so "done" means finished on the GPU. Memory goes back to the cache when its
// last Tensor is gone, possibly before queued kernels have run: that is safe because every later
// user of the block is ordered after them on the same stream. Work of another stream or device
// on a block (a peer copy, the communication stream) must keep the block alive until that work
// is finished or the compute stream waits for it (ops::copy and the all-reduce do).
namespace mgpu::gpu {

constexpr int kMaxGpus = 64;

// Usable GPUs (cudaGetDeviceCount; 0 when it fails: no driver, no device, CPU-only build).
int device_count();
// Why device_count() is 0 where the GPU query failed (cudaGetErrorString of
// cudaGetDeviceCount's error: no driver, no device), or "" where it succeeded or nothing was asked.
std::string device_query_error();
// "CUDA <version>", "emulated CUDA (mgpu's emulator)" or "not built".
std::string runtime_name();

// Makes `device` the calling thread's current device (asks the runtime which one is current:
// other code on the thread may have changed it, so nothing is cached).
void set_device(int device);
// The device's streams, created on first use and kept for the process's life.
cudaStream_t compute_stream(int device);
cudaStream_t comm_stream(int device);
// DLPack import: the stream a producer is asked to order its pending work before (`stream` of
// __dlpack__), never used by mgpu's worker, so a foreign thread's wait on it cannot land in a
// graph the worker captures; import_fence records where the producer's work ends on it, and
// wait_import_fence (by the device's worker) makes the compute stream wait for that point.
cudaStream_t import_stream(int device);
struct ImportFence;
std::shared_ptr<ImportFence> import_fence(int device);
void wait_import_fence(int device, const ImportFence& fence);
// Blocks until the compute and the communication stream have finished everything issued so far
// (waitall() means every stream mgpu's work runs on); a failed kernel (an asynchronous error on a
// real GPU) is thrown as DeviceError naming the device. While the compute stream is capturing a
// graph (below) it waits for the work issued on it before the capture began instead: captured
// work does not run, and a capturing stream must not be synchronised.
void synchronize(int device);

// How many times a host thread has blocked until GPU work finished (synchronize(), a staging
// buffer's reuse, a collective's completion): a measure of the stalls a step puts on the
// devices' queues, each one a GPU idle while its worker waits.
void count_host_wait();
uint64_t host_waits();

// The caching device allocator: blocks rounded to a size class and kept on per-device free lists,
// so a training loop's steady state calls no cudaMalloc. When cudaMalloc fails the cache is
// emptied and the call retried; if it still fails, OutOfMemoryError names the device, the size
// and what mgpu holds. *capacity receives the block's real size (pass it back to release).
void* allocate(int device, size_t nbytes, size_t* capacity);
void release(int device, void* ptr, size_t capacity);
struct MemoryStats {
  size_t allocated = 0;       // bytes in live tensors
  size_t cached = 0;          // bytes on the free lists
  size_t peak_allocated = 0;  // high-water mark of `allocated`
  size_t device_mallocs = 0;  // cudaMalloc calls so far (flat in a steady state)
};
MemoryStats memory_stats(int device);
// Waits for the device, then returns its cached blocks to the driver.
void empty_cache(int device);
// Held around calls that synchronise a whole device (cudaFree) and around NCCL's grouped
// launches: a cudaFree while NCCL launches its kernels on several devices can hang both.
std::mutex& device_wide_mutex();

// Copies issued on `device`'s compute stream, by the device's worker (what it issues while it
// captures a graph would be captured):
// host -> device through a pinned staging buffer: `src` may be reused as soon as this returns;
void copy_from_host(int device, void* dst, const void* src, size_t nbytes);
// device -> host on the stream, complete when it returns;
void copy_to_host(int device, void* dst, const void* src, size_t nbytes);
// device -> host off the stream (a plain cudaMemcpy), for a reader that already synchronised: it
// cannot land in a graph the device's worker may be capturing meanwhile.
void read_to_host(int device, void* dst, const void* src, size_t nbytes);
// within the device, asynchronous;
void copy_within(int device, void* dst, const void* src, size_t nbytes);
// from another GPU's memory (peer copy), asynchronous on `device`'s stream; the caller has made
// sure the source's producer has finished (synchronize(src_device)).
void copy_from_peer(int device, void* dst, int src_device, const void* src, size_t nbytes);
void memset_async(int device, void* dst, int value, size_t nbytes);

// ---- CUDA graphs (the fused step's steady state) ----
// A captured and instantiated graph; destroying it frees the executable graph.
class Graph;
// On the device's worker: starts capturing its compute stream (thread-local mode: other threads
// may still allocate and synchronise). Everything the worker launches until end_capture is
// recorded, not run.
void begin_capture(int device);
std::shared_ptr<Graph> end_capture(int device);
// Replays the graph on the device's compute stream.
void launch(const Graph& graph, int device);

// Memory a graph keeps using at every replay: blocks this thread allocates on `device` between
// begin_graph_pool and end_graph_pool stay out of the free lists while the returned pool lives
// (a tensor dying during capture must not hand its address to someone else); dropping the pool
// returns the released ones.
class GraphPool;
void begin_graph_pool(int device);
std::shared_ptr<GraphPool> end_graph_pool();

}  // namespace mgpu::gpu
