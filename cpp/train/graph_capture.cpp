// cpp/train/graph_capture.cpp -- capture and replay of a replica's step as CUDA graphs. Inputs are
// copied into the graphs' own buffers, the gradients land in their own flat buffer (reduced and
// applied outside the graphs) and the loss is copied out, so nothing the caller keeps is
// overwritten by a later replay. Executed on emulated GPUs (cpp/cuda/emu); on real GPUs only compiled.
#include "train/graph_capture.h"

#include <atomic>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/gpu.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"
#include "ops/vendor_gpu.h"

namespace mgpu::train {

struct CapturedStep {
  Tensor x, y;                                // the graphs' input buffers
  Tensor grads, loss_sum;                     // their outputs
  std::vector<std::shared_ptr<gpu::Graph>> graphs;  // one per bucket, set by the capturing tasks
  std::vector<Queue::DeferredCheck> checks;   // the label checks, re-armed at every replay
  std::shared_ptr<gpu::GraphPool> pool;       // the intermediates' memory
  // Set by the worker when a task failed during the capture (the graphs would lack its work) or
  // a capture could not be ended: never replayed, and load_captured_step captures anew.
  std::atomic<bool> failed{false};
  uint64_t failures_at_begin = 0;             // the queue's failed_tasks() when capture began
};

namespace {

using StepKey = std::tuple<uint64_t, int, Shape, Shape, DType, std::vector<const void*>>;
constexpr size_t kMaxCapturedSteps = 16;

[[noreturn]] void capture_failed() {
  throw DeviceError("the CUDA graphs of this step could not be captured (see the first error on "
                    "this device); set MGPU_CUDA_GRAPH=0 to train without graphs");
}

std::shared_ptr<CapturedStep> capture(const Model& m, const Tensor& xs, const Tensor& ys,
                                      const ReplicaState& r, Device dev) {
  auto g = std::make_shared<CapturedStep>();
  g->x = Tensor::empty(xs.shape(), DType::F32, dev);
  g->y = Tensor::empty(ys.shape(), ys.dtype(), dev);
  g->grads = Tensor::empty({m.flat_size()}, DType::F32, dev);
  const size_t n = m.buckets().size();
  g->graphs.resize(n);
  Queue& q = queue_of(dev);
  // From the capture's first task to its last, only this thread enqueues on the device: another
  // host thread's op would run on the worker inside the capture.
  Queue::Exclusive only_this_thread(q);
  const bool cublas = ops::gemm_path() == ops::GemmPath::Cublas;
  q.enqueue("train step (capturing a CUDA graph)", [g, dev, &q, cublas] {
#if MGPU_BUILT_CUDA && !MGPU_CUDA_EMULATION_BUILD
    // cublasCreate allocates device memory (cudaMalloc), which the capturing thread may not do:
    // make the handle before the capture, not at the first mm inside it.
    if (cublas) ops::cuda::cublas_handle(dev.index);
#endif
    (void)cublas;
    g->failures_at_begin = q.failed_tasks();
    gpu::begin_capture(dev.index);
    q.begin_graph_checks();
  });
  gpu::begin_graph_pool(dev.index);
  // Graph b ends where bucket b's gradients are written; the next one begins there. After the
  // last bucket the label checks are collected (from graph 0, where the loss is).
  auto done = [g, dev, &q, n](size_t b) {
    q.enqueue("train step (capturing a CUDA graph)", [g, dev, &q, b, n] {
      if (b + 1 == n) g->checks = q.end_graph_checks();
      try {
        g->graphs[b] = gpu::end_capture(dev.index);
      } catch (...) {
        g->failed = true;
        if (b + 1 < n) gpu::begin_capture(dev.index);  // later graphs are still captured (and
        throw;                                          // ended): the state stays consistent
      }
      // A task that threw while this step was captured left its work out of the graphs: they
      // are incomplete, and a replay would compute something else without a word.
      if (q.failed_tasks() != g->failures_at_begin) g->failed = true;
      if (b + 1 < n) gpu::begin_capture(dev.index);
    });
  };
  size_t ended = 0;
  try {
    g->loss_sum = model_loss_and_grads(m, g->x, g->y, r, g->grads, [&](size_t b) {
      done(b);
      ended = b + 1;
    });
  } catch (...) {
    g->pool = gpu::end_graph_pool();
    for (size_t b = ended; b < n; ++b) done(b);  // end the capture left open
    throw;
  }
  g->pool = gpu::end_graph_pool();
  return g;
}

}  // namespace

bool graphs_enabled(const std::vector<Device>& devices) {
  if (!MGPU_GPU_BUILD) return false;
  for (const Device& d : devices)
    if (d.is_cpu()) return false;
  const char* v = std::getenv("MGPU_CUDA_GRAPH");
  if (v && std::string(v) == "0") return false;
  return ops::conv_path() != ops::ConvPath::Cudnn;
}

std::shared_ptr<CapturedStep> load_captured_step(const Model& m, const Tensor& xs, const Tensor& ys,
                                                 const ReplicaState& r, Device dev) {
  static std::mutex mutex;
  static auto* cache = new std::map<StepKey, std::shared_ptr<CapturedStep>>;  // never destroyed
  static auto* order = new std::deque<StepKey>;
  std::vector<const void*> where;
  for (const Tensor& p : r.params) where.push_back(p.raw());
  for (const Tensor& b : r.buffers) where.push_back(b.raw());
  StepKey key{m.id(), dev.index, xs.shape(), ys.shape(), ys.dtype(), where};
  std::shared_ptr<CapturedStep> g;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache->find(key);
    if (it != cache->end()) g = it->second;
    if (g && g->failed) g = nullptr;  // its capture failed (the error was raised): capture again
    if (!g) {
      g = capture(m, xs, ys, r, dev);
      if (cache->count(key) == 0) order->push_back(key);
      (*cache)[key] = g;
      if (order->size() > kMaxCapturedSteps) {
        cache->erase(order->front());
        order->pop_front();
      }
    }
  }
  ops::copy(g->x, xs);
  ops::copy(g->y, ys);
  return g;
}

