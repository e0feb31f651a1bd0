"""``bench ops``: LeNet's ops one at a time, forward and backward, on one device, next to the fused
step at the same batch."""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from ..device import as_device, cpu
from ..engine import core as _core
from ..models import LENET_SHAPES, lenet_params
from ..parallel import get_params, train_batch
from ..tensor import array
from .common import (
    Log,
    fmt_pct,
    header,
    lenet_layer_flops,
    lenet_step_flops,
    machine_lines,
    measure,
    ms,
    say,
    table,
)


def _lenet_op_cases(n: int, rng, dev=None) -> List[Dict]:
    """LeNet's ops in forward order at batch n, each with forward and backward closures."""
    dev = cpu(0) if dev is None else dev

    def t(shape, scale=1.0):
        return array(rng.standard_normal(shape) * scale, device=dev)._t

    W = [t(s, 0.1) if len(s) > 1 else t(s, 0.0) for s in LENET_SHAPES]
    X = t((n, 1, 28, 28))
    y = array(rng.integers(0, 10, n), device=dev)._t
    flops = {layer["layer"]: layer for layer in lenet_layer_flops(n)}
    cases = []

    def add(name, fwd, bwd, layer=None):
        f = flops.get(layer) if layer else None
        cases.append({"op": name, "forward": fwd, "backward": bwd,
                      "flops_forward": f["forward"] if f else None,
                      "flops_backward": f["backward"] if f else None})

    h = X
    for i, (conv, widx) in enumerate((("conv1", 0), ("conv2", 2))):
        x, w, b = h, W[widx], W[widx + 1]
        c = _core.conv2d_forward(x, w, b, 1, 0)
        need_dx = widx != 0
        add(f"{conv} {tuple(w.shape)}",
            lambda x=x, w=w, b=b: _core.conv2d_forward(x, w, b, 1, 0),
            lambda x=x, w=w, c=c, dx=need_dx: _core.conv2d_backward(x, w, c, 1, 0, dx, True),
            conv)
        r = _core.relu_forward(c)
        add(f"relu{i + 1}", lambda c=c: _core.relu_forward(c),
            lambda c=c, r=r: _core.relu_backward(c, r))
        p = _core.avg_pool2d_forward(r, 2, 2, 2, 2)
        add(f"avg_pool{i + 1}", lambda r=r: _core.avg_pool2d_forward(r, 2, 2, 2, 2),
            lambda r=r, p=p: _core.avg_pool2d_backward(r, p, 2, 2, 2, 2))
        h = p
    h = h.reshape([n, -1])
    for i, (fc, widx) in enumerate((("fc1", 4), ("fc2", 6))):
        a, w, b = h, W[widx], W[widx + 1]
        z = _core.mm(a, w)
        add(f"{fc} mm {tuple(a.shape)}@{tuple(w.shape)}", lambda a=a, w=w: _core.mm(a, w),
            lambda a=a, w=w, z=z: (_core.mm(z, w, False, True), _core.mm(a, z, True, False)), fc)
        add(f"{fc} bias", lambda z=z, b=b: _core.binary(_core.BinaryOp.Add, z, b),
            lambda z=z, b=b: _core.sum_to_shape(z, list(b.shape)))
        if i == 0:
            r = _core.relu_forward(z)
            add("relu3", lambda z=z: _core.relu_forward(z),
                lambda z=z, r=r: _core.relu_backward(z, r))
            h = r
        else:
            h = z
    losses = _core.softmax_ce_forward(h, y)
    add("softmax_ce", lambda h=h: _core.softmax_ce_forward(h, y),
        lambda h=h, losses=losses: _core.softmax_ce_backward(h, y, losses))
    return cases


def bench_ops(batch_sizes: Sequence[int] = (128, 256), warmup: int = 2, repeat: int = 10,
              min_time: float = 0.005, log: Log = None, device="cpu:0") -> Dict:
    """Forward and backward time of each LeNet op on one device (cpu(0) by default; a GPU is
    timed the same way, a wait for its stream ending every sample), with GFLOP/s for conv and mm.

    A sample is enough back-to-back calls to last ``min_time`` seconds, then one wait; the
    fused step on one device at the same batch is timed too, to compare with the ops' sum.
    """
    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"bench ops: batch sizes must be >= 1, got {batch_sizes}")
    if int(repeat) < 1:
        raise ValueError(f"bench ops: repeat must be >= 1, got {repeat}")
    dev = as_device(device)
    out = header("ops", dict(batch_sizes=batch_sizes, warmup=warmup, repeat=repeat,
                              min_time=min_time, device=str(dev)))
    sync = lambda: _core.synchronize(dev)  # noqa: E731
    rng = np.random.default_rng(0)
    rows = []
    steps = []
    for n in batch_sizes:
        say(log, f"bench ops: LeNet's ops at batch {n} on {dev} ...")
        for case in _lenet_op_cases(n, rng, dev):
            row = {"op": case["op"], "batch": n}
            for phase in ("forward", "backward"):
                m = measure(case[phase], warmup, repeat, sync, min_time)
                row[phase] = m
                f = case["flops_" + phase]
                row["gflops_" + phase] = f / m["median"] / 1e9 if f else None
            rows.append(row)
        Xn = rng.random((n, 1, 28, 28), dtype=np.float32)
        X, y = array(Xn, device=dev), array(rng.integers(0, 10, n), device=dev)
        dp = [get_params(lenet_params(seed=0), dev)]
        m = measure(lambda: train_batch(X, y, dp, [dev], 0.01), warmup, repeat, sync, min_time)
        total = sum(r["forward"]["median"] + r["backward"]["median"]
                    for r in rows if r["batch"] == n)
        steps.append({"batch": n, "fused_step": m, "sum_of_ops": total,
                      "gflops": lenet_step_flops(n) / m["median"] / 1e9})
    out["ops"] = rows
    out["steps"] = steps
    return out


def format_ops(r: Dict) -> str:
    lines = [f"mgpu bench ops: LeNet's ops on {r['settings'].get('device', 'cpu(0)')}, "
             "forward and backward"]
    lines += machine_lines(r)
    s = r["settings"]
    lines.append(f"{s['warmup']} warm-up calls, {s['repeat']} samples of >= "
                 f"{s['min_time'] * 1e3:.0f} ms; median, spread = (max - min) / median")
    for n in s["batch_sizes"]:
        lines.append("")
        rows = []
        for x in r["ops"]:
            if x["batch"] != n:
                continue
            g = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
            rows.append([x["op"], ms(x["forward"]["median"]), fmt_pct(100 * x["forward"]["spread"]),
                         g(x["gflops_forward"]), ms(x["backward"]["median"]),
                         fmt_pct(100 * x["backward"]["spread"]), g(x["gflops_backward"])])
        st = [x for x in r["steps"] if x["batch"] == n][0]
        lines.append(f"batch {n}")
        lines += table(["op", "fwd ms", "spread", "GFLOP/s", "bwd ms", "spread", "GFLOP/s"],
                       rows, "lrrrrrr")
        lines.append(f"sum of the ops, forward + backward: {ms(st['sum_of_ops'])} ms; fused "
                     f"train_batch on 1 device: {ms(st['fused_step']['median'])} ms (spread "
                     f"{fmt_pct(100 * st['fused_step']['spread'])}), {st['gflops']:.1f} GFLOP/s")
    return "\n".join(lines)
