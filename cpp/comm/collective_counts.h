// cpp/comm/collective_counts.h -- how many gradient reductions this process has started and the
// bytes each carried: a bucket's all-reduce, the CPU devices' shared sum and update, a transfer of
// a partial sum between devices of the deterministic step's tree, a broadcast across ranks. Tests
// and measurements read it (the micro-batches of an accumulated step start none).
#pragma once

#include <cstdint>

namespace mgpu::comm {

struct CollectiveCounts {
  int64_t calls = 0;
  int64_t bytes = 0;
};

// Counts one reduction of `bytes` bytes (what one device contributes).
void count_collective(int64_t bytes);
CollectiveCounts collective_counts();

}  // namespace mgpu::comm
