// cpp/comm/shared_update.cpp -- the shared update of CPU replicas and the copy of the first
// replica's buffers (see shared_update.h).
#include "comm/shared_update.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "comm/allreduce_mpi.h"
#include "comm/collective_parts.h"
#include "core/parallel.h"
#include "core/queue.h"
#include "ops/dispatch.h"
#include "ops/elementwise.h"

namespace mgpu::comm {
namespace {

// sum[e] = the replicas' gradients at flat element f0 + e, added in device order.
void sum_block(const std::vector<float*>& grads, int64_t f0, int64_t n, float* sum) {
  const int k = static_cast<int>(grads.size());
  for (int64_t e = 0; e < n; ++e) {
    float acc = grads[0][f0 + e];
    for (int d = 1; d < k; ++d) acc += grads[static_cast<size_t>(d)][f0 + e];
    sum[e] = acc;
  }
}

// The same from the replicas' bfloat16 gradients: float32 sums, each rounded to bfloat16.
void sum_block_bf16(const std::vector<BFloat16*>& grads, int64_t f0, int64_t n, float* sum) {
  const int k = static_cast<int>(grads.size());
  for (int64_t e = 0; e < n; ++e) {
    float acc = grads[0][f0 + e];
    for (int d = 1; d < k; ++d) acc += grads[static_cast<size_t>(d)][f0 + e];
    sum[e] = static_cast<float>(BFloat16(acc));
  }
}

}  // namespace

bool shared_update_enabled() {
  const char* env = std::getenv("MGPU_CPU_SHARED_UPDATE");
  return !env || std::strcmp(env, "0") != 0;
}

void SharedUpdate::run(int me) {
  const int k = static_cast<int>(grads.size());
  constexpr int64_t B = ops::kElementBlock;
  const int64_t blocks = (total + B - 1) / B;
  const bool bf16 = !grads16.empty();
  if (bf16) {  // what this device sends: its own gradients in bfloat16, on its own cores
    const float* g = grads[static_cast<size_t>(me)];
    BFloat16* out = grads16[static_cast<size_t>(me)];
    parallel_for(blocks, [&](int64_t j) {
      for (int64_t i = j * B, end = std::min(total, i + B); i < end; ++i) out[i] = BFloat16(g[i]);
    });
  }
  barrier.arrive_and_wait();  // every replica's gradients are written (and rounded)
  auto sum_into = [&](int64_t f0, int64_t n, float* sum) {
    if (bf16) sum_block_bf16(grads16, f0, n, sum);
    else sum_block(grads, f0, n, sum);
  };
  const int64_t lo = blocks * me / k, hi = blocks * (me + 1) / k;
  const bool clipped = static_cast<bool>(clip);
  float factor = 1.0f;
  if (clipped) {
    parallel_for(hi - lo, [&](int64_t j) {
      const int64_t f0 = (lo + j) * B, n = std::min(total, f0 + B) - f0;
      sum_into(f0, n, grads[0] + f0);  // element by element, in place: each read first
      block_squares[static_cast<size_t>(lo + j)] = ops::cpu::sum_squares(n, grads[0] + f0);
    });
    barrier.arrive_and_wait();  // every block's sum and square sum are written
    double squares = 0.0;
    for (double s : block_squares) squares += s;
    factor = clip(squares);
  }
  parallel_for(hi - lo, [&](int64_t j) {
    const int64_t f0 = (lo + j) * B, n = std::min(total, f0 + B) - f0;
    if (clipped) {
      update(f0, n, grads[0] + f0, &factor);
      return;
    }
    float sum[B];
    sum_into(f0, n, sum);
    update(f0, n, sum, nullptr);
  });
  barrier.arrive_and_wait();  // every block of every replica is written before anyone reads
}

void enqueue_shared_update(const std::shared_ptr<SharedUpdate>& sh,
                           const std::vector<Device>& devices,
                           const std::vector<std::vector<Tensor>>& keep, const char* name) {
  enqueue_parts(sh, devices, keep, name);
}

void share_first(const std::vector<std::vector<Tensor>>& buffers) {
  const std::vector<Tensor>& first = buffers[0];
  if (first.empty()) return;
  if (dist::world_size() > 1) dist::broadcast(first, 0);
  for (size_t d = 1; d < buffers.size(); ++d)
    for (size_t j = 0; j < first.size(); ++j) ops::copy(buffers[d][j], first[j]);
}

}  // namespace mgpu::comm
