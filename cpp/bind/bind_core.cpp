// cpp/bind/bind_core.cpp -- devices, tensors (NumPy and DLPack in and out), queues, build info.
#include <pybind11/numpy.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "bind/bind.h"
#include "bind/dlpack.h"
#include "comm/allreduce_gpu.h"
#include "comm/allreduce_mpi.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "core/queue.h"
#include "core/tensor.h"
#include "core/trace.h"
#include "ops/cpu_isa.h"
#include "ops/precision.h"
#include "ops/gemm.h"
#include "ops/elementwise.h"
#include "ops/fma_peak.h"
#if MGPU_BUILT_CUDNN && !MGPU_CUDA_EMULATION_BUILD
#include "ops/conv2d.h"
#endif
#if defined(MGPU_CUDA_EMULATION)
#define MGPU_CUDA_ERROR_TYPE ::mgpu::DeviceError
#include "cuda/runtime.cuh"
#endif

namespace py = pybind11;

namespace mgpu::bind {
namespace {

#if defined(MGPU_CUDA_EMULATION)
// The host buffers the test producers' queued copies read, by producer stream (tests only).
std::map<uintptr_t, void*>& emu_staged() {
  static auto* m = new std::map<uintptr_t, void*>;
  return *m;
}
// Makes gpu(i) this thread's current device for a scope (tests only).
class EmuDevice {
 public:
  explicit EmuDevice(int device) {
    MGPU_CUDA_CHECK(cudaGetDevice(&previous_));
    MGPU_CUDA_CHECK(cudaSetDevice(device));
  }
  ~EmuDevice() { cudaSetDevice(previous_); }
  EmuDevice(const EmuDevice&) = delete;
  EmuDevice& operator=(const EmuDevice&) = delete;

 private:
  int previous_ = 0;
};
#endif

DType dtype_from_numpy(const py::dtype& dt) {
  if (dt.is(py::dtype::of<float>())) return DType::F32;
  if (dt.is(py::dtype::of<int32_t>())) return DType::I32;
  if (dt.is(py::dtype::of<int64_t>())) return DType::I64;
  if (dt.is(py::dtype::of<uint8_t>())) return DType::U8;
  throw TypeError("unsupported dtype " + std::string(py::str(dt)) +
                  "; mgpu tensors hold float32, bfloat16, int32, int64 or uint8");
}

// NumPy has no bfloat16: a bfloat16 tensor crosses as uint16, its raw bits (tensor.py gives
// them ml_dtypes' dtype, or float32 values).
py::dtype numpy_dtype(DType t) {
  switch (t) {
    case DType::F32: return py::dtype::of<float>();
    case DType::I32: return py::dtype::of<int32_t>();
    case DType::I64: return py::dtype::of<int64_t>();
    case DType::U8: return py::dtype::of<uint8_t>();
    case DType::BF16: return py::dtype::of<uint16_t>();
  }
  throw InternalError("unknown dtype");
}

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::F32, DType::I32, DType::I64, DType::U8, DType::BF16})
    if (name == dtype_name(t)) return t;
  throw TypeError("unknown dtype '" + name + "'; use float32, bfloat16, int32, int64 or uint8");
}

// Waits (without the GIL) until the tensor's device has finished all queued work, then raises
// the failure of the op that produced it, however often it is read (a sticky failure).
void wait_ready(const Tensor& t) {
  {
    py::gil_scoped_release nogil;
    queue_of(t.device()).synchronize();
  }
  if (std::exception_ptr e = t.storage()->error()) std::rethrow_exception(e);
}

// bits: arr is uint16, the raw bits of a bfloat16 tensor.
Tensor from_numpy(const py::array& arr, Device device, bool bits) {
  MGPU_CHECK_VALUE(arr.flags() & py::array::c_style, "from_numpy: the array must be C-contiguous");
  MGPU_CHECK_TYPE(!bits || arr.dtype().is(py::dtype::of<uint16_t>()),
                  "from_numpy: the bits of a bfloat16 tensor must be a uint16 array, got ",
                  std::string(py::str(arr.dtype())));
  check_device(device);
  Shape shape(arr.shape(), arr.shape() + arr.ndim());
  Tensor t = Tensor::empty(shape, bits ? DType::BF16 : dtype_from_numpy(arr.dtype()), device,
                           "array");
  t.storage()->mark_written();  // filled below, before anyone else sees it
  // Fresh storage is touched by no queued task yet, so the host may fill it directly. A GPU's
  // copy goes through its queue instead (after the work already queued there, which may still
  // use the recycled block, or be capturing a graph), and the host waits for it.
  if (!t.nbytes()) return t;
  if (device.is_cpu()) {
    std::memcpy(t.raw(), arr.data(), t.nbytes());
  } else {
    py::gil_scoped_release nogil;
    Queue& q = queue_of(device);
    uint64_t seq = q.enqueue("array", [dst = t.raw(), src = arr.data(), n = t.nbytes(),
                                       index = device.index] {
      gpu::copy_from_host(index, dst, src, n);
    });
    q.wait_done_or_rethrow(seq);
  }
  return t;
}

