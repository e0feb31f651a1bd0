"""``bench conv``: the CPU conv's algorithms (MGPU_CONV_ALGO) side by side at ResNet-18's 3x3
stride-1 layers, forward and backward (dx, dw, db), interleaved round by round so a change of
load hits every algorithm alike."""
from __future__ import annotations

import os
from typing import Dict, Sequence

import numpy as np

from .. import _core
from ..device import as_device
from ..tensor import array
from .common import Log, _machine_lines, _ms, _say, _table, header, measure, summarize

# ResNet-18's 3x3 stride-1 convs on 28x28 Fashion-MNIST (d2l's resnet18(10, 1)): (C, H) with K = C
RESNET18_3X3 = [(64, 28), (128, 14), (256, 7), (512, 4)]
ALGOS = ("direct", "im2col", "winograd")


def bench_conv(batch: int = 64, algos: Sequence[str] = ("direct", "winograd"), rounds: int = 3,
               repeat: int = 3, warmup: int = 1, layers=None, log: Log = None,
               device="cpu:0") -> Dict:
    """Forward and backward time of each algorithm at each layer (N = ``batch``, C = K channels,
    H x W image, 3x3, pad 1): ``rounds`` rounds, each timing every algorithm ``repeat`` times in
    turn; the median over all samples, and GFLOP/s counted as the direct conv's multiply-adds
    (Winograd's "effective" rate)."""
    algos = list(algos)
    for a in algos:
        if a not in ALGOS:
            raise ValueError(f"bench conv: algorithm {a!r} is not one of {', '.join(ALGOS)}")
    if int(batch) < 1 or int(rounds) < 1 or int(repeat) < 1:
        raise ValueError("bench conv: batch, rounds and repeat must be >= 1")
    layers = [tuple(int(v) for v in layer) for layer in (layers or RESNET18_3X3)]
    dev = as_device(device)
    out = header("conv", dict(batch=batch, algos=algos, rounds=rounds, repeat=repeat,
                              warmup=warmup, layers=layers, device=str(dev)))
    sync = lambda: _core.synchronize(dev)  # noqa: E731
    rng = np.random.default_rng(0)
    saved = os.environ.get("MGPU_CONV_ALGO")
    rows = []
    try:
        for C, H in layers:
            _say(log, f"bench conv: C=K={C}, {H}x{H}, batch {batch} on {dev} ...")
            x = array(rng.standard_normal((batch, C, H, H), dtype=np.float32), device=dev)._t
            w = array(rng.standard_normal((C, C, 3, 3), dtype=np.float32) / np.sqrt(9 * C),
                      device=dev)._t
            b = array(np.zeros(C, np.float32), device=dev)._t
            dy = array(rng.standard_normal((batch, C, H, H), dtype=np.float32), device=dev)._t
            samples = {(a, p): [] for a in algos for p in ("forward", "backward")}
            calls = {"forward": lambda: _core.conv2d_forward(x, w, b, 1, 1),
                     "backward": lambda: _core.conv2d_backward(x, w, dy, 1, 1, True, True)}
            for r in range(int(rounds)):
                for a in algos:
                    os.environ["MGPU_CONV_ALGO"] = a
                    for phase, fn in calls.items():
                        m = measure(fn, warmup if r == 0 else 0, int(repeat), sync)
                        samples[(a, phase)] += m["times"]
            flops = 2 * batch * C * C * 9 * H * H
            for a in algos:
                row = {"layer": f"{C}ch {H}x{H}", "C": C, "H": H, "algo": a}
                for phase, f in (("forward", flops), ("backward", 2 * flops)):
                    s = summarize(samples[(a, phase)])
                    row[phase] = s
                    row["gflops_" + phase] = f / s["median"] / 1e9
                rows.append(row)
    finally:
        if saved is None:
            os.environ.pop("MGPU_CONV_ALGO", None)
        else:
            os.environ["MGPU_CONV_ALGO"] = saved
    out["layers"] = rows
    return out


def format_conv(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench conv: ResNet-18's 3x3 stride-1 layers on {s['device']}, batch "
             f"{s['batch']}, K = C, pad 1"]
    lines += _machine_lines(r)
    lines.append(f"{s['rounds']} rounds x {s['repeat']} samples per algorithm, interleaved; "
                 "median; GFLOP/s as the direct conv's 2 * N*K*C*9*P*Q (backward: twice that)")
    rows = [[x["layer"], x["algo"], _ms(x["forward"]["median"]), f"{x['gflops_forward']:.0f}",
             _ms(x["backward"]["median"]), f"{x['gflops_backward']:.0f}"]
            for x in r["layers"]]
    lines.append("")
    lines += _table(["layer", "algorithm", "forward ms", "GFLOP/s", "backward ms", "GFLOP/s"],
                    rows, "llrrrr")
    return "\n".join(lines)
