"""Timing one step of a network from its timeline: the fused step to trace (``runner``), its
batches (``random_batch``, ``feed``), the traced run (``trace_steps``, ``warm_up``) and the
parse of each layer's forward and backward from the trace (``parse_step_trace``); bench layers
uses the same."""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

# ---- measuring ---------------------------------------------------------------------------------

def runner(model: str, devices, seed: int = 0, precision: str = "float32") -> Callable:
    """A function (X, y) -> None doing one fused data-parallel step of `model` on `devices`
    (``precision``: the fused step's, 'float32' or 'bf16')."""
    from .. import models, nn, optim
    from ..parallel import get_params, train_batch
    if model == "lenet":
        params = models.lenet_params(seed=seed)
        device_params = [get_params(params, d) for d in devices]
        return lambda X, y: train_batch(X, y, device_params, devices, 0.05,
                                        precision=precision)
    if model == "resnet18":
        from .. import random
        random.seed(seed)
        net = nn.DataParallel(models.resnet18(10, 1), device_ids=devices)
        trainer = optim.SGD(net.parameters(), 0.01)
        loss = nn.CrossEntropyLoss()
        return lambda X, y: net.train_step(X, y, loss, trainer, precision=precision)
    raise ValueError(f"advise: --model must be lenet or resnet18, got {model!r}")


def random_batch(n: int, seed: int = 0):
    """n random images (n, 1, 28, 28) in [0, 1) and labels: a batch for timing a step."""
    from ..tensor import array
    rng = np.random.default_rng(seed)
    X = array(rng.random((n, 1, 28, 28), dtype=np.float32))
    y = array(rng.integers(0, 10, n).astype(np.int64))
    return X, y


def train_split():
    """Fashion-MNIST's training split as the data loader reads it (one load of the files), or
    None where the data set is not installed."""
    from ..data import find_data_dir
    from ..engine import core as _core
    try:
        return _core.load_fashion_mnist(find_data_dir())[0]
    except FileNotFoundError:
        return None


def feed(batch: int, seed: int = 0, split=None) -> Callable[[], Tuple]:
    """A function returning the next (X, y) of `batch` examples as training gets them: from the
    Fashion-MNIST loader (shuffled, whole batches only, a new epoch where one ends), whose
    prefetch thread works beside the step as in training (on 2 cores it takes a core from a
    2-thread kernel now and then, and keeps both cores awake for the devices' hand-offs:
    measured on 2 cores at LeNet's batches 32 and 128, a step fed by it ran up to 9 % slower on
    1 device and 7 % faster on 2 devices than one fed a fixed batch, and a model traced on a
    fixed batch under-predicted 2 devices' speed-up at small batches); one synthetic batch,
    reused, where the data set is not installed. `split`: the training split already loaded
    (train_split), so that a caller feeding many configurations reads the files once."""
    from ..data import DataLoader
    split = split if split is not None else train_split()
    if split is None:
        X, y = random_batch(batch, seed)
        return lambda: (X, y)
    train = DataLoader(split, batch, True, seed)
    it = iter(train)

    def next_batch():
        nonlocal it
        while True:
            for X, y in it:
                if X.shape[0] == batch:
                    return X, y
            it = iter(train)
    return next_batch


def trace_steps(step: Callable, batches: Callable[[], Tuple], steps: int) -> Dict:
    """Runs `steps` steps back to back (as training does: the host enqueues the next step while
    the device runs this one), each on the next batches() (X, y), inside mgpu.profile, waits for
    them, and returns the parsed trace."""
    from ..engine import core as _core
    from ..trace import profile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof = profile(path)
    try:
        with prof:
            for _ in range(steps):
                step(*batches())
            _core.waitall()
        with open(prof.written[0]) as f:  # under mpirun, this rank's file
            return json.load(f)
    finally:
        for f in {path, *prof.written}:
            if os.path.exists(f):
                os.unlink(f)


# The shortest traced window of a step measurement (seconds; quick mode half): a mean over a few
# milliseconds of steps is one scheduler time slice from another figure (a 2-thread kernel whose
# sibling thread is descheduled waits out the slice), so short steps are traced for more steps
# than `steps`, up to MAX_TRACED_STEPS.
MIN_TRACED_SECONDS = 0.2
MAX_TRACED_STEPS = 100


def warm_up(step: Callable, batches: Callable[[], Tuple], warm: int, steps: int,
            min_seconds: float) -> int:
    """Runs `warm` (at least 1) warm-up steps on batches(), the last one timed alone, and returns
    how many steps to trace: `steps`, or as many more as fill `min_seconds` at the last warm-up
    step's time, at most MAX_TRACED_STEPS (never fewer than `steps`)."""
    from ..engine import core as _core
    for _ in range(max(1, warm) - 1):
        step(*batches())
    _core.waitall()
    t0 = time.perf_counter()
    step(*batches())
    _core.waitall()
    return traced_steps(time.perf_counter() - t0, steps, min_seconds)


def traced_steps(step_seconds: float, steps: int, min_seconds: float) -> int:
    """At least `steps`; as many as fill `min_seconds` at `step_seconds` each, at most
    MAX_TRACED_STEPS."""
    fill = math.ceil(min_seconds / max(step_seconds, 1e-9))
    return max(steps, min(MAX_TRACED_STEPS, fill))


