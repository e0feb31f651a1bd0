// cpp/bind/bind_data.cpp -- Fashion-MNIST files and the prefetching batch iterator.
#include <pybind11/numpy.h>

#include <memory>

#include "bind/bind.h"
#include "core/tensor.h"
#include "data/batch_iterator.h"
#include "data/idx_reader.h"

namespace py = pybind11;

namespace mgpu::bind {
namespace {

// A batch buffer becomes a tensor on cpu(0) without a copy; the tensor owns the buffer, so the
// iterator reuses it only after every tensor (and queued task) using it is gone.
template <typename T>
Tensor wrap_buffer(std::shared_ptr<std::vector<T>> buf, Shape shape) {
  void* data = buf->data();
  size_t nbytes = buf->size() * sizeof(T);
  auto storage = Storage::wrap(Device{DeviceKind::CPU, 0}, data, nbytes, [buf] {});
  return Tensor(storage, std::move(shape), dtype_of<T>(), 0);
}

py::array idx_to_numpy(const data::IdxArray& a) {
  py::array_t<uint8_t> out(std::vector<py::ssize_t>(a.dims.begin(), a.dims.end()));
  std::copy(a.data.begin(), a.data.end(), out.mutable_data());
  return out;
}

struct Split {
  std::shared_ptr<const data::IdxArray> images, labels;
};

}  // namespace

void bind_data(py::module_& m) {
  m.def("find_fashion_mnist", &data::find_fashion_mnist, py::arg("data_dir") = "",
        "The first directory holding the four Fashion-MNIST IDX files.");
  m.def("fashion_mnist_search_dirs", &data::fashion_mnist_search_dirs, py::arg("data_dir") = "",
        "The directories searched for Fashion-MNIST, in order.");
  m.def("read_idx", [](const std::string& path) {
    data::IdxArray a;
    {
      py::gil_scoped_release nogil;
      a = data::read_idx(path);
    }
    return idx_to_numpy(a);
  }, "Reads an IDX file (raw or gzip) as a uint8 NumPy array.");

  py::class_<Split>(m, "DataSplit", "Images and labels of one split, held in memory.")
      .def_property_readonly("num_examples", [](const Split& s) { return s.images->dims.at(0); })
      .def("images_numpy", [](const Split& s) { return idx_to_numpy(*s.images); })
      .def("labels_numpy", [](const Split& s) { return idx_to_numpy(*s.labels); });

  m.def("load_fashion_mnist", [](const std::string& dir) {
    data::FashionMnist d;
    {
      py::gil_scoped_release nogil;
      d = data::load_fashion_mnist(dir);
    }
    auto share = [](data::IdxArray& a) { return std::make_shared<const data::IdxArray>(std::move(a)); };
    return py::make_tuple(Split{share(d.train_images), share(d.train_labels)},
                          Split{share(d.test_images), share(d.test_labels)});
  }, "Reads the four Fashion-MNIST files of a directory: (train, test).");
  m.def("make_split", [](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> images,
                         py::array_t<uint8_t, py::array::c_style | py::array::forcecast> labels) {
    auto to_idx = [](const py::array& a) {
      auto idx = std::make_shared<data::IdxArray>();
      idx->dims.assign(a.shape(), a.shape() + a.ndim());
      const auto* p = static_cast<const uint8_t*>(a.data());
      idx->data.assign(p, p + a.size());
      return std::shared_ptr<const data::IdxArray>(idx);
    };
    return Split{to_idx(images), to_idx(labels)};
  }, "A split from uint8 arrays: images (N, H, W), labels (N,).");

  py::class_<data::BatchIterator>(m, "BatchIterator", "Shuffled minibatches, prefetched.")
      .def(py::init([](const Split& s, int64_t batch_size, bool shuffle, uint64_t seed,
                       bool drop_last, int64_t limit_batches) {
             return std::make_unique<data::BatchIterator>(s.images, s.labels, batch_size, shuffle,
                                                          seed, drop_last, limit_batches);
           }), py::arg("split"), py::arg("batch_size"), py::arg("shuffle"), py::arg("seed"),
           py::arg("drop_last") = false, py::arg("limit_batches") = 0)
      .def("start_epoch", [](data::BatchIterator& it) { it.start_epoch(); },
           "Starts the next epoch.")
      .def("start_epoch_at", [](data::BatchIterator& it, int64_t epoch, int64_t first_batch) {
             it.start_epoch(epoch, first_batch);
           }, py::arg("epoch"), py::arg("first_batch"),
           "Starts epoch `epoch` at batch `first_batch` (resuming a run).")
      .def("next", [](data::BatchIterator& it) -> py::object {
        data::Batch b;
        bool more;
        {
          py::gil_scoped_release nogil;
          more = it.next(b);
        }
        if (!more) return py::none();
        return py::make_tuple(wrap_buffer(b.images, b.image_shape()),
                              wrap_buffer(b.labels, Shape{b.size}));
      }, "(X, y) tensors on cpu(0), or None at the end of the epoch.")
      .def_property_readonly("num_batches", &data::BatchIterator::num_batches)
      .def_property_readonly("num_examples", &data::BatchIterator::num_examples)
      .def_property_readonly("examples_per_epoch", &data::BatchIterator::examples_per_epoch)
      .def_property_readonly("batch_size", &data::BatchIterator::batch_size)
      .def_property_readonly("shuffle", &data::BatchIterator::shuffle)
      .def_property_readonly("seed", &data::BatchIterator::seed)
      .def_property_readonly("epoch", &data::BatchIterator::epoch,
                             "The current epoch, -1 before the first one starts.");
}

}  // namespace mgpu::bind
