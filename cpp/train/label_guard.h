// cpp/train/label_guard.h -- atomic steps: labels outside [0, classes) leave parameters, momentum
// and batch-norm statistics as they were. Labels the host can read are checked there before
// anything is enqueued; the others are checked on the devices, with copies of the state the step
// changes put back where a device found a bad label, and the IndexError raised at the next wait.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "train/train_batch.h"

namespace mgpu::train {

// Labels in host memory that no queued task has touched (a NumPy array's copy, a data batch) are
// read here, before anything is enqueued (IndexError naming `op` for a bad one); returns false
// for the others, which a LabelGuard checks on the devices.
bool labels_checked_on_host(const char* op, const Tensor& y, int64_t classes);

// The device-side guard: each device checks the whole label vector (find_bad_label), the step
// keeps copies of the state it changes, and where the check found a bad label restore_if_flagged
// puts them back after the update; raise_if_flagged then raises the error at the next wait and
// leaves it on the step's loss. The host does not wait (but once, see start_guard).
struct LabelGuard {
  std::vector<Tensor> labels, flags;              // per device: the labels there, the verdict
  std::vector<std::vector<Tensor>> state, saved;  // per device: what the step changes, copies
};

// Enqueued before any of the step's work: the checks and the copies (batch norm's running
// statistics change in forward already). A first step that creates optimizer state waits for
// the verdict on the host, so a failed step leaves no new buffers behind.
LabelGuard start_guard(const char* op, int64_t classes, const Tensor& y,
                       const std::vector<Replica>& replicas, const Sgd& sgd);
// Enqueued after the update: the restores and the raise, the error left on `losses`.
void finish_guard(const char* op, const LabelGuard& g, int64_t classes,
                  const std::vector<Tensor>& losses);

}  // namespace mgpu::train