py::array to_numpy(const Tensor& t) {
  wait_ready(t);
  py::array out(numpy_dtype(t.dtype()), std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  if (!t.nbytes()) return out;
  if (t.device().is_cpu()) {
    std::memcpy(out.mutable_data(), t.raw(), t.nbytes());
  } else {
    void* dst = out.mutable_data();
    py::gil_scoped_release nogil;
    gpu::read_to_host(t.device().index, dst, t.raw(), t.nbytes());  // waited for above
  }
  return out;
}

// --- DLPack -----------------------------------------------------------------------------------

// Memory another library may write without mgpu's version counter moving: exported through
// DLPack (the consumer holds a writable view) or imported from another library (its owner keeps
// one). Kept by the storage's control block (owner_less), so an entry never matches a later
// storage at a freed one's address; expired entries go as new ones come.
using StorageSet = std::set<std::weak_ptr<Storage>, std::owner_less<std::weak_ptr<Storage>>>;
std::mutex exposed_mutex;
StorageSet& exposed_storages() {
  static auto* s = new StorageSet;
  return *s;
}

void mark_exposed(const std::shared_ptr<Storage>& storage) {
  std::lock_guard<std::mutex> lock(exposed_mutex);
  StorageSet& set = exposed_storages();
  for (auto it = set.begin(); it != set.end();) it = it->expired() ? set.erase(it) : std::next(it);
  set.insert(storage);
}

bool is_exposed(const Tensor& t) {
  if (!t.defined()) return false;
  std::lock_guard<std::mutex> lock(exposed_mutex);
  return exposed_storages().count(t.storage()) > 0;
}

Tensor imported(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype) {
  mark_exposed(storage);
  return Tensor(std::move(storage), shape, dtype, 0);
}

struct Exported {
  dlpack::ManagedTensor managed;
  Tensor tensor;  // keeps the storage alive until the consumer calls the deleter
  std::vector<int64_t> shape;
};

void delete_exported(dlpack::ManagedTensor* self) { delete static_cast<Exported*>(self->manager_ctx); }

dlpack::DataType dl_dtype(DType t) {
  switch (t) {
    case DType::F32: return {dlpack::kFloat, 32, 1};
    case DType::I32: return {dlpack::kInt, 32, 1};
    case DType::I64: return {dlpack::kInt, 64, 1};
    case DType::U8: return {dlpack::kUInt, 8, 1};
    case DType::BF16: return {dlpack::kBfloat, 16, 1};
  }
  throw InternalError("unknown dtype");
}

// The name users know a DLPack element type by (float64, bfloat16, bool, ...), so a refused
// import says which type it was; codes DLPack adds later are shown as numbers.
std::string dl_dtype_name(const dlpack::DataType& d) {
  const std::string bits = std::to_string(d.bits);
  std::string name;
  switch (d.code) {
    case 0: name = "int" + bits; break;
    case 1: name = "uint" + bits; break;
    case 2: name = "float" + bits; break;
    case 4: name = "bfloat" + bits; break;
    case 5: name = "complex" + bits; break;
    case 6: name = d.bits == 8 ? "bool" : "bool" + bits; break;
    default: name = "(DLPack type code " + std::to_string(d.code) + ", " + bits + " bits)";
  }
  if (d.lanes != 1) name += " x " + std::to_string(d.lanes) + " lanes";
  return name;
}

py::capsule to_dlpack(const Tensor& t) {
  // The consumer reads the memory right away and knows nothing of our queues.
  wait_ready(t);
  mark_exposed(t.storage());
  auto* e = new Exported{{}, t, t.shape()};
  dlpack::Device where = t.device().is_cpu() ? dlpack::Device{dlpack::kCPU, 0}
                                              : dlpack::Device{dlpack::kCUDA, t.device().index};
  e->managed.dl_tensor = {t.raw(), where, static_cast<int32_t>(t.dim()),
                          dl_dtype(t.dtype()), e->shape.data(), nullptr, 0};
  e->managed.manager_ctx = e;
  e->managed.deleter = &delete_exported;
  // If no consumer ever takes the capsule, its destructor frees the export.
  return py::capsule(&e->managed, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      m->deleter(m);
    }
  });
}

