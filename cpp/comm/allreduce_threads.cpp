// cpp/comm/allreduce_threads.cpp -- all-reduce across CPU devices by their own worker threads.
// Reduce-scatter then all-gather over shared memory: the flat buffer is cut into k chunks and
// device j sums chunk j of all k buffers into its own, then every device copies the other
// chunks from their owners. Each device does 1/k of the additions, so the work is spread evenly
// and no device is a bottleneck (the chapter's exercise on a more efficient allreduce).
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>

#include "comm/allreduce.h"
#include "comm/allreduce_gpu.h"
#include "comm/barrier.h"
#include "comm/collective_parts.h"
#include "core/parallel.h"

namespace mgpu::comm {
namespace {

// One tensor's place in the flat buffer: elements [begin, begin + n).
struct Segment {
  int64_t begin, n;
};

struct Collective {
  std::vector<std::vector<float*>> ptr;  // ptr[device][tensor]
  // wire BF16: half[device] holds that device's `total` values in bfloat16, the flat buffer
  // the other devices read (its own rounded values, then its chunk's sums); empty for float32.
  std::vector<BFloat16*> half;
  std::vector<Segment> segs;
  int64_t total = 0;
  Barrier barrier;
  explicit Collective(int k) : barrier(k) {}

  int64_t chunk_begin(int j, int k) const { return total * j / k; }

  // Applies fn(tensor index, element offset in tensor, count) over flat range [lo, hi).
  template <typename Fn>
  void for_range(int64_t lo, int64_t hi, Fn&& fn) const {
    for (size_t t = 0; t < segs.size(); ++t) {
      int64_t a = std::max(lo, segs[t].begin), b = std::min(hi, segs[t].begin + segs[t].n);
      if (a < b) fn(t, a - segs[t].begin, b - a);
    }
  }

  void run(int me) {
    if (!half.empty()) return run_bf16(me);
    int k = static_cast<int>(ptr.size());
    // Every peer must have finished producing its buffer before anyone reads it.
    barrier.arrive_and_wait();
    // Reduce-scatter: my chunk of my buffer becomes the sum, in device order 0, 1, ..., k-1.
    for_range(chunk_begin(me, k), chunk_begin(me + 1, k), [&](size_t t, int64_t off, int64_t n) {
      constexpr int64_t kBlock = 1 << 14;
      parallel_for((n + kBlock - 1) / kBlock, [&](int64_t blk) {
        int64_t i0 = off + blk * kBlock, i1 = std::min(off + n, i0 + kBlock);
        float* out = ptr[me][t];
        for (int64_t i = i0; i < i1; ++i) {
          float acc = ptr[0][t][i];
          for (int d = 1; d < k; ++d) acc += ptr[d][t][i];
          out[i] = acc;
        }
      });
    });
    barrier.arrive_and_wait();
    // All-gather: fetch every other chunk from the device that owns it.
    for (int j = 0; j < k; ++j) {
      if (j == me) continue;
      for_range(chunk_begin(j, k), chunk_begin(j + 1, k), [&](size_t t, int64_t off, int64_t n) {
        std::memcpy(ptr[me][t] + off, ptr[j][t] + off, static_cast<size_t>(n) * sizeof(float));
      });
    }
    // Nobody may write its buffer again until every peer has finished reading it.
    barrier.arrive_and_wait();
  }

  // The same in bfloat16 (allreduce.h's wire BF16): every device rounds its own values into its
  // half buffer; device j sums chunk j of the half buffers (widened, float32, device order) and
  // rounds the sum into its own half buffer; every device widens each chunk from its owner's.
  void run_bf16(int me) {
    const int k = static_cast<int>(ptr.size());
    constexpr int64_t kBlock = 1 << 14;
    auto blocks = [&](int64_t off, int64_t n, auto&& body) {
      parallel_for((n + kBlock - 1) / kBlock, [&](int64_t blk) {
        const int64_t i0 = off + blk * kBlock, i1 = std::min(off + n, i0 + kBlock);
        body(i0, i1);
      });
    };
    for_range(0, total, [&](size_t t, int64_t off, int64_t n) {
      const float* g = ptr[me][t];
      BFloat16* out = half[me] + segs[t].begin;
      blocks(off, n, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) out[i] = BFloat16(g[i]);
      });
    });
    barrier.arrive_and_wait();
    const int64_t lo = chunk_begin(me, k);
    blocks(lo, chunk_begin(me + 1, k) - lo, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float acc = static_cast<float>(half[0][i]);
        for (int d = 1; d < k; ++d) acc += static_cast<float>(half[d][i]);
        // Device me's own value at i is read by no one else: the sum may replace it.
        half[me][i] = BFloat16(acc);
      }
    });
    barrier.arrive_and_wait();
    for (int j = 0; j < k; ++j) {
      for_range(chunk_begin(j, k), chunk_begin(j + 1, k), [&](size_t t, int64_t off, int64_t n) {
        const BFloat16* from = half[j] + segs[t].begin;
        float* to = ptr[me][t];
        blocks(off, n, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) to[i] = static_cast<float>(from[i]);
        });
      });
    }
    barrier.arrive_and_wait();
  }
};

}  // namespace

