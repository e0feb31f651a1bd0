"""What every benchmark shares: timing with warm-up and repeats, the machine a result was measured
on, LeNet's FLOP counts, the result header and JSON files, and the text tables' helpers."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..engine import core as _core
from ..models import LENET_SHAPES

SCHEMA = "mgpu-bench/1"
Log = Optional[Callable[[str], None]]


def summarize(times: Sequence[float]) -> Dict:
    """Median, min, max and spread = (max - min) / median of raw times, which are kept too."""
    times = [float(t) for t in times]
    if not times:
        raise ValueError("summarize: no times")
    med = statistics.median(times)
    lo, hi = min(times), max(times)
    return {"median": med, "min": lo, "max": hi,
            "spread": (hi - lo) / med if med > 0 else 0.0, "n": len(times), "times": times}


def measure(fn: Callable[[], object], warmup: int, repeat: int,
            sync: Callable[[], None] = _core.waitall, min_time: float = 0.0) -> Dict:
    """Times ``fn`` (then ``sync``): ``warmup`` untimed calls, then ``repeat`` samples.

    With ``min_time`` > 0 a sample is ``inner`` back-to-back calls followed by one sync, with
    ``inner`` chosen so a sample lasts about ``min_time`` seconds; times are per call.
    """
    if repeat < 1:
        raise ValueError(f"measure: repeat must be >= 1, got {repeat}")
    for _ in range(max(0, warmup)):
        fn()
        sync()
    inner = 1
    if min_time > 0:
        t0 = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - t0
        inner = max(1, min(10000, math.ceil(min_time / max(once, 1e-7))))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    out = summarize(times)
    out["inner"] = inner
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> Dict:
    """Where a result was measured: CPUs, load, mgpu build and threads, Python and NumPy."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "nproc": usable, "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(),
        "loadavg": load, "platform": platform.platform(), "python": platform.python_version(),
        "numpy": np.__version__, "mgpu_version": _core.build_info()["version"],
        "mgpu_threads": _core.num_threads(), "build_info": dict(_core.build_info()),
        "num_gpus": _core.num_gpus(),
    }


def header(benchmark: str, settings: Dict) -> Dict:
    return {"schema": SCHEMA, "benchmark": benchmark,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
            "settings": settings}


def say(log: Log, msg: str) -> None:
    if log is not None:
        log(msg)


def lenet_layer_flops(batch_size: int, image=(28, 28)) -> List[Dict]:
    """FLOPs (2 per multiply-add) of LeNet's conv and matrix-product layers for one batch.

    Shapes come from ``LENET_SHAPES`` and the image size: conv (K, C, R, S) at stride 1 without
    padding, each followed by 2x2 average pooling, then the two matrix products. Backward costs
    dw (same as forward) plus dx, except the first conv, whose input X needs no gradient.
    Elementwise ops, pooling and the loss are left out (a few percent).
    """
    n = int(batch_size)
    c, h, w = 1, int(image[0]), int(image[1])
    layers = []
    for name, idx in (("conv1", 0), ("conv2", 2)):
        k, cw, r, s = LENET_SHAPES[idx]
        if cw != c:
            raise ValueError(f"lenet_layer_flops: {name} expects {cw} channels, got {c}")
        p, q = h - r + 1, w - s + 1
        fwd = 2 * n * k * p * q * c * r * s
        layers.append({"layer": name, "kind": "conv", "forward": fwd,
                       "backward": fwd * (1 if idx == 0 else 2),
                       "shape": f"x ({n}, {c}, {h}, {w}) * w ({k}, {c}, {r}, {s})"})
        c, h, w = k, p // 2, q // 2
    features = c * h * w
    for name, idx in (("fc1", 4), ("fc2", 6)):
        kin, kout = LENET_SHAPES[idx]
        if kin != features:
            raise ValueError(f"lenet_layer_flops: {name} expects {kin} inputs, got {features}")
        fwd = 2 * n * kin * kout
        layers.append({"layer": name, "kind": "mm", "forward": fwd, "backward": 2 * fwd,
                       "shape": f"({n}, {kin}) @ ({kin}, {kout})"})
        features = kout
    return layers


def lenet_step_flops(batch_size: int) -> int:
    """FLOPs of one training step (forward + backward) on a minibatch of ``batch_size``."""
    return sum(x["forward"] + x["backward"] for x in lenet_layer_flops(batch_size))