Tensor from_dlpack_capsule(py::capsule cap) {
  MGPU_CHECK_TYPE(PyCapsule_IsValid(cap.ptr(), "dltensor"), "from_dlpack: expected an unused "
                  "'dltensor' capsule (a capsule can be consumed only once)");
  auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  if (m->deleter == &delete_exported) {
    // One of our own tensors: DLPack names only "the CPU", so the capsule cannot say cpu(1);
    // the tensor itself keeps its device, its queue's order and its version counter.
    Tensor t = static_cast<Exported*>(m->manager_ctx)->tensor;
    PyCapsule_SetName(cap.ptr(), "used_dltensor");
    m->deleter(m);
    return t;
  }
  const dlpack::Tensor& dl = m->dl_tensor;
  const bool on_gpu = dl.device.device_type == dlpack::kCUDA;
  MGPU_CHECK_VALUE(dl.device.device_type == dlpack::kCPU ||
                   (on_gpu && dl.device.device_id >= 0 && dl.device.device_id < num_gpus()),
                   "from_dlpack: cannot import memory of DLPack device (type ",
                   dl.device.device_type, ", id ", dl.device.device_id, "): mgpu imports CPU "
                   "memory and CUDA memory of its own GPUs (mgpu.num_gpus() == ", num_gpus(), ")");
  const Device device = on_gpu ? Device{DeviceKind::CUDA, dl.device.device_id}
                               : Device{DeviceKind::CPU, 0};
  DType dtype;
  if (dl.dtype.code == dlpack::kFloat && dl.dtype.bits == 32) dtype = DType::F32;
  else if (dl.dtype.code == dlpack::kInt && dl.dtype.bits == 32) dtype = DType::I32;
  else if (dl.dtype.code == dlpack::kInt && dl.dtype.bits == 64) dtype = DType::I64;
  else if (dl.dtype.code == dlpack::kUInt && dl.dtype.bits == 8) dtype = DType::U8;
  else if (dl.dtype.code == dlpack::kBfloat && dl.dtype.bits == 16) dtype = DType::BF16;
  else
    throw TypeError("from_dlpack: unsupported element type " + dl_dtype_name(dl.dtype) +
                    "; mgpu holds float32, bfloat16, int32, int64 or uint8 (convert first, "
                    "e.g. .float() in PyTorch or .astype('float32') in NumPy and JAX)");
  MGPU_CHECK_VALUE(dl.dtype.lanes == 1, "from_dlpack: vector element types are not supported");
  MGPU_CHECK_VALUE(dl.ndim >= 0 && (dl.ndim == 0 || dl.shape), "from_dlpack: malformed tensor "
                   "(", dl.ndim, " dims)");
  Shape shape(dl.shape, dl.shape + dl.ndim);
  if (dl.strides) {
    int64_t expect = 1;
    for (int32_t i = dl.ndim - 1; i >= 0; --i) {
      MGPU_CHECK_VALUE(shape[i] == 1 || dl.strides[i] == expect, "from_dlpack: the tensor is not "
                       "contiguous; make it contiguous first (e.g. .contiguous() or np.ascontiguousarray)");
      expect *= shape[i];
    }
  }
  PyCapsule_SetName(cap.ptr(), "used_dltensor");
  size_t nbytes = static_cast<size_t>(
      checked_nbytes(shape, static_cast<int64_t>(dtype_size(dtype)), "from_dlpack"));
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  // The producer's deleter may touch Python objects (NumPy's does), and the last reference can
  // be dropped on a device thread, so it runs with the GIL -- unless Python is already gone.
  auto give_back = [m] {
    if (!m->deleter) return;
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    m->deleter(m);
  };
  if (!on_gpu) return imported(Storage::wrap(device, data, nbytes, give_back), shape, dtype);
#if MGPU_GPU_BUILD
  // Stream order in: the producer was asked (tensor.py) to order its pending work before the
  // device's DLPack stream; the compute stream waits for that point before mgpu's first use.
  const int index = device.index;
  std::shared_ptr<gpu::ImportFence> fence = gpu::import_fence(index);
  queue_of(device).enqueue("from_dlpack (waits for the producer's stream)",
                           [index, fence] { gpu::wait_import_fence(index, *fence); });
  // Stream order out: the last handle can go while mgpu's kernels on the memory are still
  // queued or running; the producer may reuse it as soon as its deleter runs (a caching
  // allocator does). So the deleter runs on the device's worker after everything queued before,
  // once the compute stream has finished it.
  auto release = [device, give_back] {
    Queue& q = queue_of(device);
    auto after_device = [device, give_back] {
      try {
        gpu::synchronize(device.index);
      } catch (...) {  // a failed kernel: the queue reports it; the memory is still given back
      }
      give_back();
    };
    if (q.on_worker_thread()) after_device();
    else if (Py_IsInitialized() && PyGILState_Check()) {
      // enqueue may wait for room while the worker runs a task that needs the GIL.
      py::gil_scoped_release nogil;
      q.enqueue("from_dlpack (gives the memory back)", after_device);
    } else {
      q.enqueue("from_dlpack (gives the memory back)", after_device);
    }
  };
  return imported(Storage::wrap(device, data, nbytes, release), shape, dtype);
#else
  return imported(Storage::wrap(device, data, nbytes, give_back), shape, dtype);
#endif
}

