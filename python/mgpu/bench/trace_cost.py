"""What the timeline costs: process CPU time per fused LeNet step on 2 CPU devices with
tracing off and on, interleaved rounds, medians. Run with MGPU_NUM_THREADS=1 so CPU time is not
inflated by spinning helpers; for the cost of the span sites while off, run the "off" figure of this
build against a build without them (same command, other PYTHONPATH).

    MGPU_NUM_THREADS=1 python -m mgpu.bench.trace_cost --batch-size 16 --rounds 7
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def cpu_per_step(step, steps: int) -> float:
    from ..engine import core as _core
    t0 = time.process_time()
    for _ in range(steps):
        step()
    _core.waitall()
    return (time.process_time() - t0) / steps


def main(argv=None) -> int:
    from ..device import cpu
    from ..engine import core as _core
    from ..models import lenet_params
    from ..parallel import get_params, train_batch
    from ..tensor import array
    from ..trace import profile
    p = argparse.ArgumentParser(prog="python -m mgpu.bench.trace_cost", description=__doc__)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40, help="steps per sample")
    p.add_argument("--rounds", type=int, default=7, help="off/on sample pairs")
    args = p.parse_args(argv)
    devs = [cpu(0), cpu(1)]
    dp = [get_params(lenet_params(seed=0), d) for d in devs]
    rng = np.random.default_rng(0)
    X = array(rng.random((args.batch_size, 1, 28, 28), dtype=np.float32))
    y = array(rng.integers(0, 10, args.batch_size).astype(np.int64))

    def step():
        train_batch(X, y, dp, devs, 0.01)
    cpu_per_step(step, 3)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    off, on = [], []
    try:
        for _ in range(args.rounds):
            off.append(cpu_per_step(step, args.steps))
            with profile(path):
                on.append(cpu_per_step(step, args.steps))
        with open(path) as f:
            events = len(json.load(f)["traceEvents"])
    finally:
        os.unlink(path)
    a, b = statistics.median(off), statistics.median(on)
    print(f"LeNet fused step, batch {args.batch_size}, 2 CPU devices, "
          f"{_core.num_threads()} thread(s), process CPU time, median of {args.rounds}:")
    print(f"  tracing off {a * 1e3:.3f} ms/step, on {b * 1e3:.3f} ms/step "
          f"({(b / a - 1) * 100:+.1f} %); {events / args.steps:.0f} trace events per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
