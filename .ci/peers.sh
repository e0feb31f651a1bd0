#!/usr/bin/env bash
# Creates the peers' virtual environments (the test command makes torch and jax when missing and
# runs the interop and comparison tests against them; the benchmarks use them too):
#   build/peers/torch  PyTorch from PyPI (a CUDA build that also runs on CPU, ~5 GB)
#   build/peers/jax    JAX for the CPU, with Flax and Optax (the JAX chapters' code)
#   build/peers/onednn oneDNN from PyPI (its GNU OpenMP build) and cpp/bench/onednn_conv.cpp
#                      compiled against it: bin/onednn_conv_bench
# Then: python -m mgpu bench train --compare torch --torch-python build/peers/torch/bin/python
#       python -m mgpu bench train --compare jax   (finds build/peers/jax/bin/python itself)
#       python -m mgpu bench conv --onednn build/peers/onednn/bin/onednn_conv_bench
# Usage: bash .ci/peers.sh [torch] [jax] [onednn]   (torch and jax when no argument is given;
# safe to repeat)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
want=("$@")
((${#want[@]})) || want=(torch jax)
for peer in "${want[@]}"; do
  case "$peer" in
    torch) packages=("torch>=2.15" numpy) ;;
    jax) packages=("jax[cpu]" flax optax numpy) ;;
    onednn) packages=("onednn-cpu-gomp==2023.2.0" "onednn-devel-cpu-gomp==2023.2.0") ;;
    *) echo "peers: unknown peer '$peer' (torch, jax or onednn)" >&2; exit 2 ;;
  esac
  dir=build/peers/$peer
  [ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
  echo "peers: installing ${packages[*]} into $dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "${packages[@]}"
  if [ "$peer" = onednn ]; then
    # The wheels put libdnnl.so.3 in $dir/lib and the headers in $dir/include.
    ln -sf libdnnl.so.3 "$dir/lib/libdnnl.so"
    "${CXX:-g++}" -O2 -std=c++17 -Wall -Wextra -o "$dir/bin/onednn_conv_bench" \
      cpp/bench/onednn_conv.cpp -I"$dir/include" -L"$dir/lib" -ldnnl -Wl,-rpath,"$PWD/$dir/lib"
    echo "peers: oneDNN conv bench in $dir/bin/onednn_conv_bench"
    continue
  fi
  if [ "$peer" = jax ]; then  # the rival needs all three (bench train --compare jax checks)
    "$dir/bin/python" -c "import jax, flax, optax; print('peers: jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, 'in $dir')"
    continue
  fi
  "$dir/bin/python" -c "import $peer; print('peers: $peer', $peer.__version__, 'in $dir')"
done