def module_layer_flops(net, input_chw, batch_size: int) -> List[Dict]:
    """FLOPs (2 per multiply-add) of the conv and linear layers of an ``mgpu.nn`` network
    (Sequential, Conv2d, Linear, models.Residual, and shape-keeping or pooling layers) for one
    batch of ``input_chw`` images. Backward costs dw (as forward) plus dx, except a layer reading
    the network's input, whose gradient nobody needs. Batch norm, ReLU, pooling, the residual
    add and the loss are left out (a few percent)."""
    from ..models import Residual
    from ..nn import AdaptiveAvgPool2d, AvgPool2d, Conv2d, Flatten, Linear, Sequential
    n = int(batch_size)
    layers: List[Dict] = []

    def walk(m, shape, name, is_input):
        if isinstance(m, Sequential):
            for child_name, child in m._modules.items():
                shape = walk(child, shape, f"{name}.{child_name}" if name else child_name,
                             is_input)
                is_input = False
            return shape
        if isinstance(m, Residual):
            y = walk(m.conv1, shape, name + ".conv1", is_input)
            y = walk(m.conv2, y, name + ".conv2", False)
            if m.conv3 is not None:
                walk(m.conv3, shape, name + ".conv3", is_input)
            return y
        if isinstance(m, Conv2d):
            c, h, w = shape
            k, _, r, s = m.weight.shape
            p = (h + 2 * m.padding - r) // m.stride + 1
            q = (w + 2 * m.padding - s) // m.stride + 1
            fwd = 2 * n * k * p * q * c * r * s
            layers.append({"layer": name, "kind": "conv", "forward": fwd,
                           "backward": fwd * (1 if is_input else 2),
                           "shape": f"x ({n}, {c}, {h}, {w}) * w ({k}, {c}, {r}, {s}) stride "
                                    f"{m.stride}"})
            return (k, p, q)
        if isinstance(m, Linear):
            kout, kin = m.weight.shape
            fwd = 2 * n * kin * kout
            layers.append({"layer": name, "kind": "mm", "forward": fwd,
                           "backward": fwd * (1 if is_input else 2),
                           "shape": f"({n}, {kin}) @ ({kin}, {kout})"})
            return (kout,)
        if isinstance(m, AdaptiveAvgPool2d):
            return (shape[0], 1, 1)
        if isinstance(m, Flatten):
            return (int(np.prod(shape)),)
        if isinstance(m, AvgPool2d):
            (kh, kw), (sh, sw) = m.kernel_size, m.stride
            return (shape[0], (shape[1] - kh) // sh + 1, (shape[2] - kw) // sw + 1)
        return shape  # batch norm, ReLU: same shape

    walk(net, tuple(input_chw), "", True)
    return layers


def module_step_flops(net, input_chw, batch_size: int) -> int:
    """FLOPs of one training step (forward + backward) of ``net``; see module_layer_flops."""
    return sum(x["forward"] + x["backward"] for x in module_layer_flops(net, input_chw,
                                                                        batch_size))


def plural(k: int, what: str) -> str:
    return f"{k} {what}{'s' if k != 1 else ''}"


def ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}"


def fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}%"


def machine_lines(r: Dict) -> List[str]:
    m = r["machine"]
    b = m["build_info"]
    load = m.get("loadavg")
    lines = [f"machine: {m['nproc']} CPUs ({m['cpu_model']}), load average "
             f"{load[0]:.1f}" if load else f"machine: {m['nproc']} CPUs ({m['cpu_model']})"]
    lines.append(f"mgpu {m['mgpu_version']}: {m['mgpu_threads']} threads, BLAS {b.get('blas')}, "
                 f"CUDA {b.get('cuda')}, GPUs {m['num_gpus']}; Python {m['python']}, "
                 f"NumPy {m['numpy']}")
    if b.get("cpu_isa"):
        lines.append(f"CPU kernels: {b['cpu_isa']} ({b.get('cpu_isa_reason')}); engine "
                     f"{b.get('cpu_baseline')}")
    return lines


def table(header: List[str], rows: List[List[str]], align: str) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def save(r: Dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=1)
        f.write("\n")


def load(path: str) -> Dict:
    """A result written with ``--json`` (for notebooks: ``mgpu.bench.plot(mgpu.bench.load(p))``)."""
    with open(path) as f:
        r = json.load(f)
    if r.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an mgpu bench result (schema {r.get('schema')!r})")
    return r