py::dict build_info() {
  py::dict info;
  info["version"] = MGPU_VERSION;
  info["cpu_devices"] = true;
  info["cpu_threads"] = num_threads();
  info["blas"] = ops::cpu::blas_info();
  const ops::cpu::IsaChoice& isa = ops::cpu::isa_choice();
  info["cpu_model"] = ops::cpu::cpu_model();
  info["cpu_isa"] = isa.name;
  info["cpu_isa_reason"] = isa.reason;
  info["cpu_bf16"] = ops::bf16_kernel();  // the bf16 products' kernel (ops/precision.h)
  info["cpu_isas_built"] = std::vector<std::string>{"avx2 (x86-64-v3)", "avx512 (x86-64-v4)"};
  info["cpu_baseline"] = MGPU_BASELINE_ARCH_NAME;
  // A part that is not built says whether it was switched off or not found, and how to get it.
  const std::string off = "not built: switched off at build time (";
  const std::string reinstall = "; to build it, reinstall with `pip install . -C cmake.define.";
  info["cuda"] =
      MGPU_CUDA_EMULATION_BUILD ? "emulated (cpp/cuda/emu: GPUs run on the CPU, for tests)"
      : MGPU_BUILT_CUDA         ? "built (" + gpu::runtime_name() + ")"
      : MGPU_CUDA_SWITCHED_OFF  ? off + "MGPU_WITH_CUDA=OFF)" + reinstall +
                                     "MGPU_WITH_CUDA=ON` where the CUDA toolkit (nvcc) is installed"
                                : std::string("not built: nvcc was not found at build time; "
                                              "install the CUDA toolkit (nvcc on PATH or in "
                                              "/usr/local/cuda) and reinstall mgpu");
  info["gpus"] = num_gpus();
  info["gpu_query_error"] = gpu::device_query_error();
  const char* no_cuda = "not built (it needs the CUDA backend, which is not built)";
  info["cudnn"] =
      MGPU_BUILT_CUDNN            ? std::string("built")
      : MGPU_CUDA_EMULATION_BUILD ? std::string("not in the emulated build (our conv kernels run)")
      : !MGPU_BUILT_CUDA          ? std::string(no_cuda)
      : MGPU_CUDNN_SWITCHED_OFF   ? off + "MGPU_WITH_CUDNN=OFF); our conv kernels run"
                                  : std::string("not built: cudnn.h or libcudnn was not found at "
                                                "build time; our conv kernels run");
  info["nccl"] =
      MGPU_BUILT_NCCL             ? std::string("built")
      : MGPU_CUDA_EMULATION_BUILD ? std::string("emulated (cpp/cuda/emu/nccl_emu; "
                                                "MGPU_ALLREDUCE=peer runs our peer-copy all-reduce)")
      : !MGPU_BUILT_CUDA          ? std::string(no_cuda)
      : MGPU_NCCL_SWITCHED_OFF    ? off + "MGPU_WITH_NCCL=OFF); our peer-copy all-reduce runs"
                                  : std::string("not built: nccl.h or libnccl was not found at "
                                                "build time; our peer-copy all-reduce runs");
  info["gpu_gemm"] = !MGPU_GPU_BUILD ? std::string("none")
                     : MGPU_CUDA_EMULATION_BUILD ? std::string("native (our tiled kernel)")
                                                 : "cublas by default; MGPU_GEMM=native|cublas";
  info["gpu_conv"] = !MGPU_GPU_BUILD ? std::string("none")
                     : "native (our kernels) by default" +
                           std::string(MGPU_BUILT_CUDNN && !MGPU_CUDA_EMULATION_BUILD
                                           ? "; MGPU_CONV=cudnn selects cuDNN"
                                           : "");
  info["mpi"] = MGPU_BUILT_MPI ? std::string("built")
                : MGPU_MPI_SWITCHED_OFF
                    ? off + "MGPU_WITH_MPI=OFF); multi-process training needs it" + reinstall +
                          "MGPU_WITH_MPI=ON` after `apt-get install openmpi-bin libopenmpi-dev`"
                    : std::string("not built: no MPI was found at build time; for multi-process "
                                  "training `apt-get install openmpi-bin libopenmpi-dev` and "
                                  "reinstall mgpu");
  info["dist_gpu_transport"] = comm::dist::gpu_transport_info();
  info["cuda_emulation"] = static_cast<bool>(MGPU_CUDA_EMULATION_BUILD);
  return info;
}

}  // namespace

