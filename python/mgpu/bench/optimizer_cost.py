"""What the optimizer costs in ResNet-18's fused step (``DataParallel.train_step``) on k CPU
devices: SGD (the book's) against AdamW, AdamW with clipping by global norm, and more, each on its
own copy of the same network. Rounds interleave the configurations (in a rotating order), so a
machine whose load drifts slows them alike; each round times ``--steps`` steps of each (wall and
process CPU time) and traces one more, from which the update phase alone is read (the "sgd update"
spans of every device's tracks, less the time spent there waiting for the other devices). Medians
over the rounds; ratios against SGD.

    python -m mgpu.bench.optimizer_cost --devices 1,2 --batch-size 64 --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

#: name -> (optimizer, clip_grad_norm, amsgrad); lr: SGD 0.1 (the book's), Adam's 1e-3.
CONFIGS = {
    "sgd": ("sgd", None, False),
    "adamw": ("adamw", None, False),
    "adamw+clip": ("adamw", 1.0, False),
    "adamw+clip+amsgrad": ("adamw", 1.0, True),
    "sgd+clip": ("sgd", 1.0, False),
}
DEFAULT_CONFIGS = ("sgd", "adamw", "adamw+clip")


def update_seconds(events: List[Dict]) -> float:
    """The update phase of one traced step: per device (its queue's track and its comm track),
    the "sgd update" spans less the "wait for peers" spans inside them; the largest device's."""
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    per_device: Dict[str, float] = {}
    for u in (e for e in spans if e.get("cat") == "layer" and e["name"] == "sgd update"):
        end = u["ts"] + u["dur"]
        waits = sum(w["dur"] for w in spans
                    if w["name"] == "wait for peers" and w["tid"] == u["tid"]
                    and u["ts"] <= w["ts"] and w["ts"] + w["dur"] <= end)
        device = names.get(u["tid"], str(u["tid"])).replace(" comm", "")
        per_device[device] = per_device.get(device, 0.0) + (u["dur"] - waits) * 1e-6
    if not per_device:
        raise RuntimeError("optimizer_cost: the traced step holds no 'sgd update' span")
    return max(per_device.values())


class _Side:
    """One configuration: its own network (the same initial weights as the others), model and
    optimizer, and a step."""

    def __init__(self, name: str, devices, batch_size: int, seed: int):
        from .. import nn
        from ..chapter import make_optimizer
        from ..models import resnet18
        from ..random import seed as mgpu_seed
        from ..tensor import array
        optimizer, self.clip, amsgrad = CONFIGS[name]
        self.name = name
        mgpu_seed(seed)
        net = resnet18(10, 1)
        self.model = nn.DataParallel(net, device_ids=devices)
        self.trainer = make_optimizer(self.model.parameters(), 0.1 if optimizer == "sgd" else 1e-3,
                                      optimizer)
        if amsgrad:
            self.trainer.param_groups[0]["amsgrad"] = True
        self.loss = nn.CrossEntropyLoss()
        rng = np.random.default_rng(seed)
        self.X = array(rng.random((batch_size, 1, 28, 28), dtype=np.float32), device=devices[0])
        self.y = array(rng.integers(0, 10, batch_size).astype(np.int64), device=devices[0])

    def step(self) -> None:
        self.model.train_step(self.X, self.y, self.loss, self.trainer,
                              clip_grad_norm=self.clip)


def _sample(side: _Side, steps: int) -> Dict[str, float]:
    from ..engine import core as _core
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        side.step()
    _core.waitall()
    return {"wall": (time.perf_counter() - t0) / steps,
            "cpu": (time.process_time() - c0) / steps}


def _traced_update(side: _Side, path: str) -> float:
    from ..engine import core as _core
    from ..trace import profile
    with profile(path):
        side.step()
        _core.waitall()
    with open(path) as f:
        return update_seconds(json.load(f)["traceEvents"])


def bench_optimizer_cost(devices: Sequence[int] = (1, 2), batch_size: int = 64, rounds: int = 5,
                         steps: int = 3, warmup: int = 2, configs: Sequence[str] = DEFAULT_CONFIGS,
                         seed: int = 0, log=None) -> Dict:
    """Runs the comparison (see the module's docstring) and returns its results as a dict."""
    from ..device import cpu
    from ..engine import core as _core
    from .common import header, say, summarize
    configs = list(configs)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"optimizer_cost: configs must be some of {', '.join(CONFIGS)}, got "
                         f"{configs}")
    for name, v in (("batch_size", batch_size), ("rounds", rounds), ("steps", steps)):
        if int(v) < 1:
            raise ValueError(f"optimizer_cost: {name} must be >= 1, got {v}")
    out = header("optimizer_cost", dict(model="resnet18", devices=list(devices),
                                        batch_size=batch_size, rounds=rounds, steps=steps,
                                        warmup=warmup, configs=configs, seed=seed))
    out["threads"] = _core.num_threads()
    results: List[Dict] = []
    out["results"] = results
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        for k in devices:
            devs = [cpu(i) for i in range(int(k))]
            sides = [_Side(c, devs, int(batch_size), seed) for c in configs]
            for s in sides:
                for _ in range(max(0, int(warmup))):
                    s.step()
            _core.waitall()
            raw: Dict[str, Dict[str, List[float]]] = {
                s.name: {"wall": [], "cpu": [], "update": []} for s in sides}
            for r in range(int(rounds)):
                say(log, f"optimizer_cost: {k} device(s), round {r + 1} of {rounds}")
                for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                    t = _sample(s, int(steps))
                    raw[s.name]["wall"].append(t["wall"])
                    raw[s.name]["cpu"].append(t["cpu"])
                    raw[s.name]["update"].append(_traced_update(s, path))
            base = raw[configs[0]]
            for s in sides:
                x = raw[s.name]
                entry = {"config": s.name, "num_devices": int(k),
                         **{key: summarize(x[key]) for key in ("wall", "cpu", "update")}}
                # The ratio of medians, and the median of each round's ratio (both vary less
                # than either median alone when the load drifts between rounds).
                for key in ("wall", "cpu", "update"):
                    entry[f"{key}_ratio"] = (statistics.median(x[key])
                                             / statistics.median(base[key]))
                    entry[f"{key}_ratio_paired"] = statistics.median(
                        a / b for a, b in zip(x[key], base[key]))
                results.append(entry)
            del sides
    finally:
        os.unlink(path)
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    return out


