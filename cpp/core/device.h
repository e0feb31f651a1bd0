// cpp/core/device.h -- where a tensor lives and where its work runs: cpu(i) or gpu(i).
// CPU devices are virtual: cpu(0) and cpu(1) are distinct execution contexts (each owns a
// worker thread and its tensors), so the chapter's multi-device code runs in parallel without a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

namespace mgpu {

enum class DeviceKind : int8_t { CPU = 0, CUDA = 1 };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const {
    return kind != o.kind ? kind < o.kind : index < o.index;
  }
  std::string str() const { return (is_cpu() ? "cpu(" : "gpu(") + std::to_string(index) + ")"; }
};

inline std::ostream& operator<<(std::ostream& out, const Device& d) { return out << d.str(); }

// Most virtual CPU devices a process may use; ample for try_gpu(i) on any real machine.
constexpr int kMaxCpuDevices = 64;

// Checks that a device exists (raises ValueError/IndexError with advice otherwise).
void check_device(const Device& d);
// Number of CUDA devices usable by this build (0 in a CPU-only build or without a GPU).
int num_gpus();

}  // namespace mgpu

template <>
struct std::hash<mgpu::Device> {
  size_t operator()(const mgpu::Device& d) const noexcept {
    return std::hash<int>()(static_cast<int>(d.kind) * 1000003 + d.index);
  }
};
