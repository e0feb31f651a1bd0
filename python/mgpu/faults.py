"""Fault injection for the kill tests: ``fault(point)`` marks the places where a crash must leave
a checkpoint directory a run can resume from. It does nothing unless the environment asks.

MGPU_TEST_CHECKPOINT_FAULT="point@n[,point@n...]" kills this process with SIGKILL the n-th time it
reaches ``point`` (counted from 1): "write" (half of a file's bytes written), "rename" (the
temporary file complete and fsynced, not yet renamed), "dirsync" (renamed, the directory not yet
fsynced), "prune" (the new file durable, older ones not yet removed), "step" (after a training
step, before its checkpoint). MGPU_TEST_CHECKPOINT_FAULT_RANK limits it to one rank.
MGPU_TEST_STEP_DELAY_S=s makes every arrival at "step" sleep s seconds, so a test that signals a
run at a random moment finds it inside its loop however fast the machine is. Callers call
``faults.fault(...)`` through the module, so a test may replace ``fault`` for all of them.
"""
import os
import signal
import time
from typing import Dict

from .engine import core as _core

_counts: Dict[str, int] = {}


def fault(point: str) -> None:
    """Kills this process where MGPU_TEST_CHECKPOINT_FAULT names ``point`` and this arrival."""
    if point == "step" and os.environ.get("MGPU_TEST_STEP_DELAY_S"):
        time.sleep(float(os.environ["MGPU_TEST_STEP_DELAY_S"]))
    spec = os.environ.get("MGPU_TEST_CHECKPOINT_FAULT")
    if not spec:
        return
    only = os.environ.get("MGPU_TEST_CHECKPOINT_FAULT_RANK")
    if only is not None and _core.dist_rank() != int(only):
        return
    _counts[point] = _counts.get(point, 0) + 1
    for item in spec.split(","):
        name, _, n = item.strip().partition("@")
        if name == point and int(n or 1) == _counts[point]:
            os.kill(os.getpid(), signal.SIGKILL)