void allreduce(const std::vector<std::vector<Tensor>>& data, DType wire) {
  MGPU_CHECK_VALUE(!data.empty(), "allreduce: got no tensors; pass one tensor (or one list of "
                   "tensors) per device");
  const size_t k = data.size(), m = data[0].size();
  std::vector<Device> devices;
  for (size_t d = 0; d < k; ++d) {
    MGPU_CHECK_VALUE(data[d].size() == m, "allreduce: device entry ", d, " has ", data[d].size(),
                     " tensors but entry 0 has ", m, "; every device must pass the same list");
    MGPU_CHECK_VALUE(m > 0, "allreduce: entry ", d, " is empty");
    Device dev = data[d][0].device();
    for (size_t t = 0; t < m; ++t) {
      const Tensor& x = data[d][t];
      MGPU_CHECK_VALUE(x.defined(), "allreduce: tensor ", t, " of entry ", d, " is None");
      require_dtype("allreduce", "every tensor", x, DType::F32);
      MGPU_CHECK_VALUE(x.device() == dev, "allreduce: entry ", d, " mixes devices ", dev, " and ",
                       x.device(), "; each entry must live on one device");
      MGPU_CHECK_VALUE(x.shape() == data[0][t].shape(), "allreduce: tensors must have equal "
                       "shapes, but ", x.shape(), " on ", dev, " differs from ",
                       data[0][t].shape(), " on ", data[0][t].device());
    }
    for (const Device& seen : devices)
      MGPU_CHECK_VALUE(seen != dev, "allreduce: two tensors are on ", dev,
                       "; pass exactly one per device (add same-device tensors first)");
    MGPU_CHECK_VALUE(dev.is_cpu() == data[0][0].device().is_cpu(), "allreduce: entries on ",
                     data[0][0].device(), " and ", dev, " mix CPU and GPU devices; all-reduce "
                     "across one kind, or copy the tensors to one kind of device first");
    devices.push_back(dev);
  }
  MGPU_ASSERT(wire == DType::F32 || wire == DType::BF16, "allreduce: wire dtype ",
              dtype_name(wire));
  if (k == 1) return;  // the sum over one device is itself
#if MGPU_GPU_BUILD
  if (!devices[0].is_cpu()) return allreduce_gpu(data, devices, wire);
#endif

  auto coll = std::make_shared<Collective>(static_cast<int>(k));
  coll->ptr.assign(k, std::vector<float*>(m));
  for (size_t t = 0; t < m; ++t) {
    coll->segs.push_back({coll->total, data[0][t].numel()});
    coll->total += data[0][t].numel();
  }
  for (size_t d = 0; d < k; ++d)
    for (size_t t = 0; t < m; ++t) coll->ptr[d][t] = data[d][t].f32();
  std::vector<std::vector<Tensor>> keep = data;
  if (wire == DType::BF16) {
    for (size_t d = 0; d < k; ++d) {
      const Tensor half = Tensor::empty({coll->total}, DType::BF16, devices[d], "allreduce");
      coll->half.push_back(half.data<BFloat16>());
      keep[d].push_back(half);
    }
  }
  // Every queue gets its part in the same host order, so the barriers inside cannot deadlock:
  // each queue reaches this collective after all work enqueued on it before (and the lock keeps
  // another host thread's collective from interleaving with this one's parts).
  enqueue_parts(coll, devices, keep, "allreduce");
}

}  // namespace mgpu::comm
