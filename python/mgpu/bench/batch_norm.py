"""``bench batch_norm``: batch norm's four kernels on one device, as GB/s against a copy of x of
the same size (the op is memory-bound, so the copy's rate is its ceiling)."""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from ..device import as_device
from ..engine import core as _core
from ..tensor import array
from .common import Log, fmt_pct, header, machine_lines, measure, ms, say, table


def bench_batch_norm(shape: Sequence[int] = (256, 64, 28, 28), warmup: int = 2, repeat: int = 10,
                     min_time: float = 0.05, log: Log = None, device="cpu:0") -> Dict:
    """Batch norm's four kernels on one device at ``shape`` (ResNet-18's first stage by default),
    with the bytes each must move over its time (GB/s), against a copy of x of the same size:
    the op is memory-bound, so the copy's rate is its ceiling."""
    shape = [int(v) for v in shape]
    if len(shape) not in (2, 4) or min(shape) < 1:
        raise ValueError(f"bench batch_norm: shape must be (N, C, H, W) or (N, C) of positive "
                         f"sizes, got {shape}")
    dev = as_device(device)
    out = header("batch_norm", dict(shape=shape, warmup=warmup, repeat=repeat,
                                     min_time=min_time, device=str(dev)))
    sync = lambda: _core.synchronize(dev)  # noqa: E731
    rng = np.random.default_rng(0)
    C = shape[1]
    n = int(np.prod(shape))
    count = n // C
    x = array(rng.standard_normal(shape, dtype=np.float32), device=dev)._t
    dy = array(rng.standard_normal(shape, dtype=np.float32), device=dev)._t
    gamma = array(np.ones(C, np.float32), device=dev)._t
    beta = array(np.zeros(C, np.float32), device=dev)._t
    mean, var = _core.batch_norm_stats(x)
    s1, s2 = _core.batch_norm_backward_reduce(x, dy, mean, var, 1e-5)
    y = _core.batch_norm_forward(x, mean, var, gamma, beta, 1e-5)
    say(log, f"bench batch_norm: {tuple(shape)} on {dev} ...")
    # (name, call, float32 elements read + written per element of x)
    cases = [
        ("copy x -> y (memcpy)", lambda: _core.copy(y, x), 2),
        ("stats (mean, var)", lambda: _core.batch_norm_stats(x), 1),
        ("forward y", lambda: _core.batch_norm_forward(x, mean, var, gamma, beta, 1e-5), 2),
        ("backward_reduce", lambda: _core.batch_norm_backward_reduce(x, dy, mean, var, 1e-5), 2),
        ("backward dx (training)", lambda: _core.batch_norm_backward(
            x, dy, mean, var, gamma, s1, s2, float(count), 1e-5, True), 3),
    ]
    rows = []
    for name, fn, passes in cases:
        m = measure(fn, warmup, repeat, sync, min_time)
        rows.append({"op": name, "time": m, "bytes": 4 * n * passes,
                     "gbps": 4 * n * passes / m["median"] / 1e9})
    out["ops"] = rows
    fwd = rows[1]["time"]["median"] + rows[2]["time"]["median"]
    bwd = rows[3]["time"]["median"] + rows[4]["time"]["median"]
    out["totals"] = {"forward_training": fwd, "backward_training": bwd,
                     "copy": rows[0]["time"]["median"]}
    return out


def format_batch_norm(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench batch_norm: {tuple(s['shape'])} float32 on {s['device']}"]
    lines += machine_lines(r)
    lines.append(f"{s['warmup']} warm-up calls, {s['repeat']} samples of >= "
                 f"{s['min_time'] * 1e3:.0f} ms; median, spread = (max - min) / median; GB/s = "
                 "bytes the op must read and write / time")
    copy_gbps = r["ops"][0]["gbps"]
    rows = [[x["op"], ms(x["time"]["median"]), fmt_pct(100 * x["time"]["spread"]),
             f"{x['bytes'] / 1e6:.0f}", f"{x['gbps']:.1f}", f"{100 * x['gbps'] / copy_gbps:.0f}%"]
            for x in r["ops"]]
    lines += table(["kernel", "ms", "spread", "MB moved", "GB/s", "of copy"], rows, "lrrrrr")
    t = r["totals"]
    lines.append(f"training forward (stats + normalise): {ms(t['forward_training'])} ms = "
                 f"{t['forward_training'] / t['copy']:.2f} copies; backward (reduce + dx): "
                 f"{ms(t['backward_training'])} ms = {t['backward_training'] / t['copy']:.2f} "
                 "copies")
    return "\n".join(lines)