const Tensor& captured_grads(const CapturedStep& g) { return g.grads; }

namespace {

void replay_graph(const std::shared_ptr<CapturedStep>& g, Device dev, size_t b) {
  Queue& q = queue_of(dev);
  q.enqueue("train step (CUDA graph)", [g, dev, &q, b] {
    if (g->failed || !g->graphs[b]) capture_failed();
    gpu::launch(*g->graphs[b], dev.index);
    if (b != 0) return;
    // Every replay writes the same flag and label buffers: check copies of this replay's, so
    // a later replay cannot overwrite its verdict before the host waits.
    std::vector<Queue::DeferredCheck> mine;
    for (const Queue::DeferredCheck& c : g->checks) {
      const auto* labels = c.fn.target<ops::LabelCheck>();
      mine.push_back(labels ? Queue::DeferredCheck{c.name, c.seq, labels->snapshot()} : c);
    }
    q.defer_checks(mine);
  });
}

}  // namespace

std::vector<Tensor> replay_captured_steps(const std::vector<std::shared_ptr<CapturedStep>>& steps,
                                          const std::vector<Device>& devs,
                                          const std::function<void(size_t, size_t)>& bucket_done) {
  MGPU_ASSERT(steps.size() == devs.size() && !steps.empty(), "one captured step per device");
  const size_t n = steps[0]->graphs.size();
  for (size_t b = 0; b < n; ++b) {
    for (size_t d = 0; d < devs.size(); ++d) replay_graph(steps[d], devs[d], b);
    for (size_t d = 0; d < devs.size(); ++d) bucket_done(b, d);
  }
  std::vector<Tensor> losses;
  for (size_t d = 0; d < devs.size(); ++d)
    losses.push_back(ops::to_device(steps[d]->loss_sum, devs[d], /*force_copy=*/true));
  return losses;
}

}  // namespace mgpu::train
