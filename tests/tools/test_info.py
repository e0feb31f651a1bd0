"""`python -m mgpu info` in whatever build runs the tests: every line is there, each part that is
missing says why (switched off or not found) and how to get it, and nothing raises; with no data
set anywhere, info still exits 0 and training's error names every place searched and the two ways
to provide the files."""
import os
import shutil
import subprocess
import sys

import pytest

import mgpu
from mgpu import cli

KEYS = ("mgpu ", "CPU:", "CPU kernels:", "engine compiled for:", "BLAS:", "CUDA:", "cuDNN:",
        "NCCL:", "MPI:", "GPU tensors across processes:", "devices:", "data:")
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


def _mgpu(*args, env=None, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-m", "mgpu", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **(env or {})))


def test_info_has_every_line_and_exits_0():
    r = _mgpu("info")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    for key in KEYS:
        assert sum(line.startswith(key) for line in lines) == 1, (key, r.stdout)
    assert "Traceback" not in r.stdout


def test_info_says_why_a_part_is_missing():
    b = mgpu.build_info()
    cuda, mpi = b["cuda"], b["mpi"]
    if b["cuda_emulation"]:
        assert cuda.startswith("emulated")
    elif cuda.startswith("built"):
        assert "CUDA runtime" in cuda
    elif "MGPU_WITH_CUDA=OFF" in cuda:  # switched off: says so and how to switch it on
        assert cuda.startswith("not built: switched off at build time")
        assert "MGPU_WITH_CUDA=ON" in cuda and "nvcc was not found" not in cuda
    else:
        assert cuda.startswith("not built: nvcc was not found") and "CUDA toolkit" in cuda
    if not (b["cuda_emulation"] or cuda.startswith("built")):
        assert "needs the CUDA backend" in b["cudnn"] and "needs the CUDA backend" in b["nccl"]
    if mpi != "built":
        assert mpi.startswith("not built: ") and "apt-get install openmpi-bin libopenmpi-dev" in mpi
        assert ("MGPU_WITH_MPI=ON" in mpi) == ("MGPU_WITH_MPI=OFF" in mpi)
    for key in ("cuda", "cudnn", "nccl", "mpi"):
        assert "\n" not in b[key]


def test_the_gpu_transport_across_processes_matches_the_build(monkeypatch):
    """build_info()['dist_gpu_transport'] (the info line) says how GPU tensors cross processes
    in this build. In the real CUDA build with NCCL and MPI (the installed package where nvcc is)
    it is an NCCL communicator, and _core links the NCCL-world path against the toolkit's NCCL
    (compiled and linked: no GPU runs it here)."""
    monkeypatch.delenv("MGPU_DIST_GPU", raising=False)
    b = mgpu.build_info()
    t = b["dist_gpu_transport"]
    assert mgpu._core.dist_nccl_world_built() == t.startswith("nccl: "), t
    if b["mpi"] != "built":
        assert t.startswith("none: no MPI back end"), t
    elif b["cuda_emulation"]:
        assert t.startswith("nccl: ") and "on the emulator's NCCL" in t, t
        assert "MGPU_DIST_GPU=host stages them through host memory" in t
    elif b["cuda"].startswith("built") and b["nccl"] == "built":
        assert t.startswith("nccl: ") and "never on a real GPU" in t, t
        nm = shutil.which("nm")
        if nm is None:
            pytest.skip("no nm to list _core's symbols")
        out = subprocess.run([nm, "-D", "--undefined-only", mgpu._core.__file__],
                             capture_output=True, text=True, check=True).stdout
        symbols = {line.split()[-1] for line in out.splitlines() if line.strip()}
        for name in ("ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommFinalize",
                     "ncclCommAbort", "ncclAllReduce", "MPI_Ibcast"):
            assert name in symbols, f"_core does not call {name}: no NCCL world in this build"
    else:
        assert t.startswith("host: ") and "no NCCL across processes" in t, t
    monkeypatch.setenv("MGPU_DIST_GPU", "host")
    if t.startswith("nccl: "):
        assert mgpu.build_info()["dist_gpu_transport"].startswith("host (MGPU_DIST_GPU=host)")


def test_init_backend_nccl_starts_or_says_what_the_build_lacks():
    """init(backend="nccl") outside mpirun, in a child: a one-process world where the build has
    NCCL across processes, else a DeviceError naming the missing part (the CPU-only wheel of the
    pip-only route: no MPI back end)."""
    code = ("from mgpu import distributed as d\nd.init(backend='nccl')\n"
            "print('backend', d.backend(), d.world_size())")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MGPU_DIST_GPU", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    b = mgpu.build_info()
    if mgpu._core.dist_nccl_world_built():
        assert r.returncode == 0 and "backend nccl 1" in r.stdout, r.stderr
        return
    assert r.returncode != 0 and "DeviceError: init(backend='nccl'): this " in r.stderr, r.stderr
    if b["mpi"] != "built":
        assert "has no MPI back end" in r.stderr and "openmpi-bin" in r.stderr, r.stderr
    elif not (b["cuda_emulation"] or b["cuda"].startswith("built")):
        assert "has no CUDA backend" in r.stderr, r.stderr
    else:
        assert "has no NCCL" in r.stderr, r.stderr


@pytest.mark.parametrize("build, gpus, want", [
    ({"cuda": "not built: switched off at build time (MGPU_WITH_CUDA=OFF)",
      "cuda_emulation": False, "gpu_query_error": ""}, 0,
     "; no GPU: the CUDA backend is not built (see the CUDA line)"),
    ({"cuda": "built (CUDA runtime 12.4)", "cuda_emulation": False,
      "gpu_query_error": "CUDA driver version is insufficient for CUDA runtime version"}, 0,
     "; no GPU visible: CUDA driver version is insufficient for CUDA runtime version (is the "
     "NVIDIA driver installed and a GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?)"),
    ({"cuda": "built (CUDA runtime 12.4)", "cuda_emulation": False, "gpu_query_error": ""}, 0,
     "; no GPU visible: the CUDA runtime reports 0 devices (is the NVIDIA driver installed and "
     "a GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?)"),
    ({"cuda": "built (CUDA runtime 12.4)", "cuda_emulation": False, "gpu_query_error": ""}, 2,
     ""),
    ({"cuda": "emulated (...)", "cuda_emulation": True,
      "gpu_query_error": "no CUDA-capable device is detected"}, 0,
     "; no GPU visible: no CUDA-capable device is detected (set MGPU_EMULATED_GPUS=2 for two "
     "emulated GPUs)"),
    ({"cuda": "emulated (...)", "cuda_emulation": True, "gpu_query_error": ""}, 2,
     " (emulated on the CPU: MGPU_EMULATED_GPUS sets how many)"),
])
def test_devices_line_says_why_there_is_no_gpu(build, gpus, want):
    assert cli._no_gpu_why(build, gpus) == want


def _without_system_data():
    """A command prefix that runs its command with an empty folder mounted over Debian's data
    directory (a private mount namespace: root and unshare needed), so no data set is found."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("hiding the system data set needs root and unshare")
    probe = subprocess.run([unshare, "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    return unshare


def _run_hidden(tmp_path, *args):
    unshare = _without_system_data()
    empty, data = tmp_path / "empty", tmp_path / "mgpu-data"
    empty.mkdir()
    data.mkdir()
    script = ("mkdir -p {s} && mount --bind {e} {s} && exec \"$@\"".format(s=SYSTEM_DIR, e=empty))
    cmd = [unshare, "-m", "sh", "-c", script, "sh", sys.executable, "-m", "mgpu", *args]
    env = dict(os.environ, MGPU_DATA=str(data), HOME=str(tmp_path / "home"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env), data


def _names_every_place_and_both_ways(text, data, tmp_path):
    assert f"{data}  (MGPU_DATA: missing {FILES[0]}[.gz]" in text
    assert f"{tmp_path / 'home' / '.mgpu' / 'data'}  (~/.mgpu/data: no such directory)" in text
    assert f"{SYSTEM_DIR}  (Debian's dataset-fashion-mnist: missing" in text
    assert "1. `apt-get install dataset-fashion-mnist`" in text
    assert "2. put the four IDX files" in text and "set MGPU_DATA to it" in text
    for name in FILES:
        assert name in text


def test_info_without_any_data_set(tmp_path):
    r, data = _run_hidden(tmp_path, "info")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    text = r.stdout[r.stdout.index("data: "):]
    assert text.startswith("data: find_fashion_mnist: Fashion-MNIST not found. Searched:")
    _names_every_place_and_both_ways(text, data, tmp_path)


def test_train_without_any_data_set_says_where_it_searched(tmp_path):
    r, data = _run_hidden(tmp_path, "train", "--epochs", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("mgpu: error: find_fashion_mnist: Fashion-MNIST not found.")
    _names_every_place_and_both_ways(r.stderr, data, tmp_path)
