"""Property-based tests (Hypothesis): elementwise and in-place ops on random shapes, devices and
views against NumPy; random bad arguments that must raise TypeError, ValueError, IndexError or
MemoryError; bounded fuzz runs of the IDX reader and the checkpoint reader. Each group runs in a
child process (property_suite.py), so a crash or a hang is reported with the example that caused
it.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("hypothesis", reason="needs Hypothesis (pip install hypothesis; .ci/setup.sh)")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Examples per group: enough to reach the odd corners, few enough for CI (a few seconds each).
GROUPS = {"elementwise": 300, "inplace": 300, "bad_args": 600, "idx_fuzz": 400,
          "ckpt_fuzz": 300}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_property_group(group):
    env = dict(os.environ)
    env.setdefault("MGPU_EMULATED_GPUS", "0")  # emulated GPUs are slow; test_gpu.py covers them
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "property_suite.py"), group,
                            str(GROUPS[group])], capture_output=True, text=True, timeout=600,
                           env=env, cwd=HERE)
    except subprocess.TimeoutExpired as e:
        last = [line for line in (e.stderr or b"").decode(errors="replace").splitlines()
                if line.startswith("TRY")][-1:]
        pytest.fail(f"{group}: the child hung; last example: {last}")
    tries = [line for line in r.stderr.splitlines() if line.startswith("TRY")]
    if r.returncode < 0:
        pytest.fail(f"{group}: the child died of signal {-r.returncode} on the example "
                    f"{tries[-1] if tries else '(none)'}\n{r.stderr[-3000:]}")
    assert r.returncode == 0, f"{group}: failed\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    tried = int(r.stdout.split("TRIED")[1].split()[0])
    print(f"{group}: {tried} examples")
    assert tried >= GROUPS[group] // 2, f"{group}: only {tried} examples ran"
