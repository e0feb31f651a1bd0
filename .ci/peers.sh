#!/usr/bin/env bash
# Creates the benchmark peers' virtual environments (never used by the test command):
#   build/peers/torch  PyTorch from PyPI (a CUDA build that also runs on CPU, ~5 GB)
#   build/peers/jax    JAX for the CPU
# Then: python -m mgpu bench train --compare torch --torch-python build/peers/torch/bin/python
# Usage: bash .ci/peers.sh [torch] [jax]   (both when no argument is given; safe to repeat)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
want=("$@")
((${#want[@]})) || want=(torch jax)
for peer in "${want[@]}"; do
  case "$peer" in
    torch) packages=("torch>=2.15" numpy) ;;
    jax) packages=("jax[cpu]" numpy) ;;
    *) echo "peers: unknown peer '$peer' (torch or jax)" >&2; exit 2 ;;
  esac
  dir=build/peers/$peer
  [ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
  echo "peers: installing ${packages[*]} into $dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "${packages[@]}"
  "$dir/bin/python" -c "import $peer; print('peers: $peer', $peer.__version__, 'in $dir')"
done