void bind_core(py::module_& m) {
  py::enum_<DeviceKind>(m, "DeviceKind").value("CPU", DeviceKind::CPU).value("CUDA", DeviceKind::CUDA);

  py::class_<Device>(m, "Device", "A device: cpu(i) (virtual) or gpu(i).")
      .def(py::init([](DeviceKind kind, int index) {
             Device d{kind, index};
             check_device(d);
             return d;
           }), py::arg("kind"), py::arg("index") = 0)
      .def_readonly("kind", &Device::kind)
      .def_readonly("index", &Device::index)
      .def("__repr__", &Device::str)
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__eq__", [](const Device&, const py::object&) { return false; })
      .def("__hash__", [](const Device& d) { return std::hash<Device>()(d); })
      .def(py::pickle([](const Device& d) { return py::make_tuple(d.kind, d.index); },
                      [](py::tuple t) { return Device{t[0].cast<DeviceKind>(), t[1].cast<int>()}; }));

  py::class_<Tensor>(m, "Tensor", "A contiguous tensor on a device (engine handle).")
      .def_property_readonly("shape", [](const Tensor& t) {
        py::tuple s(t.dim());
        for (int64_t i = 0; i < t.dim(); ++i) s[i] = t.shape()[i];
        return s;
      })
      .def_property_readonly("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("reshape", &Tensor::reshape, "A view with a new shape (one extent may be -1).")
      .def("slice_rows", &Tensor::slice_rows, "Rows [begin, end) along axis 0, as a view.")
      .def("same_memory", [](const Tensor& a, const Tensor& b) {
        return a.storage() == b.storage() && a.offset() == b.offset() && a.nbytes() == b.nbytes();
      }, "True when both handles view exactly the same bytes.")
      .def("shares_memory", &Tensor::shares_memory, "True when the two tensors' bytes overlap.")
      .def_property_readonly("version", [](const Tensor& t) { return t.storage()->version(); },
                             "In-place changes to this memory so far (autograd's version counter).")
      .def("bump_version", [](const Tensor& t) { t.storage()->bump_version(); },
           "Records an in-place change (autograd's version counter).")
      .def_property_readonly("exposed", &is_exposed,
                             "True when another library may write this memory unseen by the "
                             "version counter (exported or imported through DLPack).")
      .def("numpy", &to_numpy, "A NumPy copy (waits for the device).")
      .def("to_dlpack", &to_dlpack, "A DLPack capsule sharing the memory (waits for the device).")
      .def_static("from_numpy", &from_numpy, py::arg("array"), py::arg("device"),
                  py::arg("bits") = false,
                  "Copies a C-contiguous float32/int32/int64/uint8 array onto a device (bits: a "
                  "uint16 array of bfloat16 bits).")
      .def_static("from_dlpack", &from_dlpack_capsule, "Wraps a DLPack capsule without copying.")
      .def_static("empty", [](std::vector<int64_t> shape, const std::string& dtype, Device d,
                              const std::string& op) {
        return Tensor::empty(shape, dtype_from_name(dtype), d, op.c_str());
      }, py::arg("shape"), py::arg("dtype"), py::arg("device"), py::arg("op") = "empty",
      "Uninitialised memory of a shape, dtype name and device (`op` names the caller in errors).");

  m.def("_dlpack_stream", [](int gpu_index) -> uintptr_t {
    check_device(Device{DeviceKind::CUDA, gpu_index});
#if MGPU_GPU_BUILD
    return reinterpret_cast<uintptr_t>(gpu::import_stream(gpu_index));
#else
    return 0;
#endif
  }, "The stream a DLPack producer on gpu(i) orders its pending work before (__dlpack__'s stream).");
#if MGPU_BUILT_CUDNN && !MGPU_CUDA_EMULATION_BUILD
  // cuDNN refuses a tensor descriptor with a zero dimension, so the conv's
  // cuDNN path must return for an empty batch (or filter bank) before it builds any. Descriptors
  // are host-only cuDNN calls, so this runs on a machine without a GPU: with no handle (nullptr),
  // an empty shape returns at the guard (0 bytes); a non-empty one builds its descriptors and
  // then fails at the first call that needs the handle.
  m.def("_cudnn_conv_without_handle", [](int64_t n, int64_t k) -> size_t {
    const ops::Conv2dShape s{n, 3, 8, 8, k, 3, 3, 1, 1};
    const size_t bytes = ops::cuda::conv2d_cudnn_workspace_bytes(nullptr, s);
    ops::cuda::conv2d_cudnn_forward(nullptr, s, nullptr, nullptr, nullptr, nullptr, nullptr, 0);
    return bytes;
  }, "cuDNN's workspace size and forward conv of a 3x8x8 image batch of n, k 3x3 filters, with "
     "no cuDNN handle (tests only).");
#endif
  m.def("_emu_live_counts", []() -> py::object {
#if defined(MGPU_CUDA_EMULATION)
    const emu::LiveCounts c = emu::live_counts();
    py::dict out;
    out["streams"] = c.streams;
    out["events"] = c.events;
    out["graphs"] = c.graphs;
    out["graph_execs"] = c.graph_execs;
    out["device_allocations"] = c.device_allocations;
    out["device_bytes"] = c.device_bytes;
    out["host_allocations"] = c.host_allocations;
    out["host_bytes"] = c.host_bytes;
    return std::move(out);
#else
    return py::none();
#endif
  }, "The emulated CUDA runtime's live streams, events, graphs and allocations (None in a build "
     "without the emulator), for leak checks.");
  m.def("_nccl_stats", []() -> py::dict {
    py::dict out;
#if MGPU_GPU_BUILD
    const comm::NcclStats s = comm::nccl_stats();
    out["live_sets"] = s.live_sets;
    out["cached_sets"] = s.cached_sets;
    out["refused_launches"] = s.refused_launches;
#else
    out["live_sets"] = 0;
    out["cached_sets"] = 0;
    out["refused_launches"] = 0;
#endif
    return out;
  }, "The in-process NCCL communicator sets: live, cached, and launches NCCL refused (tests).");
  m.def("_nccl_pause_launches", [](double seconds) {
#if MGPU_GPU_BUILD
    comm::set_nccl_launch_pause(seconds);
#else
    (void)seconds;
#endif
  }, py::arg("seconds"), "Tests only: every in-process NCCL launch first sleeps this long.");
  m.def("_gpu_host_waits", [] { return gpu::host_waits(); },
        "How many times a host thread has waited for GPU work to finish (tests, measurements).");
#if defined(MGPU_CUDA_EMULATION)
  // Tests only: a foreign DLPack producer on an emulated GPU (as PyTorch or CuPy would be), whose
  // own stream still holds the work that writes the tensor when mgpu imports it.
  m.def("_emu_producer_write", [](int gpu_index, uintptr_t dst,
                                  py::array_t<float, py::array::c_style | py::array::forcecast>
                                      values, int steps) -> uintptr_t {
    check_device(Device{DeviceKind::CUDA, gpu_index});
    MGPU_CHECK_VALUE(steps >= 1, "steps must be at least 1");
    EmuDevice guard(gpu_index);
    cudaStream_t s = nullptr;
    MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t nbytes = static_cast<size_t>(values.size()) * sizeof(float);
    void* staged = nullptr;  // freed by _emu_producer_finish (a free now would wait for s)
    MGPU_CUDA_CHECK(cudaMallocHost(&staged, nbytes));
    std::memcpy(staged, values.data(), nbytes);
    auto* out = reinterpret_cast<void*>(dst);
    for (int i = 1; i < steps; ++i)  // NaN until the last step writes the values
      MGPU_CUDA_CHECK(cudaMemsetAsync(out, 0xff, nbytes, s));
    MGPU_CUDA_CHECK(cudaMemcpyAsync(out, staged, nbytes, cudaMemcpyHostToDevice, s));
    emu_staged()[reinterpret_cast<uintptr_t>(s)] = staged;
    return reinterpret_cast<uintptr_t>(s);
  }, py::arg("gpu_index"), py::arg("dst"), py::arg("values"), py::arg("steps"),
  "Queues `steps` writes of `values` to device memory `dst` on a new stream of gpu(i) (the last "
  "one writes them, the others NaN); returns the stream (tests only).");
  m.def("_emu_producer_order_before", [](int gpu_index, uintptr_t producer, uintptr_t consumer) {
    check_device(Device{DeviceKind::CUDA, gpu_index});
    EmuDevice guard(gpu_index);
    cudaEvent_t e = nullptr;
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(producer)));
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(consumer), e, 0));
    MGPU_CUDA_CHECK(cudaEventDestroy(e));
  }, "What a DLPack producer does with the consumer's `stream`: its work so far comes before "
     "that stream's next work (tests only).");
  m.def("_emu_producer_finish", [](int gpu_index, uintptr_t producer) {
    check_device(Device{DeviceKind::CUDA, gpu_index});
    py::gil_scoped_release nogil;
    EmuDevice guard(gpu_index);
    auto s = reinterpret_cast<cudaStream_t>(producer);
    MGPU_CUDA_CHECK(cudaStreamSynchronize(s));
    MGPU_CUDA_CHECK(cudaStreamDestroy(s));
    auto it = emu_staged().find(producer);
    if (it != emu_staged().end()) {
      MGPU_CUDA_CHECK(cudaFreeHost(it->second));
      emu_staged().erase(it);
    }
  }, "Waits for a producer stream of _emu_producer_write and frees it (tests only).");
