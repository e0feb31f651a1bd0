// cpp/bind/bind_train.cpp -- the fused data-parallel step and evaluation.
#include <cmath>
#include <mutex>

#include "bind/bind.h"
#include "core/queue.h"
#include "train/lenet.h"
#include "train/train_batch.h"

namespace py = pybind11;

namespace mgpu::bind {

void bind_train(py::module_& m) {
  m.def("train_batch", [](const Tensor& X, const Tensor& y,
                          const std::vector<std::vector<Tensor>>& params,
                          const std::vector<Device>& devices, float lr) {
    MGPU_CHECK_VALUE(std::isfinite(lr) && lr > 0, "train_batch: the learning rate must be a "
                     "finite number > 0, got ", lr);
    py::gil_scoped_release nogil;
    // The step enqueues all-reduce parts on every device (on GPUs interleaved with each
    // device's backward): one step at a time, so concurrent threads' collectives cannot cross.
    std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
    return train::train_batch(X, y, params, devices, lr);
  }, "Fused LeNet step on every device; returns each device's summed loss (0-d).");
  m.def("evaluate_batch", [](const Tensor& X, const Tensor& y,
                             const std::vector<std::vector<Tensor>>& params,
                             const std::vector<Device>& devices) {
    py::gil_scoped_release nogil;
    return train::evaluate_batch(X, y, params, devices);
  }, "Correct predictions of the replicas on one batch, one 0-d count per device.");
  m.def("lenet_forward", &train::lenet_forward, py::call_guard<py::gil_scoped_release>(),
        "LeNet logits (N, 10) for X (N, 1, 28, 28).");
}

}  // namespace mgpu::bind
