"""Any bench result drawn with matplotlib."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np


def plot(r: Dict, path: Optional[str] = None, ax=None):
    """Draws a result (matplotlib) and returns the Figure; writes it to ``path`` when given.

    train: ms/step per configuration with min-max error bars; ops: forward and backward ms per
    op; allreduce: busbw against size per k, with the copy baselines as lines; conv: each
    algorithm's forward and backward ms per layer; isa: conv2 and the fused steps per build and
    kernel path.
    """
    from matplotlib.figure import Figure
    fig = None
    if ax is None:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
    kind = r["benchmark"]
    if kind == "train" and "layers" in r:
        # bench train --parts layers: each multiplying layer's GFLOP/s against the FMA peak.
        rows = [x for x in r["layers"][:-1] if "forward_gflops" in x]
        pos = np.arange(len(rows))
        ax.barh(pos - 0.2, [x["forward_gflops"] for x in rows], 0.4, label="forward")
        ax.barh(pos + 0.2, [x.get("backward_gflops", 0.0) for x in rows], 0.4, label="backward")
        ax.axvline(r["peak"]["gflops"], color="k", linewidth=0.8,
                   label=f"FMA peak ({r['peak']['isa']}, {r['peak']['threads']} thr.)")
        ax.set_yticks(pos, [x["name"] for x in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("GFLOP/s (direct-conv FLOPs)")
        ax.legend(fontsize=7)
    elif kind == "train":
        runs = r["results"] + r.get("scaling", {}).get("runs", [])
        names = [x["name"] for x in runs]
        med = np.array([x["sec_per_step"]["median"] for x in runs]) * 1e3
        lo = med - np.array([x["sec_per_step"]["min"] for x in runs]) * 1e3
        hi = np.array([x["sec_per_step"]["max"] for x in runs]) * 1e3 - med
        colors = ["C0" if x.get("impl", "mgpu").startswith("mgpu") else
                  "C2" if x["impl"].startswith("jax") else "C1" for x in runs]
        ax.barh(range(len(runs)), med, xerr=[lo, hi], color=colors)
        ax.set_yticks(range(len(runs)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median, min-max)")
        ax.set_title(f"LeNet step, batch {r['settings']['batch_size']}")
    elif kind == "ops":
        n = r["settings"]["batch_sizes"][-1]
        rows = [x for x in r["ops"] if x["batch"] == n]
        idx = np.arange(len(rows))
        ax.bar(idx - 0.2, [x["forward"]["median"] * 1e3 for x in rows], 0.4, label="forward")
        ax.bar(idx + 0.2, [x["backward"]["median"] * 1e3 for x in rows], 0.4, label="backward")
        ax.set_xticks(idx, [x["op"].split(" (")[0] for x in rows], rotation=60, fontsize=7)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"LeNet ops on cpu(0), batch {n}")
        ax.legend()
    elif kind == "allreduce":
        for k in r["settings"]["devices"]:
            rows = [x for x in r["results"] if x["devices"] == k]
            ax.plot([x["bytes"] for x in rows], [x["busbw"] / 1e9 for x in rows], marker="o",
                    label=f"allreduce busbw, k={k}")
        for i, b in enumerate(r["baselines"]):
            ax.axhline(b["bandwidth"] / 1e9, color=f"C{5 + i}", linestyle="--", label=b["name"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("GB/s")
        ax.set_title("mgpu.allreduce over CPU devices")
        ax.legend(fontsize=7)
    elif kind == "batch_norm":
        rows = r["ops"]
        ax.bar(np.arange(len(rows)), [x["gbps"] for x in rows])
        ax.set_xticks(np.arange(len(rows)), [x["op"] for x in rows], rotation=30, fontsize=7)
        ax.set_ylabel("GB/s (bytes read + written / median time)")
        ax.set_title(f"batch norm {tuple(r['settings']['shape'])} on {r['settings']['device']}")
    elif kind == "checkpoint":
        rows = r["models"]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [m["save"]["median"] * 1e3 for m in rows], 0.4, label="save")
        ax.bar(x + 0.2, [m["load"]["median"] * 1e3 for m in rows], 0.4, label="load")
        ax.set_xticks(x, [f"{m['model']} ({m['bytes'] / 1e6:.1f} MB)" for m in rows])
        ax.set_ylabel("ms (median)")
        ax.set_title("checkpoint write and load")
        ax.legend()
    elif kind == "conv":
        # Each layer: every algorithm's forward and backward, median ms.
        algos = list(dict.fromkeys(x["algo"] for x in r["layers"]))
        layers = list(dict.fromkeys(x["layer"] for x in r["layers"]))
        by = {(x["layer"], x["algo"]): x for x in r["layers"]}
        width = 0.8 / (2 * len(algos))
        idx = np.arange(len(layers))
        for i, (algo, phase) in enumerate((a, p) for a in algos for p in ("forward", "backward")):
            ax.bar(idx + (i - (2 * len(algos) - 1) / 2) * width,
                   [by[(layer, algo)][phase]["median"] * 1e3 if (layer, algo) in by else 0.0
                    for layer in layers], width, label=f"{algo} {phase}")
        ax.set_xticks(idx, layers, fontsize=7)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"conv2d algorithms, batch {r['settings']['batch']}")
        ax.legend(fontsize=7)
    elif kind == "isa":
        # Each build and kernel path: conv2 and the fused steps, median over the rounds, min-max.
        from .isa import op_entry
        s = r["settings"]
        figures = [("conv2 forward", lambda p: op_entry(p["ops"], "conv2")["forward"]),
                   ("conv2 backward", lambda p: op_entry(p["ops"], "conv2")["backward"]),
                   (f"fused step, batch {s['ops_batch']}", lambda p: p["ops_step"]),
                   (f"fused step, batch {s['batch_size']}", lambda p: p["train_step"])]
        runs = [(f"{label} {isa}", p) for label, per in r["paths"].items()
                for isa, p in per.items()]
        width = 0.8 / len(runs)
        idx = np.arange(len(figures))
        for i, (name, p) in enumerate(runs):
            stats = [f(p) for _, f in figures]
            med = np.array([x["median"] for x in stats]) * 1e3
            err = [med - np.array([x["min"] for x in stats]) * 1e3,
                   np.array([x["max"] for x in stats]) * 1e3 - med]
            ax.bar(idx + (i - (len(runs) - 1) / 2) * width, med, width, yerr=err, label=name)
        ax.set_xticks(idx, [name for name, _ in figures], fontsize=7)
        ax.set_ylabel("ms (median over the rounds, min-max)")
        ax.set_title("LeNet under each CPU kernel path")
        ax.legend(fontsize=7)
    else:
        raise ValueError(f"plot: unknown benchmark {kind!r}")
    ax.grid(True, alpha=0.3)
    fig = fig or ax.figure
    if path:
        fig.savefig(path, dpi=120)
    return fig
