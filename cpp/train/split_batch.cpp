// cpp/train/split_batch.cpp -- shard ranges and the copies that place shards on devices.
#include "train/split_batch.h"

#include "comm/allreduce_mpi.h"
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

std::vector<Tensor> take_shards(const Tensor& x, const std::vector<Device>& devices, size_t first,
                                size_t total, bool place) {
  MGPU_CHECK_VALUE(!devices.empty(), "split_batch: the list of devices is empty");
  MGPU_CHECK_VALUE(x.dim() >= 1, "split_batch: cannot split a 0-d tensor along axis 0");
  for (const Device& d : devices) check_device(d);
  const auto ranges = shard_ranges(x.size(0), total);
  std::vector<Tensor> shards;
  for (size_t d = 0; d < devices.size(); ++d) {
    auto [begin, end] = ranges[first + d];
    Tensor rows = x.slice_rows(begin, end);
    shards.push_back(place ? ops::to_device(rows, devices[d]) : rows);
  }
  return shards;
}

std::vector<Tensor> split_rows(const Tensor& x, const std::vector<Device>& devices) {
  return take_shards(x, devices, 0, devices.size(), true);
}

std::vector<Tensor> rank_shards(const Tensor& x, const std::vector<Device>& devices, bool place) {
  const size_t L = devices.size(), world = static_cast<size_t>(comm::dist::world_size());
  return take_shards(x, devices, static_cast<size_t>(comm::dist::rank()) * L, L * world, place);
}

}  // namespace mgpu::train
