// cpp/bind/bind_train.cpp -- the fused data-parallel step: LeNet's train_batch and the Model of any
// list of layers (its spec format is documented in python/mgpu/_core.pyi).
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "bind/bind.h"
#include "comm/collective_counts.h"
#include "core/queue.h"
#include "ops/elementwise.h"
#include "ops/precision.h"
#include "train/lenet.h"
#include "train/train_batch.h"

namespace py = pybind11;

namespace mgpu::bind {
namespace {

// A model with one replica per device: what mgpu._core.Model holds.
struct Replicated {
  std::unique_ptr<train::Model> model;
  std::vector<train::Replica> replicas;
};

std::string type_name(const py::handle& h) {
  return py::str(py::type::handle_of(h).attr("__name__")).cast<std::string>();
}

std::vector<int64_t> ints(const py::handle& v, const std::string& where) {
  std::vector<int64_t> out;
  if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) {
    out.push_back(v.cast<int64_t>());
    return out;
  }
  MGPU_CHECK_TYPE(py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v), where,
                  " must be an int or a list of ints, got ", type_name(v));
  for (const py::handle& x : v) {
    MGPU_CHECK_TYPE(py::isinstance<py::int_>(x) && !py::isinstance<py::bool_>(x), where,
                    " must hold ints, got ", type_name(x));
    out.push_back(x.cast<int64_t>());
  }
  return out;
}

train::LayerSpec parse_layer(const py::handle& entry, size_t i) {
  const std::string where = "Model: spec entry " + std::to_string(i);
  MGPU_CHECK_TYPE(py::isinstance<py::tuple>(entry) || py::isinstance<py::list>(entry), where,
                  " must be a tuple (kind, options), got ", type_name(entry));
  py::sequence seq = py::reinterpret_borrow<py::sequence>(entry);
  MGPU_CHECK_VALUE(seq.size() == 1 || seq.size() == 2, where, " must be (kind,) or (kind, "
                   "options), got ", seq.size(), " items");
  MGPU_CHECK_TYPE(py::isinstance<py::str>(seq[0]), where, ": the kind must be a str");
  train::LayerSpec s;
  s.kind = seq[0].cast<std::string>();
  if (seq.size() == 1) return s;
  MGPU_CHECK_TYPE(py::isinstance<py::dict>(seq[1]), where, " (", s.kind, "): options must be a "
                  "dict, got ", type_name(seq[1]));
  for (const auto& [k, v] : py::reinterpret_borrow<py::dict>(seq[1])) {
    MGPU_CHECK_TYPE(py::isinstance<py::str>(k), where, " (", s.kind, "): option names must be str");
    const std::string key = k.cast<std::string>();
    const std::string at = where + " (" + s.kind + "), option '" + key + "'";
    if (key == "in") s.inputs = ints(v, at);
    else if (key == "params") s.params = ints(v, at);
    else if (key == "buffers") s.buffers = ints(v, at);
    else {
      MGPU_CHECK_TYPE(py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v), at,
                      " must be a number or bool, got ", type_name(v));
      s.options[key] = v.cast<double>();
    }
  }
  return s;
}

std::unique_ptr<Replicated> make(const py::list& spec,
                                 const std::vector<std::vector<Tensor>>& params,
                                 const std::vector<std::vector<Tensor>>& buffers,
                                 const std::vector<Device>& devices) {
  std::vector<train::LayerSpec> layers;
  for (size_t i = 0; i < spec.size(); ++i) layers.push_back(parse_layer(spec[i], i));
  MGPU_CHECK_VALUE(!devices.empty(), "Model: the list of devices is empty");
  MGPU_CHECK_VALUE(params.size() == devices.size() && buffers.size() == devices.size(), "Model: "
                   "got ", params.size(), " parameter and ", buffers.size(), " buffer replicas for ",
                   devices.size(), " devices; pass one list of each per device");
  std::vector<Shape> ps, bs;
  for (const Tensor& p : params[0]) {
    MGPU_CHECK_VALUE(p.defined(), "Model: a parameter is None");
    ps.push_back(p.shape());
  }
  for (const Tensor& b : buffers[0]) {
    MGPU_CHECK_VALUE(b.defined(), "Model: a buffer is None");
    bs.push_back(b.shape());
  }
  auto r = std::make_unique<Replicated>();
  r->model = std::make_unique<train::Model>(layers, ps, bs, ops::conv_algo_for(devices[0]),
                                            devices[0].is_cpu());
  for (size_t d = 0; d < devices.size(); ++d)
    r->replicas.push_back(
        {devices[d], {params[d], buffers[d]}, Tensor(), Tensor(), Tensor(), Tensor()});
  train::check_replicas("Model", *r->model, r->replicas);
  return r;
}