#endif
  m.def("synchronize", [](Device d) {
    check_device(d);
    py::gil_scoped_release nogil;
    queue_of(d).synchronize();
  }, "Waits for one device's queued work and raises its first error.");
  m.def("waitall", [] {
    py::gil_scoped_release nogil;
    waitall();
  }, "Waits for every device's queued work and raises the first error.");
  // The timeline (python/mgpu/trace.py drives it).
  m.def("trace_start", &trace::start, "Starts recording the timeline (ValueError if it is on).");
  m.def("trace_stop", [](int pid, const std::string& process_name) {
    py::gil_scoped_release nogil;
    return trace::stop(pid, process_name);
  }, py::arg("pid"), py::arg("process_name"),
  "Stops recording; returns the events as the comma-separated body of a JSON array.");
  m.def("trace_running", &trace::running, "Whether the timeline is being recorded.");
  m.def("trace_record", [](const std::string& name, int64_t t0, int64_t t1) {
    if (trace::on()) trace::record(trace::thread_track(), nullptr, trace::intern(name), t0, t1);
  }, py::arg("name"), py::arg("t0_ns"), py::arg("t1_ns"),
  "Records a span of the calling thread (times from time.monotonic_ns()).");
  m.def("queue_memory", [](Device d, bool reset) {
    check_device(d);
    Queue& q = queue_of(d);
    py::dict out;
    out["pending_bytes"] = q.pending_bytes();
    out["peak_pending_bytes"] = q.peak_pending_bytes(reset);
    out["budget"] = max_pending_bytes();
    return out;
  }, py::arg("device"), py::arg("reset") = false,
  "Bytes held by a device queue's waiting tasks, their peak (reset=True restarts it), and the "
  "budget ($MGPU_QUEUE_MAX_BYTES) past which ops wait before enqueueing.");
  m.def("num_gpus", &num_gpus, "Number of usable GPUs (0 without a CUDA build or GPU).");
  m.def("num_threads", &num_threads, "Threads mgpu uses for CPU compute.");
  m.def("set_num_threads", &set_num_threads, "Sets the threads mgpu uses for CPU compute.");
  m.def("cpu_cached_bytes", &cpu_cached_bytes, "Bytes held by the CPU caching allocator.");
  m.def("cpu_memory_stats", [] {
    CpuMemoryStats s = cpu_memory_stats();
    py::dict out;
    out["allocated"] = s.allocated;
    out["cached"] = s.cached;
    out["peak_allocated"] = s.peak_allocated;
    out["system_mallocs"] = s.system_mallocs;
    out["system_bytes"] = s.system_bytes;
    return out;
  }, "The CPU caching allocator: allocated, cached, peak_allocated, system_mallocs, "
     "system_bytes.");
  m.def("cpu_trace_begin", &cpu_trace_begin,
        "Starts recording per size class the CPU blocks a step needs (storage.h).");
  m.def("cpu_trace_end", &cpu_trace_end, "Stops recording; returns {size class: blocks} (large "
        "classes: the most live at once; small ones: every request).");
  m.def("cpu_reserve", [](const std::map<size_t, size_t>& blocks) {
    py::gil_scoped_release nogil;
    cpu_reserve(blocks);
  }, "Fills the CPU allocator's free lists until each large size class holds {size class: "
     "blocks} blocks, live or free, and each small one that many free.");
  m.def("cpu_reset_peak_memory", &cpu_reset_peak_memory,
        "Sets the CPU allocator's peak_allocated to what is allocated now.");
  m.def("gpu_memory_stats", [](Device d) {
    MGPU_CHECK_VALUE(!d.is_cpu(), "gpu_memory_stats: ", d, " is not a GPU");
    check_device(d);
    gpu::MemoryStats s = gpu::memory_stats(d.index);
    py::dict out;
    out["allocated"] = s.allocated;
    out["cached"] = s.cached;
    out["peak_allocated"] = s.peak_allocated;
    out["device_mallocs"] = s.device_mallocs;
    return out;
  }, "Bytes of a GPU's caching allocator: allocated, cached, peak_allocated, device_mallocs.");
  m.def("empty_cache", [] {
    py::gil_scoped_release nogil;
    waitall();
    cpu_empty_cache();
#if MGPU_GPU_BUILD
    comm::empty_communicators();
#endif
    for (int i = 0; i < num_gpus(); ++i) gpu::empty_cache(i);
  }, "Waits for all devices, then returns cached CPU and GPU memory (and idle NCCL "
     "communicators) to the system.");
  m.def("build_info", &build_info, "What this build of mgpu contains.");
  m.def("conv_autotune_report", &ops::cpu::conv_autotune_report,
        "What MGPU_CONV_ALGO=auto measured in this process: one line per conv shape and "
        "direction (pick, direct and Winograd times).");
  m.def("fma_loop", [](const std::string& isa, int64_t iters, float a, float b) {
    ops::FmaLoopResult r = ops::fma_loop(isa, iters, a, b);
    return py::make_tuple(r.lane_sum, r.flops);
  }, py::arg("isa"), py::arg("iters"), py::arg("a") = 1.0f, py::arg("b") = 1.0f,
        "One run of the FMA-peak loop on this thread: (sum of every accumulator lane, FLOPs "
        "done). Every lane starts at 0 and takes iters FMAs acc = acc * a + b.");
  m.def("fma_peak", [](const std::string& isa, int threads, double seconds, int repeat) {
    ops::FmaPeak r;
    {
      py::gil_scoped_release nogil;
      r = ops::fma_peak(isa, threads, seconds, repeat);
    }
    py::dict d;
    d["isa"] = r.isa;
    d["threads"] = r.threads;
    d["iters"] = r.iters;
    d["flops"] = r.flops;
    d["seconds"] = r.seconds;
    d["gflops"] = r.gflops;
    return d;
  }, py::arg("isa") = "auto", py::arg("threads") = 1, py::arg("seconds") = 0.1,
        py::arg("repeat") = 3,
        "The measured single-precision FMA peak of path isa ('auto', 'avx2', 'avx512') on "
        "`threads` threads at once: the fastest of `repeat` runs of about `seconds` each.");
  m.def("fma_peak_gflops", [](const std::string& isa, int threads) {
    py::gil_scoped_release nogil;
    return ops::fma_peak(isa, threads, 0.1, 3).gflops;
  }, py::arg("isa") = "auto", py::arg("threads") = 1,
        "GFLOP/s of fma_peak(isa, threads): the CPU's measured FMA peak.");
}

}  // namespace mgpu::bind
