"""The CPU kernels' instruction-set path: MGPU_ISA picks it, a bad value or a path the CPU lacks
fails the import with the reason, build_info() and `mgpu info` say which runs, and both paths give
the same bits for a fused LeNet step."""
import os
import subprocess
import sys

import pytest

import mgpu


def _run(code, isa):
    env = dict(os.environ, MGPU_ISA=isa)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def _has_avx512():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))


def test_build_info_names_the_path_and_why():
    info = mgpu.build_info()
    assert info["cpu_isa"] in ("avx2", "avx512")
    assert info["cpu_isa_reason"]
    assert "avx2 (x86-64-v3)" in info["cpu_isas_built"]


@pytest.mark.parametrize("isa", ["avx2", "avx512", "auto"])
def test_forced_path_is_used_or_refused(isa):
    r = _run("import mgpu; i = mgpu.build_info(); print(i['cpu_isa'], '|', i['cpu_isa_reason'])",
             isa)
    if isa == "avx512" and not _has_avx512():
        assert r.returncode != 0 and "ImportError" in r.stderr and "lacks AVX-512" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    name, reason = r.stdout.strip().split(" | ")
    if isa == "auto":
        assert name == ("avx512" if _has_avx512() else "avx2") and reason.startswith("auto")
    else:
        assert name == isa and f"MGPU_ISA={isa}" in reason


def test_unknown_path_fails_the_import_naming_it():
    r = _run("import mgpu", "avx1024")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "MGPU_ISA='avx1024'" in r.stderr
    assert "auto, avx2, avx512 or avx512_bf16" in r.stderr


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512_bf16", "auto"])
def test_bf16_products_kernel_follows_the_path(isa):
    """avx512_bf16 (vdpbf16ps) where asked for or auto finds AVX512_BF16; the emulation on
    avx512 and avx2; a CPU without AVX512_BF16 refuses MGPU_ISA=avx512_bf16 at import."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    has_bf16 = _has_avx512() and "avx512_bf16" in flags
    r = _run("import mgpu; print(mgpu.build_info()['cpu_bf16'])", isa)
    if isa.startswith("avx512") and not (has_bf16 if isa == "avx512_bf16" else _has_avx512()):
        assert r.returncode != 0 and "ImportError" in r.stderr and "lacks AVX-512" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    want = {"auto": "avx512_bf16" if has_bf16 else "avx512" if _has_avx512() else "avx2"}
    assert r.stdout.strip() == want.get(isa, isa)


def test_info_prints_every_part_without_traceback():
    r = _run("import mgpu; mgpu.info()", "auto")
    assert r.returncode == 0, r.stderr
    for key in ("mgpu ", "CPU:", "CPU kernels:", "BLAS:", "CUDA:", "cuDNN:", "NCCL:", "MPI:",
                "devices:", "data:"):
        assert key in r.stdout, (key, r.stdout)


def test_info_without_data_names_where_it_searched(tmp_path):
    code = ("from mgpu import cli; import os; "
            "print('\\n'.join(cli.info_lines()))")
    env = dict(os.environ, MGPU_DATA=str(tmp_path / "none"), HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    data = r.stdout[r.stdout.index("data:"):]
    if "found in" not in data:  # the system copy may exist; otherwise every place is named
        assert str(tmp_path / "none") in data and "MGPU_DATA" in data
        assert "dataset-fashion-mnist" in data


_STEP = """
import hashlib, numpy as np
from mgpu import _core as C
dev = C.Device(C.DeviceKind.CPU, 0)
rng = np.random.default_rng(3)
shapes = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]
params = [[C.Tensor.from_numpy((0.1 * rng.standard_normal(s)).astype(np.float32), dev)
           for s in shapes]]
X = C.Tensor.from_numpy(rng.random((45, 1, 28, 28), dtype=np.float32), dev)
y = C.Tensor.from_numpy(rng.integers(0, 10, 45).astype(np.int32), dev)
for _ in range(2):
    C.train_batch(X, y, params, [dev], 0.1)
C.waitall()
print(hashlib.sha256(b"".join(p.numpy().tobytes() for p in params[0])).hexdigest())
"""


def test_fused_step_same_bits_on_both_paths():
    if not _has_avx512():
        pytest.skip("this CPU has no AVX-512: one path only")
    a, b = _run(_STEP, "avx2"), _run(_STEP, "avx512")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
