"""``bench train --parts layers``: each layer's forward and backward time in the fused step on one
CPU device (from the step's timeline, mgpu.profile), its FLOPs, GFLOP/s and the percentage of this
CPU's FMA peak, measured here by ``mgpu._core.fma_peak`` (how close each layer comes to the
arithmetic limit)."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from ..engine import core as _core
from .common import (
    Log,
    header,
    lenet_layer_flops,
    machine_lines,
    module_layer_flops,
    say,
    table,
)

# The trace names a fused layer "layer I (KIND) forward" / "... backward" (cpp/train/model.cpp).
_LAYER = re.compile(r"^(layer \d+ \((\w+)\)) (forward|backward)$")
# Trace kinds that hold the FLOPs of layer_flops' entries (in the same order).
_FLOP_KINDS = ("conv2d", "linear", "conv2d_relu_pool", "conv_relu_pool", "fc", "mm")


def layer_flops(model: str, batch_size: int) -> List[Dict]:
    """The FLOPs of the model's conv and matrix-product layers, in the order the fused step runs
    them (2 per multiply-add; forward 2 N K C R S P Q for a conv, backward dW as forward plus dX
    except for the layer reading the input)."""
    if model == "lenet":
        return lenet_layer_flops(batch_size)
    if model == "resnet18":
        from ..models import resnet18
        return module_layer_flops(resnet18(10, 1), (1, 28, 28), batch_size)
    raise ValueError(f"bench train --parts layers: model must be 'lenet' or 'resnet18', "
                     f"got {model!r}")


def layer_table(entries: Sequence[Dict], flops: Sequence[Dict], peak_gflops: float) -> List[Dict]:
    """The per-layer rows from a parsed step timeline (advisor.parse_step_trace's entries: name,
    seconds) and layer_flops: one row per fused layer with its forward and backward seconds, and
    for the layers that multiply (the trace's conv2d / linear kinds, matched in order to
    ``flops``) their FLOPs, GFLOP/s and percent of ``peak_gflops``. A last row sums them."""
    rows: Dict[str, Dict] = {}
    for e in entries:
        m = _LAYER.match(e["name"])
        if not m:
            continue
        row = rows.setdefault(m.group(1), {"layer": m.group(1), "kind": m.group(2),
                                           "forward_s": 0.0, "backward_s": 0.0})
        row[m.group(3) + "_s"] += e["seconds"]
    out = list(rows.values())
    multiplying = [r for r in out if r["kind"] in _FLOP_KINDS]
    if len(multiplying) != len(flops):
        raise ValueError(f"bench train --parts layers: the step's timeline has "
                         f"{len(multiplying)} conv/linear layers, the model's FLOP count "
                         f"{len(flops)}")
    for r, f in zip(multiplying, flops):
        r.update(name=f["layer"], shape=f["shape"], forward_flops=f["forward"],
                 backward_flops=f["backward"])
    total = {"layer": "total", "kind": "", "forward_s": 0.0, "backward_s": 0.0,
             "forward_flops": 0, "backward_flops": 0}
    for r in out:
        for d in ("forward", "backward"):
            total[d + "_s"] += r[d + "_s"]
            if d + "_flops" in r:
                total[d + "_flops"] += r[d + "_flops"]
    for r in out + [total]:
        for d in ("forward", "backward"):
            fl, s = r.get(d + "_flops"), r[d + "_s"]
            if fl is not None and s > 0:
                r[d + "_gflops"] = fl / s / 1e9
                r[d + "_percent_of_peak"] = 100.0 * r[d + "_gflops"] / peak_gflops
    return out + [total]


def measure_peaks(threads: Sequence[int], seconds: float = 0.1, repeat: int = 3) -> List[Dict]:
    """The FMA peak of every path this CPU runs (AVX2, and AVX-512 where it has it) at each
    thread count."""
    isas = ["avx2"] + (["avx512"] if "avx512" in cpu_paths() else [])
    return [_core.fma_peak(isa, t, seconds, repeat) for isa in isas for t in threads]


def cpu_paths() -> List[str]:
    """The CPU kernel paths this CPU runs (avx2, and avx512 where it has AVX-512)."""
    try:
        _core.fma_loop("avx512", 1)
        return ["avx2", "avx512"]
    except ValueError:
        return ["avx2"]


def bench_layers(model: str = "resnet18", batch_size: int = 256, steps: int = 3,
                 warmup: int = 1, log: Log = None, peak_seconds: float = 0.1,
                 precision: str = "float32") -> Dict:
    """Times ``steps`` fused steps of ``model`` on one CPU device (after ``warmup`` untimed ones)
    inside mgpu.profile; each layer's time is the median step's busy time of its kernels. The
    peak is the FMA loop's on the path the kernels run, with the step's thread count.
    ``precision``: the step's ('float32' or 'bf16'; the FLOPs are counted alike, so a bf16
    layer's percent of peak is against the float32 FMA peak and may pass 100)."""
    from ..advisor import parse_step_trace, random_batch, runner, trace_steps
    from ..device import cpu
    if int(batch_size) < 1 or int(steps) < 1 or int(warmup) < 0:
        raise ValueError(f"bench train --parts layers: batch size and steps must be >= 1 and "
                         f"warm-up >= 0, got {batch_size}, {steps}, {warmup}")
    flops = layer_flops(model, int(batch_size))
    threads = _core.num_threads()
    settings = dict(model=model, batch_size=int(batch_size), steps=int(steps),
                    warmup=int(warmup), parts=["layers"], devices=[1], threads=threads,
                    precision=precision)
    out = header("train", settings)
    say(log, f"bench train: the FMA peak (1 and {threads} threads, each path) ...")
    peaks = measure_peaks(sorted({1, threads}), peak_seconds)
    isa = _core.build_info().get("cpu_isa") or "avx2"
    peak = next(p for p in peaks if p["isa"] == isa and p["threads"] == threads)
    say(log, f"bench train: {model} fused step, batch {batch_size}, 1 device, {threads} "
              f"thread(s), {steps} traced step(s) ...")
    dev = cpu(0)
    step = runner(model, [dev], precision=precision)
    X, y = random_batch(int(batch_size))
    for _ in range(int(warmup)):
        step(X, y)
    _core.waitall()
    parsed = parse_step_trace(trace_steps(step, lambda: (X, y), int(steps)), int(steps), str(dev),
                              statistic="median")
    out.update(peaks=peaks, peak={"isa": isa, "threads": threads, "gflops": peak["gflops"]},
               layers=layer_table(parsed["entries"], flops, peak["gflops"]),
               other_seconds=sum(e["seconds"] for e in parsed["entries"]
                                 if not _LAYER.match(e["name"])),
               host_seconds=parsed["host"])
    return out


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_layers(r: Dict) -> str:
    s, p = r["settings"], r["peak"]
    lines = [f"mgpu bench train --parts layers: {s['model']} fused step, batch {s['batch_size']}, "
             f"1 CPU device, {s['threads']} thread(s), {s.get('precision', 'float32')}; median of "
             f"{s['steps']} traced steps"]
    lines += machine_lines(r)
    lines.append("FMA peak measured here (mgpu._core.fma_peak: independent vector FMAs, fastest "
                 "of 3 runs): " + ", ".join(f"{x['isa']} {x['threads']} thread(s) "
                                           f"{x['gflops']:.1f} GFLOP/s" for x in r["peaks"]))
    lines.append(f"% of peak: against {p['isa']} with {p['threads']} thread(s), "
                 f"{p['gflops']:.1f} GFLOP/s. FLOPs: 2 per multiply-add of the direct "
                 "convolution (2 N K C R S P Q forward; backward dW + dX, dW only for the first "
                 "layer): Winograd layers do fewer, so their GFLOP/s are direct-conv-equivalent "
                 "and may pass the peak. Times: each layer's kernels' busy time in the timeline.")
    lines.append("")
    rows = []
    for x in r["layers"]:
        name = x.get("name", "")
        rows.append([x["layer"], name, x.get("shape", ""),
                     f"{x['forward_s'] * 1e3:.3f}", f"{x['backward_s'] * 1e3:.3f}",
                     _num(x.get("forward_flops") and x["forward_flops"] / 1e9, ".3f"),
                     _num(x.get("backward_flops") and x["backward_flops"] / 1e9, ".3f"),
                     _num(x.get("forward_gflops"), ".1f"), _num(x.get("backward_gflops"), ".1f"),
                     _num(x.get("forward_percent_of_peak"), ".0f"),
                     _num(x.get("backward_percent_of_peak"), ".0f")])
    lines += table(["fused layer", "module", "shape", "fwd ms", "bwd ms", "fwd GFLOP",
                     "bwd GFLOP", "fwd GFLOP/s", "bwd GFLOP/s", "fwd %peak", "bwd %peak"], rows,
                    "lllrrrrrrrr")
    lines.append(f"outside the layers: {r['other_seconds'] * 1e3:.3f} ms of device work per step "
                 f"(input copies); host {r['host_seconds'] * 1e3:.3f} ms per step")
    return "\n".join(lines)
