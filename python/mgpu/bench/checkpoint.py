"""``bench checkpoint``: time to write and to load a training checkpoint (``mgpu.save`` /
``mgpu.load``: SHA-256, fsync and rename included) for LeNet and ResNet-18, wall clock and
process CPU time, with the file's size."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Dict, Optional, Sequence

import numpy as np

from .common import Log, fmt_pct, header, machine_lines, ms, say, summarize, table

MODELS = ("lenet", "resnet18")


def _state(model: str, momentum: bool) -> Dict:
    """What ``train`` / ``train_concise`` checkpoint for ``model`` (parameters, BatchNorm
    buffers, SGD's momentum buffers when ``momentum``)."""
    from .. import models, optim, random
    random.seed(0)
    if model == "lenet":
        params = [p.numpy() for p in models.lenet_params(seed=0)]
        state = {"params": params}
        if momentum:
            state["momentum"] = [np.zeros_like(p) for p in params]
        return state
    if model == "resnet18":
        net = models.resnet18(10, 1)
        trainer = optim.SGD(net.parameters(), 0.1, momentum=0.9 if momentum else 0.0)
        opt = trainer.state_dict()
        if momentum:  # the buffers a first step creates
            opt["state"] = {i: {"momentum_buffer": p.detach()}
                            for i, p in enumerate(trainer.params)}
        return {"model": net.state_dict(), "optimizer": opt}
    raise ValueError(f"bench checkpoint: unknown model {model!r}; choose from {', '.join(MODELS)}")


def bench_checkpoint(models: Sequence[str] = MODELS, momentum: bool = True, warmup: int = 1,
                     repeat: int = 5, directory: Optional[str] = None, log: Log = None) -> Dict:
    """Writes and loads each model's checkpoint ``repeat`` times (after ``warmup``) in
    ``directory`` (default: a new temporary directory); records wall and process CPU times."""
    from .. import checkpoint
    if repeat < 1:
        raise ValueError(f"bench checkpoint: repeat must be >= 1, got {repeat}")
    out = header("checkpoint", dict(models=list(models), momentum=bool(momentum),
                                    warmup=warmup, repeat=repeat))
    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out["settings"]["directory"] = os.path.dirname(tmp)
        for model in models:
            say(log, f"bench checkpoint: {model} ...")
            state = _state(model, momentum)
            path = os.path.join(tmp, f"{model}.mgpu")
            times: Dict[str, list] = {"save": [], "save_cpu": [], "load": [], "load_cpu": []}
            for i in range(max(0, warmup) + repeat):
                w0, c0 = time.perf_counter(), time.process_time()
                checkpoint.save(state, path)
                w1, c1 = time.perf_counter(), time.process_time()
                checkpoint.load(path)
                w2, c2 = time.perf_counter(), time.process_time()
                if i >= warmup:
                    times["save"].append(w1 - w0)
                    times["save_cpu"].append(c1 - c0)
                    times["load"].append(w2 - w1)
                    times["load_cpu"].append(c2 - c1)
            size = os.path.getsize(path)
            tensors = checkpoint.read_file(path)[1]
            numel = sum(a.size for a in tensors.values())
            rows.append({"model": model, "bytes": size, "numel": int(numel),
                         **{k: summarize(v) for k, v in times.items()}})
    out["models"] = rows
    return out


def format_checkpoint(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench checkpoint: mgpu.save + mgpu.load of a training checkpoint "
             f"({'with' if s['momentum'] else 'without'} momentum buffers) in {s['directory']}"]
    lines += machine_lines(r)
    lines.append(f"{s['warmup']} warm-up rounds, {s['repeat']} samples; median, spread = "
                 "(max - min) / median; save = encode + SHA-256 + write + fsync + rename + "
                 "directory fsync; load = read + verify + decode; CPU = this process's CPU time")
    rows = [[x["model"], f"{x['numel'] / 1e6:.2f}", f"{x['bytes'] / 1e6:.1f}",
             ms(x["save"]["median"]), fmt_pct(100 * x["save"]["spread"]),
             ms(x["save_cpu"]["median"]), ms(x["load"]["median"]),
             fmt_pct(100 * x["load"]["spread"]), ms(x["load_cpu"]["median"]),
             f"{x['bytes'] / x['save']['median'] / 1e6:.0f}",
             f"{x['bytes'] / x['load']['median'] / 1e6:.0f}"]
            for x in r["models"]]
    lines += table(["model", "M values", "MB", "save ms", "spread", "save CPU ms", "load ms",
                     "spread", "load CPU ms", "save MB/s", "load MB/s"], rows, "lrrrrrrrrrr")
    return "\n".join(lines)
