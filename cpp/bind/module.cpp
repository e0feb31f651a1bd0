// cpp/bind/module.cpp -- mgpu._core: the engine as seen from Python, and how C++ exceptions
// become the Python exceptions a user expects.
#include <new>

#include "bind/bind.h"
#include "core/error.h"
#include "data/idx_reader.h"
#include "ops/cpu_isa.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "mgpu's C++ engine (private: use the mgpu package)";
  // The CPU kernels' instruction set, chosen now: a bad MGPU_ISA, or a CPU without it, fails the
  // import with ImportError and the reason rather than a later op.
  mgpu::ops::cpu::isa_choice();
  static py::exception<mgpu::DeviceError> device_error(m, "DeviceError", PyExc_RuntimeError);
  static py::exception<mgpu::OutOfMemoryError> oom_error(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mgpu::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const mgpu::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const mgpu::data::DataNotFoundError& e) {
      PyErr_SetString(PyExc_FileNotFoundError, e.what());
    } catch (const mgpu::OutOfMemoryError& e) {
      PyErr_SetString(oom_error.ptr(), e.what());
    } catch (const mgpu::DeviceError& e) {
      PyErr_SetString(device_error.ptr(), e.what());
    } catch (const mgpu::InternalError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  mgpu::bind::bind_core(m);
  mgpu::bind::bind_ops(m);
  mgpu::bind::bind_train(m);
  mgpu::bind::bind_data(m);
  mgpu::bind::bind_distributed(m);
}
