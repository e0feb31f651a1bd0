"""Fused SyncBatchNorm steps on 2 emulated GPUs without peer access (MGPU_EMU_PEER_ACCESS=0, as
GPUs without P2P): several steps back to back run, and end with the parameters and running
statistics of the same steps with peer access, bit for bit. Data crosses devices only by
peer copies (staged by the driver when the GPUs cannot reach each other), so nothing may differ.

The emulator checks every pointer a kernel is given, including each pointer-sized word of a struct
argument; a word holding a struct's padding bytes (a stale pointer of the caller's stack) must not
count: it made such steps fail with "argument 1 holds a pointer to memory of device 1" on correct
code, after a few steps or at once on the strict emulator, as the stack and heap fell.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mgpu
from test_sync_bn_gpu import two_gpu_steps

pytestmark = pytest.mark.gpu

EMULATED = bool(mgpu.build_info()["cuda_emulation"])
TESTS = Path(__file__).resolve().parents[1]


def five_sync_steps():
    """Five fused steps of the tiny residual net with SyncBatchNorm on gpu(0) and gpu(1); returns
    its state dict on the host."""
    net, step = two_gpu_steps(sync=True)
    for _ in range(5):
        step()
    mgpu.waitall()
    return {k: v.numpy() for k, v in net.state_dict().items()}


_CHILD = r"""
import sys
import conftest  # noqa: F401  (puts every test folder on sys.path, as under pytest)
import numpy as np
from test_gpu_without_peer_access import five_sync_steps

np.savez(sys.argv[1], **five_sync_steps())
"""


@pytest.mark.skipif(not EMULATED or mgpu.num_gpus() < 2 or
                    os.environ.get("MGPU_EMU_PEER_ACCESS") == "0",
                    reason="compares a child without peer access with 2 emulated GPUs with it")
def test_sync_batch_norm_steps_without_peer_access_equal_those_with_it(tmp_path):
    out = tmp_path / "without_peer_access.npz"
    env = dict(os.environ, MGPU_EMULATED_GPUS="2", MGPU_EMU_PEER_ACCESS="0", MGPU_CUDA_GRAPH="0")
    env.pop("MGPU_ALLREDUCE", None)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(out)], cwd=TESTS, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    with np.load(out) as f:
        without = {k: f[k] for k in f.files}
    with_peer = five_sync_steps()
    assert without.keys() == with_peer.keys()
    for name, want in with_peer.items():
        assert np.all(np.isfinite(want)), name
        assert without[name].tobytes() == want.tobytes(), name