def format_optimizer_cost(r: Dict) -> str:
    s = r["settings"]
    m = r["machine"]
    lines = [f"ResNet-18 fused step (DataParallel.train_step), batch {s['batch_size']}, "
             f"{r['threads']} thread(s); {s['rounds']} interleaved rounds of {s['steps']} "
             f"steps per configuration, medians; ratios against {s['configs'][0]} (per round, "
             "then the median)",
             f"CPU: {m.get('cpu_model', '?')}; load average at the start {m.get('loadavg')}, "
             f"at the end {m.get('loadavg_end')}"]
    lines.append(f"{'configuration':<22}{'devices':>8}{'ms/step':>10}{'cpu ms':>10}"
                 f"{'update ms':>11}{'step x':>9}{'update x':>10}")
    for e in r["results"]:
        lines.append(f"{e['config']:<22}{e['num_devices']:>8}"
                     f"{e['wall']['median'] * 1e3:>10.1f}{e['cpu']['median'] * 1e3:>10.1f}"
                     f"{e['update']['median'] * 1e3:>11.2f}{e['wall_ratio_paired']:>9.3f}"
                     f"{e['update_ratio_paired']:>10.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mgpu.bench.optimizer_cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="1,2", help="CPU device counts, e.g. 1,2")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="from: " + ",".join(CONFIGS) + " (the first is the baseline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every raw timing as JSON")
    args = p.parse_args(argv)
    try:
        devices = [int(x) for x in args.devices.split(",")]
    except ValueError:
        p.error(f"--devices must be numbers like 1,2, got {args.devices!r}")
    r = bench_optimizer_cost(devices, args.batch_size, args.rounds, args.steps, args.warmup,
                             args.configs.split(","), args.seed,
                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_optimizer_cost(r))
    if args.json:
        from .common import save
        save(r, args.json)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
