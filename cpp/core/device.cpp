// cpp/core/device.cpp -- which devices exist.
#include "core/device.h"

#include "core/error.h"
#include "core/gpu.h"

namespace mgpu {

int num_gpus() { return gpu::device_count(); }

void check_device(const Device& d) {
  if (d.is_cpu()) {
    MGPU_CHECK_INDEX(d.index >= 0 && d.index < kMaxCpuDevices, "cpu(", d.index,
                     ") does not exist: virtual CPU devices are cpu(0) .. cpu(",
                     kMaxCpuDevices - 1, ")");
    return;
  }
  int n = num_gpus();
  MGPU_CHECK_INDEX(d.index >= 0 && d.index < n, "gpu(", d.index, ") requested but this ",
                   n == 0 ? "build or machine has no GPU" : "machine has fewer GPUs",
                   " (mgpu.num_gpus() == ", n, "); use mgpu.try_gpu(i) to fall back to cpu(i)");
}

}  // namespace mgpu
