// cpp/ops/dropout.h -- dropout with counter-based masks: y = x * m and dx = dy * m, where m is
// 1 / (1 - p) (in float32, as PyTorch scales) for a kept element and 0 for a dropped one. x, y,
// dy, dx share one contiguous shape (N, ...), seen as N rows of D = numel / N elements.
// Element e of row r is kept iff u >= p, u = philox4x32_10(counter (e / 4, first_row + r, stream,
// 0), key (seed mod 2^32, seed / 2^32))[e % 4] / 2^32: a pure function of (seed, stream, the
// row's index in a whole batch, e). The fused step passes the step's seed, the layer's index
// as the stream and each shard's first row in the step's batch, so a batch split over any number
// of devices, ranks or micro-batches draws the same masks. Forward keeps nothing: backward
// recomputes the mask from the same counters (no N * D mask held from forward to backward; the
// generator's integer work costs less than reading a saved mask on a CPU). Backward writes dx.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mgpu::ops {

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): ten
// rounds of two 32 x 32 -> 64-bit products and xors, the key bumped by the Weyl constants
// between rounds. c is the counter in, the four outputs out.
MGPU_HD inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t a = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t b = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t c1 = c[1], c3 = c[3];
    c[0] = static_cast<uint32_t>(b >> 32) ^ c1 ^ k0;
    c[1] = static_cast<uint32_t>(b);
    c[2] = static_cast<uint32_t>(a >> 32) ^ c3 ^ k1;
    c[3] = static_cast<uint32_t>(a);
  }
}

// Which masks: the seed, the stream (a fused step's layer index), the first row's index in the
// whole batch, and p in [0, 1].
struct DropoutKey {
  uint64_t seed = 0;
  uint32_t stream = 0;
  int64_t first_row = 0;
  double p = 0.5;
};

// out = in * mask over rows of D elements (forward: in x, out y; backward: in dy, out dx). Body
// index i is one Philox block: row i / groups, elements 4 (i % groups) .. + 3 of it (groups =
// ceil(D / 4); a row's last block may be short). threshold = ceil(p 2^32), so u >= p is
// r >= threshold in integers (p = 1: 2^32, nothing kept).
struct DropoutMasked {
  const float* in; float* out;
  int64_t row_len, groups;
  uint64_t seed, threshold;
  uint32_t stream;
  int64_t first_row;
  float scale;
  MGPU_HD void operator()(int64_t i) const {
    const int64_t row = i / groups, g = i - row * groups;
    const uint64_t global_row = static_cast<uint64_t>(first_row + row);
    uint32_t c[4] = {static_cast<uint32_t>(g), static_cast<uint32_t>(global_row), stream, 0u};
    philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    const int64_t base = row * row_len + 4 * g;
    const int64_t n = row_len - 4 * g < 4 ? row_len - 4 * g : 4;
    for (int64_t j = 0; j < n; ++j)
      out[base + j] = in[base + j] * (static_cast<uint64_t>(c[j]) >= threshold ? scale : 0.0f);
  }
};

Tensor dropout_forward(const Tensor& x, const DropoutKey& key);    // returns y
Tensor dropout_backward(const Tensor& dy, const DropoutKey& key);  // returns dx

}  // namespace mgpu::ops
