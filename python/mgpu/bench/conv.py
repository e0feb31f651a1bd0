"""``bench conv``: the CPU conv's algorithms (MGPU_CONV_ALGO) side by side at ResNet-18's 3x3
stride-1 layers (or its stride-2 3x3 and 1x1 layers: ``--layers stride2``; LeNet's: ``--layers
lenet``), forward and backward
(dx, dw, db), interleaved round by round so a change of load hits every algorithm alike;
optionally oneDNN's convolution beside them (a peer program, cpp/bench/onednn_conv.cpp, run in
its own process in every round; it times 3x3 stride-1 layers only)."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Dict, Optional, Sequence

import numpy as np

from ..device import as_device
from ..engine import core as _core
from ..tensor import array
from .common import Log, header, machine_lines, measure, ms, say, summarize, table

# ResNet-18's 3x3 stride-1 convs on 28x28 Fashion-MNIST (d2l's resnet18(10, 1)): (C, H) with K = C
RESNET18_3X3 = [(64, 28), (128, 14), (256, 7), (512, 4)]
# Its stride-2 convs, the first of blocks 2-4 and their 1x1 shortcuts: (C, H, K, R, stride, pad)
RESNET18_STRIDE2 = [(64, 28, 128, 3, 2, 1), (128, 14, 256, 3, 2, 1), (256, 7, 512, 3, 2, 1),
                    (64, 28, 128, 1, 2, 0), (128, 14, 256, 1, 2, 0), (256, 7, 512, 1, 2, 0)]
# LeNet's two convs in the multi-GPU chapter (d2l 12.5): 1 -> 20 3x3 on 28x28, 20 -> 50 5x5 on
# 13x13 (the lane kernels' shape, conv2d_cpu/lanes.cpp)
LENET = [(1, 28, 20, 3, 1, 0), (20, 13, 50, 5, 1, 0)]
LAYER_SETS = {"3x3": RESNET18_3X3, "stride2": RESNET18_STRIDE2, "lenet": LENET}
# auto: float32's per-shape rule, what training runs (cpp/ops/conv2d_cpu.cpp); bf16-NAME:
# precision "bf16" (ops/bf16.h) under MGPU_CONV_ALGO=NAME (bf16-auto: the default, float32
# Winograd F(4x4, 3x3) on operands rounded to bfloat16 where float32's auto takes Winograd, and
# bfloat16 pair products on the lane shapes; bf16-winograd: F(2x2, 3x3) with bfloat16 products;
# bf16-direct: im2col with bfloat16 products).
ALGOS = ("auto", "direct", "im2col", "winograd", "bf16-auto", "bf16-direct", "bf16-winograd")


def bench_conv(batch: int = 64, algos: Sequence[str] = ("direct", "winograd"), rounds: int = 3,
               repeat: int = 3, warmup: int = 1, layers=None, log: Log = None,
               device="cpu:0", onednn: Optional[str] = None) -> Dict:
    """Forward and backward time of each algorithm at each layer (N = ``batch``; a layer is
    (C, H): C = K channels, H x H image, 3x3, stride 1, pad 1; or (C, H, K, R, stride, pad), an
    R x R kernel; ``layers`` may also name a set of LAYER_SETS): ``rounds`` rounds, each timing
    every algorithm ``repeat`` times in turn; the median over all samples, and GFLOP/s counted
    as the direct conv's multiply-adds (Winograd's "effective" rate). ``onednn``: the path of
    an onednn_conv_bench program, run in every round after mgpu's algorithms with as many
    OpenMP threads as mgpu uses (its rows: algorithm "onednn", and the implementation oneDNN
    chose), at the 3x3 stride-1 layers with K = C, the only ones the peer times."""
    algos = list(algos)
    for a in algos:
        if a not in ALGOS:
            raise ValueError(f"bench conv: algorithm {a!r} is not one of {', '.join(ALGOS)}")
    if int(batch) < 1 or int(rounds) < 1 or int(repeat) < 1:
        raise ValueError("bench conv: batch, rounds and repeat must be >= 1")
    if onednn is not None and not (os.path.isfile(onednn) and os.access(onednn, os.X_OK)):
        raise ValueError(f"bench conv: --onednn {onednn!r} is not an executable file; make it "
                         "with `bash .ci/peers.sh onednn` (build/peers/onednn/bin/"
                         "onednn_conv_bench)")
    if isinstance(layers, str):
        if layers not in LAYER_SETS:
            raise ValueError(f"bench conv: layers {layers!r} is not one of "
                             f"{', '.join(LAYER_SETS)}")
        layers = LAYER_SETS[layers]
    layers = [tuple(int(v) for v in layer) for layer in (layers or RESNET18_3X3)]
    for layer in layers:
        if len(layer) not in (2, 6):
            raise ValueError(f"bench conv: layer {layer} is neither (C, H) nor "
                             "(C, H, K, R, stride, pad)")
    dev = as_device(device)
    out = header("conv", dict(batch=batch, algos=algos, rounds=rounds, repeat=repeat,
                              warmup=warmup, layers=layers, device=str(dev),
                              onednn=onednn))
    peer_env = dict(os.environ, OMP_NUM_THREADS=str(_core.num_threads()))
    sync = lambda: _core.synchronize(dev)  # noqa: E731
    rng = np.random.default_rng(0)
    saved = os.environ.get("MGPU_CONV_ALGO")
    rows = []
    try:
        for layer in layers:
            C, H, K, R, st, pad = layer if len(layer) == 6 else (*layer, layer[0], 3, 1, 1)
            P = (H + 2 * pad - R) // st + 1
            plain = (K, R, st, pad) == (C, 3, 1, 1)
            name = f"{C}ch {H}x{H}" if plain else f"{C}->{K} {R}x{R} s{st} {H}x{H}"
            say(log, f"bench conv: {name}, batch {batch} on {dev} ...")
            x = array(rng.standard_normal((batch, C, H, H), dtype=np.float32), device=dev)._t
            w = array(rng.standard_normal((K, C, R, R), dtype=np.float32) / np.sqrt(R * R * C),
                      device=dev)._t
            b = array(np.zeros(K, np.float32), device=dev)._t
            dy = array(rng.standard_normal((batch, K, P, P), dtype=np.float32), device=dev)._t
            names = algos + (["onednn"] if onednn and plain else [])
            samples = {(a, p): [] for a in names for p in ("forward", "backward")}
            for r in range(int(rounds)):
                for a in algos:
                    prec = "bf16" if a.startswith("bf16-") else "float32"
                    os.environ["MGPU_CONV_ALGO"] = a.removeprefix("bf16-")
                    calls = {"forward": lambda p=prec: _core.conv2d_forward(
                                 x, w, b, st, pad, precision=p),
                             "backward": lambda p=prec: _core.conv2d_backward(
                                 x, w, dy, st, pad, True, True, precision=p)}
                    for phase, fn in calls.items():
                        m = measure(fn, warmup if r == 0 else 0, int(repeat), sync)
                        samples[(a, phase)] += m["times"]
                if onednn and plain:
                    peer = _run_onednn(onednn, batch, C, H, repeat, warmup, peer_env)
                    for phase in ("forward", "backward"):
                        samples[("onednn", phase)] += [t / 1e3 for t in peer[phase + "_ms"]]
                    out["onednn_impl"] = f"oneDNN {peer['version']}, {peer['impl']}"
            flops = 2 * batch * K * C * R * R * P * P
            for a in names:
                row = {"layer": name, "C": C, "H": H, "K": K, "R": R, "stride": st, "pad": pad,
                       "algo": a}
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


def _run_onednn(path: str, batch: int, C: int, H: int, repeat: int, warmup: int,
                env: Dict[str, str]) -> Dict:
    """One run of the oneDNN peer at one layer: its JSON line (times in ms)."""
    cmd = [path, str(batch), str(C), str(H), str(repeat), str(max(1, warmup))]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"bench conv: {' '.join(cmd)} failed ({p.returncode}): "
                           f"{p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def format_conv(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench conv: layers on {s['device']}, batch {s['batch']} "
             "(\"64ch 28x28\": ResNet-18's K = C, 3x3, stride 1, pad 1; the others as "
             "C->K RxR sS HxH, pad 1 for ResNet-18's 3x3, 0 for its 1x1 and for LeNet's)"]
    lines += machine_lines(r)
    lines.append(f"{s['rounds']} rounds x {s['repeat']} samples per algorithm, interleaved; "
                 "median; GFLOP/s as the direct conv's 2 * N*K*C*R*S*P*Q (backward: twice that)")
    if r.get("onednn_impl"):
        lines.append(f"onednn: {r['onednn_impl']} in its own process, OpenMP threads = mgpu's; "
                     "memory formats its own choice (reorders from NCHW not timed)")
    rows = [[x["layer"], x["algo"], ms(x["forward"]["median"]), f"{x['gflops_forward']:.0f}",
             ms(x["backward"]["median"]), f"{x['gflops_backward']:.0f}"]
            for x in r["layers"]]
    lines.append("")
    lines += table(["layer", "algorithm", "forward ms", "GFLOP/s", "backward ms", "GFLOP/s"],
                   rows, "llrrrr")
    return "\n".join(lines)
