// cpp/train/split_batch.cpp -- shard ranges and the copies that place shards on devices.
#include "train/split_batch.h"

#include "ops/elementwise.h"

namespace mgpu::train {

std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t n, size_t k) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t base = n / static_cast<int64_t>(k), extra = n % static_cast<int64_t>(k), at = 0;
  for (size_t i = 0; i < k; ++i) {
    int64_t len = base + (static_cast<int64_t>(i) < extra ? 1 : 0);
    out.emplace_back(at, at + len);
    at += len;
  }
  return out;
}

std::vector<Tensor> split_rows(const Tensor& x, const std::vector<Device>& devices) {
  MGPU_CHECK_VALUE(!devices.empty(), "split_batch: the list of devices is empty");
  MGPU_CHECK_VALUE(x.dim() >= 1, "split_batch: cannot split a 0-d tensor along axis 0");
  for (const Device& d : devices) check_device(d);
  std::vector<Tensor> shards;
  for (auto [begin, end] : shard_ranges(x.size(0), devices.size()))
    shards.push_back(ops::to_device(x.slice_rows(begin, end), devices[shards.size()]));
  return shards;
}

}  // namespace mgpu::train