def tracks(doc: Dict) -> Dict[str, List[Dict]]:
    """A Chrome trace's complete events by track (thread) name."""
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out: Dict[str, List[Dict]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(names.get(e["tid"], str(e["tid"])), []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


_HOST_STEP = ("train_batch", "DataParallel.train_step")


def parse_step_trace(doc: Dict, steps: int, device: str = "cpu(0)",
                     statistic: str = "mean") -> Dict:
    """One device's step from a trace of `steps` steps: the layer spans in order with their
    time per step (s; `statistic` "mean": their total over `steps`, "median": the median
    step's) and op count, the buckets (after which span, how many floats), and the host's time
    per step (median of the Python step call)."""
    if statistic not in ("mean", "median"):
        raise ValueError(f"parse_step_trace: statistic must be 'mean' or 'median', got "
                         f"{statistic!r}")
    tr = tracks(doc)
    dev = tr.get(device, [])
    groups = [e for e in dev if e.get("cat") == "layer"]
    tasks = [e for e in dev if e.get("cat") == "task"]
    order: List[str] = []
    times: Dict[str, List[float]] = {}
    counts: Dict[str, List[int]] = {}
    j = 0
    other, other_n = 0.0, 0  # tasks in no layer span (input copies, the label guard's copies)
    for g in groups:
        # A layer's time is its tasks' (busy) time: the gaps between them are the device
        # waiting for the host or for the operating system, not the layer's work.
        busy, n = 0.0, 0
        while j < len(tasks) and tasks[j]["ts"] < g["ts"] + g["dur"]:
            if tasks[j]["ts"] >= g["ts"]:
                busy += tasks[j]["dur"] * 1e-6
                n += 1
            else:
                other += tasks[j]["dur"] * 1e-6
                other_n += 1
            j += 1
        name = g["name"]
        if name not in times:
            order.append(name)
        times.setdefault(name, []).append(busy)
        counts.setdefault(name, []).append(n)
    other += sum(e["dur"] for e in tasks[j:]) * 1e-6
    other_n += len(tasks) - j
    entries = []
    if other_n:
        entries.append({"name": "other device work", "phase": "split", "seconds": other / steps,
                        "ops": round(other_n / steps)})
    for name in order:
        ts = times[name]
        # The mean step: a real run's step time is its total over its steps, so a step that a
        # descheduled kernel thread held up (on a shared machine the time slices of other jobs
        # stall a 2-thread kernel for a slice) counts in full, as it does there; the median
        # step leaves such stalls out. A name met more often than once per step (a layer run
        # twice) counts its mean total either way.
        per_step = sum(ts) / steps if statistic == "mean" or len(ts) > steps else \
            statistics.median(ts)
        phase = ("update" if name == "sgd update" else "split" if name.startswith("split")
                 else "loss" if name.startswith("loss") else
                 "backward" if name.endswith("backward") else "forward")
        entries.append({"name": name, "phase": phase, "seconds": per_step,
                        "ops": int(statistics.median(counts[name]))})
    host = tr.get("host", [])
    buckets = []
    scopes = [e for e in host if e.get("cat") == "scope"]
    for e in scopes:
        if not e["name"].startswith("allreduce bucket"):
            continue
        floats = int(e["name"].split("(")[1].split()[0])
        inside = [s for s in scopes if s is not e and s["ts"] <= e["ts"] and
                  s["ts"] + s["dur"] >= e["ts"] + e["dur"] and s["name"].endswith("backward")]
        after = inside[-1]["name"] if inside else None
        b = {"name": e["name"].split(" (")[0], "after": after, "floats": floats}
        if b not in buckets:
            buckets.append(b)
    # The host's own work per step: the step call less the time it sat blocked (a device queue
    # full, a wait for a device): on a GPU machine those waits would be other work's time. Of
    # the calls that never blocked (the first steps of a window, before the queue fills) where
    # there are any: a call that blocks wakes many times per step (a full queue wakes its host
    # as each task ends), and each wake-up's own cost on cores the device threads keep busy
    # (measured here: the median call of 60 steps 0.18-0.25 ms against 0.06-0.12 ms of 6
    # steps, LeNet batch 32) is this machine's contention, not the step's host work.
    waits = [e for e in host if e["name"] == "queue full" or e["name"].startswith("wait")]
    calls = [(e["dur"] * 1e-6, [w["dur"] * 1e-6 for w in waits if e["ts"] <= w["ts"] and
                                w["ts"] + w["dur"] <= e["ts"] + e["dur"]])
             for e in host if e["name"] in _HOST_STEP]
    host_steps = [d for d, ws in calls if not ws] or [d - sum(ws) for d, ws in calls]
    if not entries or not host_steps:
        raise ValueError("advise: the step's trace has no layer spans on " + device)
    # The device's idle time inside the traced window per step: from its first task to its last,
    # the time it ran no task (the steps run back to back, so the host is ahead and the queue
    # holds the next task: each gap is a hand-off from one task to the next, which the layers'
    # busy times leave out; with one device of 2 threads both cores wait through it).
    idle = 0.0
    if tasks:
        end = max(t["ts"] + t["dur"] for t in tasks)
        idle = max(0.0, (end - tasks[0]["ts"] - sum(t["dur"] for t in tasks)) * 1e-6 / steps)
    return {"entries": entries, "buckets": buckets, "host": statistics.median(host_steps),
            "idle": idle}
