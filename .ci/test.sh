#!/usr/bin/env bash
# Sets everything up (.ci/setup.sh), lints python/ and tests/ (ruff), then runs the C++ tests
# (ctest, GPU backend on mgpu's CUDA emulator, plus the nvcc compile check), the Python suite
# against the installed package, and the tests marked `gpu` again against the emulated build's
# package, where gpu(0) and gpu(1) are emulated GPUs running our CUDA kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh

echo "== Lint (ruff) of python/ and tests/"
.venv/bin/ruff check python tests

echo "== C++ unit tests (ctest): engine, CUDA emulator, CUDA kernels on emulated GPUs"
cmake -S . -B build/cpp-tests -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_PYTHON=ON -DMGPU_CUDA_EMULATION=ON \
  -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
  -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
cmake --build build/cpp-tests -j "$(nproc)" >/dev/null
(cd build/cpp-tests && ctest --output-on-failure -j 2)

if [ "${MGPU_CI_SANITIZE:-0}" = 1 ]; then
  # Opt-in (MGPU_CI_SANITIZE=1): ASan + UBSan on the CPU engine, the C++ engine tests and _core
  # only (no emulator, no CUDA, no MPI), with ccache.
  echo "== Sanitizer build (AddressSanitizer + UBSan, CPU only): C++ tests and a Python smoke suite"
  launcher=()
  if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  cmake -S . -B build/asan -DMGPU_SANITIZE=ON -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_PYTHON=ON \
    -DMGPU_WITH_CUDA=OFF -DMGPU_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
    -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
    -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
  cmake --build build/asan -j "$(nproc)" --target mgpu_cpp_tests _core >/dev/null
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  ASAN_OPTIONS=detect_leaks=0 build/asan/mgpu_cpp_tests --gtest_brief=1
  # The sanitized package: the sources next to this _core.
  rm -rf build/asan/python && mkdir -p build/asan/python
  cp -r python/mgpu build/asan/python/ && cp build/asan/_core*.so build/asan/python/mgpu/
  # Python itself is not instrumented: the ASan runtime must be loaded first, and libstdc++ with
  # it (or ASan's __cxa_throw interceptor finds no real one and aborts); leaks are CPython's.
  asan_preload="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
  (cd tests && LD_PRELOAD="$asan_preload" ASAN_OPTIONS=detect_leaks=0 \
    MGPU_EMULATED_GPUS=0 PYTHONPATH="$PWD/../build/asan/python" ../.venv/bin/python -m pytest -q \
    -p no:cacheprovider test_robust.py test_tensor.py test_errors.py -k "not cli and not gpu")
fi

echo "== Python tests (pytest) of the installed package"
# Run from tests/ so `import mgpu` finds the installed package, never python/mgpu.
(cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider "$@")

echo "== Python GPU tests on emulated GPUs (the emulated build's package)"
(cd tests && PYTHONPATH="$PWD/../build/cpp-tests/python" \
  ../.venv/bin/python -m pytest -q -p no:cacheprovider -m gpu "$@")