const train::Replica& replica(const Replicated& r, int64_t d) {
  MGPU_CHECK_INDEX(d >= 0 && d < static_cast<int64_t>(r.replicas.size()), "Model: replica ", d,
                   " does not exist; there are ", r.replicas.size());
  return r.replicas[static_cast<size_t>(d)];
}

// The optimizer state `which` (0 momentum or Adam's m, 1 Adam's v, 2 amsgrad's maximum of v).
template <class R>
auto& state_of(R& rep, int which) {
  return which == 0 ? rep.momentum : which == 1 ? rep.second : rep.max_second;
}

}  // namespace

void bind_train(py::module_& m) {
  m.def("train_batch", [](const Tensor& X, const Tensor& y,
                          const std::vector<std::vector<Tensor>>& params,
                          const std::vector<Device>& devices, float lr, int64_t shards,
                          int64_t accumulate, const std::string& precision) {
    // lr as mgpu.train_batch checked it (Python checks each learning rate once, where the user
    // gives it).
    const ops::Precision pr = ops::parse_precision(precision);
    py::gil_scoped_release nogil;
    // The step enqueues all-reduce parts on every device (on GPUs interleaved with each
    // device's backward): one step at a time, so concurrent threads' collectives cannot cross.
    std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
    return train::train_batch(X, y, params, devices, lr, shards, accumulate, pr);
  }, py::arg("X"), py::arg("y"), py::arg("params"), py::arg("devices"), py::arg("lr"),
     py::arg("shards") = 0, py::arg("accumulate") = 1, py::arg("precision") = "float32",
     "Fused LeNet step on every device; returns each device's summed loss (0-d). shards > 0: "
     "the deterministic step over that many logical shards; accumulate: micro-batches; "
     "precision 'float32' or 'bf16' (conv and linear products with bfloat16 operands).");
  m.def("evaluate_batch", [](const Tensor& X, const Tensor& y,
                             const std::vector<std::vector<Tensor>>& params,
                             const std::vector<Device>& devices) {
    py::gil_scoped_release nogil;
    return train::evaluate_batch(X, y, params, devices);
  }, "Correct predictions of the replicas on one batch, one 0-d count per device.");
  m.def("layer_kinds", [] {
    std::vector<std::pair<std::string, std::vector<std::string>>> out;
    for (const train::LayerDef* d : train::spec_layer_kinds()) out.emplace_back(d->name, d->options);
    return out;
  }, "[(kind, [option names])] for every layer kind a Model spec may name (train/layer_kind.h's "
     "records, in their order).");
  m.def("lenet_forward", &train::lenet_forward, py::call_guard<py::gil_scoped_release>(),
        "LeNet logits (N, 10) for X (N, 1, 28, 28).");
  m.def("_collective_counts", [] {
    const comm::CollectiveCounts c = comm::collective_counts();
    return std::pair<int64_t, int64_t>{c.calls, c.bytes};
  }, "Gradient reductions this process has started and their bytes (comm/collective_counts.h): "
     "bucket all-reduces, shared CPU updates, partial-sum transfers, broadcasts across ranks.");
  m.def("_fail_next_step_after_bucket", &train::fail_next_step_after_bucket, py::arg("bucket"),
        "Tests only: the next bucketed step on several devices throws OutOfMemoryError once "
        "every device has passed gradient bucket `bucket` to the all-reduce (-1: off).");

  py::class_<Replicated>(m, "Model", "A list of layers with one replica per device, trained by "
                         "one fused data-parallel step.")
      .def(py::init(&make), py::arg("spec"), py::arg("params"), py::arg("buffers"),
           py::arg("devices"))
      .def("train_step", [](Replicated& r, const Tensor& X, const Tensor& y, float lr,
                            float momentum, float weight_decay, int64_t shards,
                            const std::string& optimizer, std::pair<float, float> betas, float eps,
                            int64_t step, std::optional<float> max_norm,
                            const std::vector<float>& lrs, const std::vector<float>& weight_decays,
                            int64_t accumulate, bool amsgrad, uint64_t seed,
                            const std::string& comm_dtype) {
        // Every value as FusedModel.train_step or the optimizer's parameter groups checked it
        // (Python checks each hyperparameter once, where the user gives it); the names below
        // come from FusedModel.run_step, and a wrong one is a bug there.
        train::Sgd sgd;
        sgd.lr = lr;
        sgd.momentum = momentum;
        sgd.weight_decay = weight_decay;
        if (optimizer == "adam") sgd.kind = train::Sgd::Kind::Adam;
        else if (optimizer == "adamw") sgd.kind = train::Sgd::Kind::AdamW;
        else MGPU_ASSERT(optimizer == "sgd", "optimizer '", optimizer, "'");
        sgd.beta1 = betas.first;
        sgd.beta2 = betas.second;
        sgd.eps = eps;
        sgd.step = step;
        sgd.amsgrad = amsgrad;
        if (max_norm) {
          sgd.clip = true;
          sgd.max_norm = *max_norm;
        }
        // Sizes guard the step's indexing: asserted, not validated.
        const size_t n = r.model->num_params();
        MGPU_ASSERT(lrs.empty() || lrs.size() == n, lrs.size(), " lrs for ", n, " parameters");
        MGPU_ASSERT(weight_decays.empty() || weight_decays.size() == n, weight_decays.size(),
                    " weight_decays for ", n, " parameters");
        sgd.lrs = lrs;
        sgd.weight_decays = weight_decays;
        MGPU_ASSERT(comm_dtype == "float32" || comm_dtype == "bfloat16", "comm_dtype '",
                    comm_dtype, "'");
        sgd.comm_dtype = comm_dtype == "bfloat16" ? DType::BF16 : DType::F32;
        py::gil_scoped_release nogil;
        // The previous step's tasks have all run (and released their tensors) before this one
        // allocates: each step then needs the same blocks at once, which the CPU allocator keeps
        // after the first, so the steady state takes nothing from the system even when the
        // caller never waits. It costs the device the host's enqueueing of the step's first ops.
        for (const train::Replica& rep : r.replicas) queue_of(rep.device).drain();
        // The step joins each bucket's all-reduce as each device's backward reaches it: one
        // step at a time, so another host thread's collectives cannot interleave with its parts.
        std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
        return train::train_step(*r.model, X, y, r.replicas, sgd, shards, "train_step",
                                 accumulate, seed);
      }, py::arg("X"), py::arg("y"), py::arg("lr"), py::arg("momentum") = 0.0f,
         py::arg("weight_decay") = 0.0f, py::arg("shards") = 0, py::arg("optimizer") = "sgd",
         py::arg("betas") = std::pair<float, float>{0.9f, 0.999f}, py::arg("eps") = 1e-8f,
         py::arg("step") = 1, py::arg("max_norm") = std::nullopt,
         py::arg("lrs") = std::vector<float>{}, py::arg("weight_decays") = std::vector<float>{},
         py::arg("accumulate") = 1, py::arg("amsgrad") = false, py::arg("seed") = 0,
         py::arg("comm_dtype") = "float32",
         "One fused step: optimizer 'sgd' (lr, momentum, weight_decay), 'adam' or 'adamw' (lr, "
         "betas, eps, weight_decay at `step`, counted from 1; amsgrad: that variant); max_norm: "
         "clip the mean loss's gradient to that global norm first; lrs, weight_decays: per "
         "parameter; accumulate: micro-batches run one after another, their gradients summed "
         "before one update; seed: the step's dropout masks; comm_dtype 'bfloat16': gradients "
         "reduced in bfloat16.")
      .def("evaluate_batch", [](const Replicated& r, const Tensor& X, const Tensor& y) {
        py::gil_scoped_release nogil;
        return train::evaluate_step(*r.model, X, y, r.replicas);
      }, py::arg("X"), py::arg("y"))
      .def("forward", [](const Replicated& r, const Tensor& X, int64_t d) {
        const train::Replica& rep = replica(r, d);
        py::gil_scoped_release nogil;
        require_same_device("Model.forward", {&X, &rep.state.params[0]});
        return train::model_forward(*r.model, X, rep.state, false);
      }, py::arg("X"), py::arg("replica") = 0)
      .def("fused_layers", [](const Replicated& r) { return r.model->fused_counts(); },
           "(batch_norm+relu, batch_norm+add+relu) layers the fusion made; (0, 0) when "
           "MGPU_FUSE_LAYERS=0 was set as the Model was built, or for GPU replicas.")
      .def("fusions", [](const Replicated& r) { return r.model->fusions(); },
           "(layer, what runs) for each layer whose kernels the Model chose as it was built: "
           "conv2d_relu_pool layers ('conv2d_relu_pool', its one CPU kernel; in bf16 the kernel "
           "on rounded operands where float32's rule runs the conv; or 'conv2d, relu, "
           "avg_pool2d' on GPUs) and the batch norm layers merged with their relu "
           "('batch_norm_relu', 'batch_norm_add_relu'; CPU replicas only).")
      .def("conv_algorithms", [](const Replicated& r) {
        return r.model->conv_algorithms();
      }, "(layer, algorithm) for each conv layer: the CPU conv algorithm (MGPU_CONV_ALGO's "
         "names) fixed as the Model was built, prefixed 'bf16 ' for a layer built with precision "
         "bf16 (ops/bf16.h's kernels: winograd takes Winograd F(2x2, 3x3) with bfloat16 products "
         "for its 3x3 stride-1 shapes, the others the im2col products).")
      .def("params", [](const Replicated& r, int64_t d) { return replica(r, d).state.params; },
           py::arg("replica"))
      .def("buffers", [](const Replicated& r, int64_t d) { return replica(r, d).state.buffers; },
           py::arg("replica"))
      .def("momentum_buffers", [](const Replicated& r, int64_t d, int which) {
        const train::Replica& rep = replica(r, d);
        MGPU_CHECK_VALUE(which >= 0 && which <= 2, "Model.momentum_buffers: which must be 0 "
                         "(momentum, first moment), 1 (second moment) or 2 (amsgrad's maximum of "
                         "the second moment), got ", which);
        const Tensor& flat = state_of(rep, which);
        std::vector<std::optional<Tensor>> out;
        for (size_t i = 0; i < rep.state.params.size(); ++i) {
          if (!flat.defined()) {
            out.emplace_back();
            continue;
          }
          const Tensor& p = rep.state.params[i];
          const int64_t at = r.model->offset(i);
          out.emplace_back(flat.slice_rows(at, at + p.numel()).reshape(p.shape()));
        }
        return out;
      }, py::arg("replica"), py::arg("which") = 0,
         "One replica's optimizer state per parameter, views (None before the first step that "
         "makes it): which 0 SGD's momentum or Adam's first moment, 1 Adam's second moment, 2 "
         "amsgrad's maximum of the second moment.")
      .def("set_momentum_buffers", [](Replicated& r, int64_t d,
                                      const std::vector<std::optional<Tensor>>& bufs, int which) {
        const train::Replica& rep = replica(r, d);
        MGPU_CHECK_VALUE(which >= 0 && which <= 2, "Model.set_momentum_buffers: which must be 0 "
                         "(momentum, first moment), 1 (second moment) or 2 (amsgrad's maximum of "
                         "the second moment), got ", which);
        const std::vector<Tensor>& ps = rep.state.params;
        MGPU_CHECK_VALUE(bufs.size() == ps.size(), "Model.set_momentum_buffers: the model has ",
                         ps.size(), " parameters, got ", bufs.size(), " buffers");
        for (size_t i = 0; i < bufs.size(); ++i) {
          if (!bufs[i]) continue;
          const Tensor& b = *bufs[i];
          MGPU_CHECK_TYPE(b.dtype() == DType::F32, "Model.set_momentum_buffers: buffer ", i,
                          " must be float32, got ", describe(b));
          MGPU_CHECK_VALUE(b.shape() == ps[i].shape(), "Model.set_momentum_buffers: buffer ", i,
                           " has shape ", b.shape(), " but parameter ", i, " has shape ",
                           ps[i].shape());
        }
        py::gil_scoped_release nogil;
        train::Replica& mine = r.replicas[static_cast<size_t>(d)];
        Tensor& flat = state_of(mine, which);
        if (!flat.defined())
          flat = Tensor::empty({r.model->flat_size()}, DType::F32, mine.device);
        // None is a zero buffer: the next step then starts it as PyTorch does (buf = g).
        for (size_t i = 0; i < bufs.size(); ++i) {
          const int64_t at = r.model->offset(i);
          Tensor dst = flat.slice_rows(at, at + ps[i].numel()).reshape(ps[i].shape());
          if (!bufs[i]) ops::fill(dst, 0.0);
          else if (bufs[i]->raw() != dst.raw() || bufs[i]->device() != dst.device())
            ops::copy(dst, *bufs[i]);
        }
      }, py::arg("replica"), py::arg("buffers"), py::arg("which") = 0,
         "Sets one replica's optimizer state (copies; None: zero); which as momentum_buffers.")
      .def("grads", [](const Replicated& r, int64_t d) -> std::optional<Tensor> {
        const train::Replica& rep = replica(r, d);
        if (!rep.grads.defined()) return std::nullopt;
        return rep.grads;
      }, py::arg("replica"),
         "The replica's flat gradient buffer (buckets summed over the replicas), written by the "
         "steps without CUDA graphs; None before the first.")
      .def_property_readonly("num_replicas", [](const Replicated& r) { return r.replicas.size(); })
      .def_property_readonly("buckets", [](const Replicated& r) {
        std::vector<std::pair<int64_t, int64_t>> out;
        for (const train::Bucket& b : r.model->buckets()) out.emplace_back(b.begin, b.end);
        return out;
      });
}

}  // namespace mgpu::bind
