// cpp/bind/bind.h -- the pieces of the mgpu._core module; each bind_<area>.cpp adds one area.
// Bindings convert types and manage the GIL, nothing more.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace mgpu::bind {

void bind_core(pybind11::module_& m);
void bind_ops(pybind11::module_& m);
void bind_train(pybind11::module_& m);
void bind_data(pybind11::module_& m);
void bind_distributed(pybind11::module_& m);

}  // namespace mgpu::bind
