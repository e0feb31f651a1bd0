"""The lives of the in-process NCCL communicators on emulated GPUs: the timeout watchdog never
aborts a communicator while a launch on it is in progress (real NCCL frees a communicator in
ncclCommAbort, so such a launch would use freed memory), and the communicator sets are cached
for a few device sets only, then freed (each holds GPU memory outside mgpu's allocator
statistics). Both run in a child process with a time limit, so a regression that hangs fails
instead of hanging the suite. The C++ side of the same review (grid arithmetic near 2^31, CUDA
errors left behind by calls mgpu makes without throwing) is tests/cpp/emu_test_gpu_errors.cpp.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mgpu

pytestmark = pytest.mark.gpu

EMULATED = bool(mgpu.build_info()["cuda_emulation"])
HERE = Path(__file__).resolve().parent

emulated_only = pytest.mark.skipif(not EMULATED, reason="runs on emulated GPUs in a child")


def _child(code, gpus, timeout=240, **env):
    full = dict(os.environ, MGPU_EMULATED_GPUS=str(gpus), **env)
    full.pop("MGPU_ALLREDUCE", None)  # the NCCL path
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=full,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {timeout} s: {e.stdout!r}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


_COMMON = r"""
import itertools, time
import numpy as np
import mgpu
from mgpu import _core

rng = np.random.default_rng(3)

def allreduce_on(gpus):
    vs = [rng.normal(size=(517,)).astype(np.float32) for _ in gpus]
    ts = [mgpu.array(v, device=mgpu.gpu(g)) for g, v in zip(gpus, vs)]
    mgpu.allreduce(ts)
    want = vs[0].copy()
    for v in vs[1:]:
        want = want + v  # device order, as the emulated NCCL adds
    for t in ts:
        np.testing.assert_array_equal(t.numpy(), want)
"""

_RACE = _COMMON + r"""
allreduce_on([0, 1])  # the communicators exist before the race
# The launch sleeps 3 s with the set claimed; the watchdog fires 2 s after the collective starts,
# inside that sleep, and must wait for the launch (up to the timeout again) before it aborts:
# 1 s of slack on either side for a loaded machine.
_core._nccl_pause_launches(3.0)
start = time.monotonic()
try:
    allreduce_on([0, 1])
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR after %.1f s: %s" % (time.monotonic() - start, e))
try:
    mgpu.waitall()
except RuntimeError:
    pass
_core._nccl_pause_launches(0.0)
print("REFUSED", _core._nccl_stats()["refused_launches"])
allreduce_on([0, 1])
allreduce_on([0, 1])
print("RECOVERED")
"""


@emulated_only
def test_the_watchdog_waits_for_a_launch_in_progress_before_it_aborts():
    """The watchdog's deadline passes while device 0's worker is inside the grouped launch:
    the abort waits for the launch to return, so NCCL never sees a launch on an aborted (on a
    real GPU: freed) communicator -- it refuses none -- and the all-reduce still fails with the
    timeout, after which new communicators work. Unguarded, the abort lands between the check
    and the launch, and the emulated NCCL refuses the launch on the aborted communicator."""
    out = _child(_RACE, 2, MGPU_NCCL_TIMEOUT_S="2")
    assert "ERROR after" in out and "did not finish within 2" in out, out
    assert "REFUSED 0" in out, out
    assert "RECOVERED" in out, out


_CACHE = r"""
k = mgpu.num_gpus()
subsets = [list(s) for r in range(2, k + 1) for s in itertools.combinations(range(k), r)]
most = 0
for s in subsets:
    allreduce_on(s)
    st = _core._nccl_stats()
    most = max(most, st["live_sets"])
    print("SET", s, st["live_sets"], st["cached_sets"])
print("SUBSETS", len(subsets), "MOST", most)
before = _core._nccl_stats()["live_sets"]
allreduce_on(subsets[-1])  # the most recent set is cached: no new one
print("REUSED", _core._nccl_stats()["live_sets"] == before)
mgpu.empty_cache()
print("AFTER EMPTY", _core._nccl_stats()["live_sets"], _core._nccl_stats()["cached_sets"])
allreduce_on([0, 1])  # and new ones are made on demand
print("AGAIN", _core._nccl_stats()["live_sets"])
"""


@emulated_only
def test_communicator_sets_are_bounded_and_freed():
    """All-reduces over each of the 11 subsets of 4 GPUs made (and kept) 11 communicator sets;
    now the cache keeps at most 4, an evicted set nobody uses is destroyed, the most recent set
    is reused, and mgpu.empty_cache() frees the idle ones."""
    out = _child(_COMMON + _CACHE, 4)
    assert "SUBSETS 11" in out, out
    most = int(out.split("MOST")[1].split()[0])
    assert 1 <= most <= 4, out
    assert "REUSED True" in out, out
    assert "AFTER EMPTY 0 0" in out, out
    assert "AGAIN 1" in out, out
