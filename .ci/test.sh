#!/usr/bin/env bash
# Sets everything up (.ci/setup.sh), then runs every test: the C++ unit tests through ctest and
# the Python suite through pytest (which imports the installed package, not the source tree).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh

echo "== C++ unit tests (ctest), CUDA emulator tests, nvcc compile check of the emulated kernels"
cmake -S . -B build/cpp-tests -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_PYTHON=OFF -DMGPU_CUDA_EMULATION=ON \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp-tests -j "$(nproc)" >/dev/null
(cd build/cpp-tests && ctest --output-on-failure -j 2)

echo "== Python tests (pytest)"
# Run from tests/ so `import mgpu` finds the installed package, never python/mgpu.
cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
