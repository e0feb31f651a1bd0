"""``bench train``: the chapter's training step (sec. 12.5.6) fused and op by op, scaling, the data
pipeline, evaluation, achieved FLOP/s, and optionally the chapters' PyTorch and JAX code run by
other interpreters (``torch_rival.py``, ``jax_rival.py``, launched by rivals.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..amp import autocast, check_precision
from ..data import DataLoader, find_data_dir
from ..device import cpu, try_gpu
from ..engine import core as _core
from ..models import lenet_params
from ..parallel import get_params, train_batch
from ..tensor import array
from . import rival_common
from .common import (
    Log,
    fmt_pct,
    header,
    lenet_layer_flops,
    lenet_step_flops,
    machine_info,
    machine_lines,
    measure,
    module_step_flops,
    ms,
    plural,
    say,
    summarize,
    table,
)
from .rivals import (
    FRAMEWORK,
    RIVALS,
    find_rivals,
    package_root,
    parse_compare,
    rival_entry,
    run_rival,
)


def _synthetic_split(n: int, seed: int):
    # The rivals' draw (rival_common.synthetic_split), so every side trains on identical data.
    return _core.make_split(*rival_common.synthetic_split(n, seed))


def _full_batches(split, batch_size: int) -> int:
    return -(-int(split.num_examples) // int(batch_size))


def _time_training(name: str, step, split, batch_size: int, epochs: int, limit: int, warmup: int,
                   seed: int, **info) -> Dict:
    """``warmup`` untimed steps, then ``epochs`` timed epochs of at most ``limit`` batches each.

    An epoch is timed as ``train`` times it: steps are enqueued back to back and the host waits
    once at the end, so asynchronous work overlaps as it does in real training.
    """
    if warmup > 0:
        for X, y in DataLoader(split, batch_size, True, seed + 1, warmup):
            step(X, y)
        _core.waitall()
    loader = DataLoader(split, batch_size, True, seed, limit)
    times, losses = [], []
    for _ in range(epochs):
        outs = []
        t0 = time.perf_counter()
        for X, y in loader:
            outs.append(step(X, y))
        _core.waitall()
        times.append(time.perf_counter() - t0)
        if outs and outs[0] is not None:
            losses.append(sum(v.item() for out in outs for v in out) / loader.num_examples)
    steps, full = len(loader), _full_batches(split, batch_size)
    per_step = summarize([t / steps for t in times])
    result = {"name": name, "epoch_times": times, "steps_per_epoch": steps,
              "full_batches": full, "sec_per_step": per_step,
              "sec_per_epoch": per_step["median"] * full, "extrapolated": steps != full,
              "global_batch": batch_size, "images_per_sec": batch_size / per_step["median"]}
    if losses:
        result["train_loss"] = losses
    result.update(info)
    return result


TRAIN_PARTS = ("fused", "op-by-op", "scaling", "pipeline", "eval", "flops", "deterministic")


def bench_train(devices: Sequence[int] = (1, 2), batch_size: int = 256, lr: float = 0.2,
                epochs: int = 3, limit_batches: Optional[int] = 20, warmup: int = 3,
                repeat: int = 3, data_dir: Optional[str] = None, synthetic: int = 0,
                seed: int = 0, compare: Optional[str] = None, torch_python: Optional[str] = None,
                torch_threads: int = 2, parts: Sequence[str] = TRAIN_PARTS,
                gemm_size: int = 1024, log: Log = None, model: str = "lenet",
                weak_scaling: bool = False, jax_python: Optional[str] = None,
                jax_threads: int = 2, optimizer: str = "sgd",
                weight_decay: Optional[float] = None,
                clip_grad_norm: Optional[float] = None,
                precisions: Sequence[str] = ("float32",)) -> Dict:
    """Times LeNet training on Fashion-MNIST (or ``synthetic`` random images); returns a dict.
    ``model='resnet18'``: bench_train_resnet18 instead (``repeat`` and ``gemm_size`` unused;
    ``optimizer``, ``weight_decay`` and ``clip_grad_norm`` are its, as ``mgpu train``'s).
    ``precisions`` ('float32', 'bf16'): LeNet's fused part runs once per precision (the bf16
    rows' impl is "mgpu fused bf16"), the other parts in float32.

    Each training configuration runs ``warmup`` untimed batches, then ``epochs`` timed epochs
    cut at ``limit_batches`` (0 or None: whole epochs); sec/epoch is the median sec/step times
    the batches of a whole epoch, marked ``extrapolated`` when epochs were cut. ``parts``:
    fused (``train_batch`` on each k in ``devices``), op-by-op (``mgpu.chapter.train_batch``),
    scaling (batch 2b on 2 devices vs b on 1 device with 1 thread), pipeline (the train loader
    alone), eval (``evaluate_accuracy`` on all devices), flops (achieved GFLOP/s vs an sgemm of
    ``gemm_size``, ``repeat`` samples like pipeline and eval), layers (alone, either model: each
    layer's ms, GFLOP/s and % of the measured FMA peak, ``limit_batches`` traced steps; see
    bench.layers). ``compare='torch'`` also runs the
    chapter's PyTorch code and an nn.Sequential version with ``torch_threads`` threads;
    ``compare='jax'`` the JAX chapter's pmap_step on each k in ``devices`` host devices, with
    ``jax_threads`` CPUs (``jax_python``: default ``jax_python_candidates()``);
    ``compare='torch,jax'`` both. A rival whose interpreter is not found is skipped, with the
    reason in the result (a wrong explicit interpreter is a ValueError).
    """
    if "layers" in parts:
        # Its own run: one device, traced steps, the FMA peak (see bench.layers).
        if list(parts) != ["layers"]:
            raise ValueError(f"bench train: --parts layers runs alone, got {list(parts)}")
        from .layers import bench_layers
        if len(precisions) != 1:
            raise ValueError(f"bench train: --parts layers takes one --precision, got "
                             f"{list(precisions)}")
        return bench_layers(model, batch_size, steps=max(1, int(limit_batches or 3)),
                            warmup=max(1, int(warmup)), log=log,
                            precision=check_precision(precisions[0], "bench train: precision"))
    if model == "resnet18":
        return bench_train_resnet18(devices, batch_size, lr, epochs, limit_batches, warmup,
                                    data_dir, synthetic, seed, compare, torch_python,
                                    torch_threads, parts, log, weak_scaling=weak_scaling,
                                    jax_python=jax_python, jax_threads=jax_threads,
                                    optimizer=optimizer, weight_decay=weight_decay,
                                    clip_grad_norm=clip_grad_norm, precisions=precisions)
    if (optimizer, weight_decay, clip_grad_norm) != ("sgd", None, None):
        raise ValueError("bench train: --optimizer, --weight-decay and --clip-grad-norm need "
                         "--model resnet18 (LeNet's step is the chapter's plain SGD)")
    precisions = [check_precision(p, "bench train: precision") for p in precisions]
    if not precisions or len(set(precisions)) != len(precisions):
        raise ValueError(f"bench train: precisions must name float32 and/or bf16 once each, got "
                         f"{list(precisions)}")
    if weak_scaling:
        raise ValueError("bench train: --weak-scaling is for --model resnet18 (LeNet's scaling "
                         "part times batch 2b on 2 devices against b on 1 already)")
    if model != "lenet":
        raise ValueError(f"bench train: model must be 'lenet' or 'resnet18', got {model!r}")
    devices = [int(k) for k in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"bench train: devices must be numbers of devices >= 1, got {devices}")
    for name, v in (("batch_size", batch_size), ("epochs", epochs), ("repeat", repeat)):
        if int(v) < 1:
            raise ValueError(f"bench train: {name} must be >= 1, got {v}")
    unknown = set(parts) - set(TRAIN_PARTS)
    if unknown:
        raise ValueError(f"bench train: unknown parts {sorted(unknown)}; choose from {TRAIN_PARTS}")
    # Before anything is timed, so a wrong --compare or --torch-python fails fast.
    rivals = find_rivals(parse_compare(compare), {"torch": torch_python, "jax": jax_python})
    limit = int(limit_batches or 0)
    warmup = max(0, int(warmup))
    if synthetic:
        train_split = _synthetic_split(int(synthetic), seed)
        test_split = _synthetic_split(max(1, int(synthetic) // 6), seed + 1)
        data = {"source": "synthetic", "train_examples": int(synthetic)}
    else:
        data_dir = find_data_dir(data_dir)
        train_split, test_split = _core.load_fashion_mnist(data_dir)
        data = {"source": "fashion-mnist", "dir": data_dir}
    data.update(train_examples=int(train_split.num_examples),
                test_examples=int(test_split.num_examples))
    if data["train_examples"] < int(batch_size):
        # Smaller batches would be timed as if they were full ones (a flattering figure).
        raise ValueError(f"bench train: the training set has {data['train_examples']} examples, "
                         f"fewer than one batch of {batch_size}; use --synthetic >= "
                         f"--batch-size or a smaller --batch-size")
    settings = dict(devices=devices, batch_size=batch_size, lr=lr, epochs=epochs,
                    limit_batches=limit, warmup=warmup, repeat=repeat, seed=seed,
                    compare=compare, torch_threads=torch_threads, jax_threads=jax_threads,
                    parts=list(parts), gemm_size=gemm_size, data=data, precisions=precisions)
    out = header("train", settings)
    results: List[Dict] = []
    out["results"] = results
    timing = dict(split=train_split, batch_size=batch_size, epochs=epochs, limit=limit,
                  warmup=warmup, seed=seed)

    fused_params = {}
    if "fused" in parts:
        # One run per precision; float32's keeps the impl "mgpu fused" the comparisons pair.
        for precision in precisions:
            tag = "" if precision == "float32" else f", {precision}"
            for k in devices:
                say(log, f"bench train: fused train_batch{tag} on {k} device(s) ...")
                devs = [try_gpu(i) for i in range(k)]
                dp = [get_params(lenet_params(seed=seed), d) for d in devs]

                def step(X, y, dp=dp, devs=devs, precision=precision):
                    return train_batch(X, y, dp, devs, lr, precision=precision)
                results.append(_time_training(
                    f"mgpu train_batch (fused{tag}), {plural(k, 'device')}", step,
                    impl="mgpu fused" + (f" {precision}" if tag else ""), num_devices=k,
                    precision=precision, threads=_core.num_threads(), **timing))
                fused_params.setdefault(k, (dp, devs))

    if "op-by-op" in parts:
        from ..chapter import train_batch as chapter_train_batch
        for k in devices:
            say(log, f"bench train: the chapter's op-by-op train_batch on {k} device(s) ...")
            devs = [try_gpu(i) for i in range(k)]
            dp = [get_params(lenet_params(seed=seed), d) for d in devs]
            def step(X, y, dp=dp, devs=devs):
                return chapter_train_batch(X, y, dp, devs, lr)
            label = f"mgpu chapter.train_batch (op by op), {plural(k, 'device')}"
            results.append(_time_training(label, step, impl="mgpu op-by-op", num_devices=k,
                                          threads=_core.num_threads(), **timing))

    if "scaling" in parts:
        out["scaling"] = _bench_scaling(timing, lr, seed, log)

    if "deterministic" in parts:
        out["deterministic"] = _bench_deterministic(timing, devices, lr, seed, log)

    if "pipeline" in parts:
        say(log, "bench train: the train loader alone ...")
        loader = DataLoader(train_split, batch_size, True, seed, limit)
        full = _full_batches(train_split, batch_size)

        def one_pass():
            for _ in loader:
                pass

        m = measure(one_pass, warmup=1 if warmup else 0, repeat=repeat, sync=lambda: None)
        per_epoch = m["median"] / len(loader) * full
        out["pipeline"] = {"pass_time": m, "batches_per_pass": len(loader), "full_batches": full,
                           "sec_per_epoch": per_epoch, "extrapolated": len(loader) != full,
                           "percent_of_epoch": _percent_of_fused(per_epoch, results)}

    if "eval" in parts:
        out["evaluation"] = _bench_eval(fused_params, devices, test_split, batch_size, limit,
                                        seed, repeat, results, log)

    for name, (py, info) in rivals.items():
        out[name] = _bench_rival(name, py, info, data, devices, batch_size, lr, epochs, limit,
                                 warmup, {"torch": torch_threads, "jax": jax_threads}[name], seed,
                                 results, log)

    if "flops" in parts:
        say(log, f"bench train: sgemm {gemm_size}x{gemm_size} on cpu(0) with all threads ...")
        out["flops"] = _bench_flops(batch_size, gemm_size, repeat,
                                    results + out.get("scaling", {}).get("runs", []), data)
    out["comparisons"] = _comparisons(results)
    out["machine"]["loadavg_end"] = machine_info()["loadavg"]
    return out


def _bench_deterministic(timing: Dict, devices: Sequence[int], lr: float, seed: int,
                         log: Log) -> List[Dict]:
    """The cost of device-count invariance: ``train_batch`` with deterministic=True (the default
    8 logical shards, fixed summation tree) against the default step, on each device count.

    The two modes run interleaved, epoch by epoch (A B A B ...), each on its own replicas, and
    every epoch records wall time and this process's CPU time (all threads): on a shared,
    loaded machine the CPU time is the figure to trust; in a quiet window both agree."""
    from ..parallel import DEFAULT_SHARDS
    split, batch, epochs = timing["split"], timing["batch_size"], timing["epochs"]
    loader = DataLoader(split, batch, True, seed, timing["limit"])
    out = []
    for k in devices:
        say(log, f"bench train: deterministic against default step on {plural(k, 'device')} ...")
        devs = [try_gpu(i) for i in range(k)]
        modes = {"default": False, "deterministic": True}
        reps = {m: [get_params(lenet_params(seed=seed), d) for d in devs] for m in modes}
        wall: Dict[str, List[float]] = {m: [] for m in modes}
        cpu_time: Dict[str, List[float]] = {m: [] for m in modes}
        for m, det in modes.items():  # warm-up
            for i, (X, y) in enumerate(loader):
                if i >= max(1, timing["warmup"]):
                    break
                train_batch(X, y, reps[m], devs, lr, deterministic=det)
            _core.waitall()
        for _ in range(max(2, epochs)):
            for m, det in modes.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for X, y in loader:
                    train_batch(X, y, reps[m], devs, lr, deterministic=det)
                _core.waitall()
                wall[m].append((time.perf_counter() - t0) / len(loader))
                cpu_time[m].append((time.process_time() - c0) / len(loader))
        entry = {"num_devices": k, "shards": DEFAULT_SHARDS, "steps_per_epoch": len(loader),
                 "threads": _core.num_threads()}
        for m in modes:
            entry[m] = {"wall": summarize(wall[m]), "cpu": summarize(cpu_time[m])}
        for clock in ("wall", "cpu"):
            a = entry["default"][clock]["median"]
            b = entry["deterministic"][clock]["median"]
            entry[f"{clock}_cost_percent"] = 100.0 * (b - a) / a if a > 0 else 0.0
        out.append(entry)
    return out


def _percent_of_fused(seconds: float, results: List[Dict]) -> Dict[str, float]:
    """``seconds`` as % of each fused configuration's sec/epoch, keyed by its device count."""
    return {str(r["num_devices"]): 100.0 * seconds / r["sec_per_epoch"]
            for r in results if r.get("impl") == "mgpu fused" and r["sec_per_epoch"] > 0}


def _bench_scaling(timing: Dict, lr: float, seed: int, log: Log) -> Dict:
    """Weak scaling: batch 2b on 2 devices against batch b on 1 device of one core."""
    b = timing["batch_size"]
    runs = []
    for k, batch, threads in ((2, 2 * b, None), (1, b, 1)):
        say(log, f"bench train: scaling, batch {batch} on {plural(k, 'device')}"
                  + (f", {plural(threads, 'thread')}" if threads else "") + " ...")
        devs = [try_gpu(i) for i in range(k)]
        dp = [get_params(lenet_params(seed=seed), d) for d in devs]
        step = lambda X, y, dp=dp, devs=devs: train_batch(X, y, dp, devs, lr)  # noqa: E731
        old = _core.num_threads()
        if threads:
            _core.set_num_threads(threads)
        try:
            t = dict(timing, batch_size=batch)
            runs.append(_time_training(
                f"scaling: batch {batch} on {plural(k, 'device')}"
                + (f", {plural(threads, 'thread')}" if threads else ""), step, impl="mgpu fused",
                num_devices=k, threads=_core.num_threads(), **t))
        finally:
            _core.set_num_threads(old)
    two, one = runs
    return {"runs": runs,
            "efficiency": one["sec_per_step"]["median"] / two["sec_per_step"]["median"],
            "note": "efficiency = step time of batch b on 1 device, 1 thread / step time of "
                    "batch 2b on 2 devices; 1.0 is perfect weak scaling"}


def _bench_eval(fused_params: Dict, devices: Sequence[int], test_split, batch_size: int,
                limit: int, seed: int, repeat: int, results: List[Dict], log: Log) -> List[Dict]:
    from ..train import evaluate_accuracy
    out = []
    loader = DataLoader(test_split, batch_size, False, seed, limit)
    full = _full_batches(test_split, batch_size)
    for k in devices:
        if k in fused_params:
            dp, devs = fused_params[k]
        else:
            devs = [try_gpu(i) for i in range(k)]
            dp = [get_params(lenet_params(seed=seed), d) for d in devs]
        say(log, f"bench train: evaluate_accuracy on {plural(k, 'device')} ...")
        m = measure(lambda: evaluate_accuracy(dp, loader, devs), warmup=1, repeat=repeat)
        per_epoch = m["median"] / len(loader) * full
        fused = [r for r in results if r.get("impl") == "mgpu fused" and r["num_devices"] == k]
        out.append({"num_devices": k, "pass_time": m, "batches_per_pass": len(loader),
                    "full_batches": full, "sec_per_eval": per_epoch,
                    "extrapolated": len(loader) != full,
                    "percent_of_epoch": (100.0 * per_epoch / fused[0]["sec_per_epoch"]
                                         if fused else None)})
    return out


def _bench_flops(batch_size: int, gemm_size: int, repeat: int, results: List[Dict],
                 data: Dict) -> Dict:
    n = int(gemm_size)
    rng = np.random.default_rng(0)
    a = array(rng.standard_normal((n, n)), device=cpu(0))
    b = array(rng.standard_normal((n, n)), device=cpu(0))
    old = _core.num_threads()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    _core.set_num_threads(max(old, usable))
    try:
        threads = _core.num_threads()
        m = measure(lambda: _core.mm(a._t, b._t), warmup=1, repeat=max(3, repeat))
    finally:
        _core.set_num_threads(old)
    sgemm = 2.0 * n ** 3 / m["median"] / 1e9
    per_image = lenet_step_flops(1)
    achieved = []
    for r in results:
        step_flops = lenet_step_flops(r["global_batch"])
        gflops = step_flops / r["sec_per_step"]["median"] / 1e9
        r["gflops"] = gflops
        if r.get("impl") == "mgpu fused":
            achieved.append({"name": r["name"], "gflops": gflops,
                             "percent_of_sgemm": 100.0 * gflops / sgemm})
    return {"sgemm": {"n": n, "threads": threads, "time": m, "gflops": sgemm},
            "layers_per_image": lenet_layer_flops(1), "per_image": per_image,
            "per_step": lenet_step_flops(batch_size),
            "per_epoch": per_image * data["train_examples"], "achieved": achieved}


def _bench_rival(name, py, info, data, devices, batch_size, lr, epochs, limit, warmup,
                 threads, seed, results, log) -> Dict:
    """Runs a rival's LeNet variants (torch: the chapter's code on each k, nn.Sequential, the
    chapter with its DataLoader; jax: the chapter's pmap_step on each k) and adds their rows to
    ``results``; returns the rival's settings (versions, threads) or {"skipped": why}."""
    what = FRAMEWORK[name]
    if py is None:
        say(log, f"bench train: skipping the {what} comparison: {info}")
        return {"skipped": info}
    # JAX: one process per device count, each with exactly k host devices, because XLA divides
    # its CPU threads among a process's host devices (a 1-device step in a process with 2 of
    # them runs on one thread).
    runs = [list(devices)] if name == "torch" else [[k] for k in devices]
    rival: Dict = {}
    for ks in runs:
        say(log, f"bench train: the chapter's {what} code on {','.join(map(str, ks))} "
                  f"device(s) with {py} ({name} {info}) ...")
        got = run_rival(name, py, data.get("dir"), data["train_examples"] if data["source"] ==
                         "synthetic" else 0, ks, batch_size, lr, epochs, limit, warmup, threads,
                        seed)
        for r in got.pop("results"):
            r.setdefault("threads", got["threads"])
            results.append(rival_entry(name, r))
        rival = dict(got, **rival)  # the first run's settings; each row keeps its own
    rival["python"] = py
    return rival


def _comparisons(results: List[Dict]) -> List[Dict]:
    """ratio = rival sec/step / mgpu sec/step (medians): above 1, mgpu is faster. Each row names
    its rival ("rival": 'torch' or 'jax') and holds the rival's name and time under that key."""
    def find(impl, k):
        for r in results:
            if r.get("impl") == impl and r["num_devices"] == k:
                return r
        return None

    out = []
    pairs = []
    for k in sorted({r["num_devices"] for r in results}):
        for rival in RIVALS:
            pairs.append(("mgpu fused", f"{rival} chapter", k))
            pairs.append(("mgpu op-by-op", f"{rival} chapter", k))
    pairs.append(("mgpu fused", "torch idiomatic", 1))
    # The chapter's code with the chapter's data pipeline, against mgpu with its own: both times
    # include feeding the step.
    pairs.append(("mgpu fused", "torch chapter + loader", 1))
    for mine, theirs, k in pairs:
        a, b = find(mine, k), find(theirs, k)
        if a is None or b is None:
            continue
        rival = theirs.split()[0]
        ma, mb = a["sec_per_step"]["median"], b["sec_per_step"]["median"]
        out.append({"mgpu": a["name"], "rival": rival, rival: b["name"], "num_devices": k,
                    "mgpu_sec_per_step": ma, f"{rival}_sec_per_step": mb, "ratio": mb / ma})
    return out


def format_train(r: Dict) -> str:
    s = r["settings"]
    if s.get("parts") == ["layers"]:
        from .layers import format_layers
        return format_layers(r)
    if s.get("model") == "resnet18":
        return format_train_resnet18(r)
    lines = [f"mgpu bench train: LeNet on {s['data']['source']} ({s['data']['train_examples']} "
             f"train / {s['data']['test_examples']} test images), batch {s['batch_size']}, "
             f"lr {s['lr']}"]
    lines += machine_lines(r)
    cut = f"cut at {s['limit_batches']} batches" if s["limit_batches"] else "whole"
    warm = f"{s['warmup']} warm-up batch" + ("es" if s["warmup"] != 1 else "")
    lines.append(f"each configuration: {warm}, then {s['epochs']} timed epochs ({cut}); "
                 "median over epochs, spread = (max - min) / median")
    lines.append("")
    rows = []
    extrapolated = False
    for x in r["results"] + [x for x in r.get("scaling", {}).get("runs", [])]:
        extrapolated |= x["extrapolated"]
        rows.append([x["name"], str(x["global_batch"]), str(x.get("threads", "")),
                     ms(x["sec_per_step"]["median"]), fmt_pct(100 * x["sec_per_step"]["spread"]),
                     f"{x['sec_per_epoch']:.2f}" + ("*" if x["extrapolated"] else ""),
                     f"{x['images_per_sec']:.0f}",
                     f"{x['gflops']:.1f}" if "gflops" in x else "-"])
    if rows:  # none when only the side parts (e.g. --parts deterministic) ran
        lines += table(["configuration", "batch", "threads", "ms/step", "spread", "sec/epoch",
                         "img/s", "GFLOP/s"], rows, "lrrrrrrr")
    if extrapolated:
        lines.append("* sec/epoch extrapolated: median sec/step x batches in a whole epoch")
    sc = r.get("scaling")
    if sc:
        two, one = sc["runs"]
        lines.append(f"scaling: batch {two['global_batch']} on 2 devices "
                     f"{ms(two['sec_per_step']['median'])} ms/step vs batch {one['global_batch']} "
                     f"on 1 device, 1 thread {ms(one['sec_per_step']['median'])} ms/step: "
                     f"efficiency {sc['efficiency']:.2f} (1.0 = perfect weak scaling)")
    for d in r.get("deterministic", []):
        a, b = d["default"], d["deterministic"]
        lines.append(f"deterministic (train_batch deterministic=True, {d['shards']} shards) on "
                     f"{plural(d['num_devices'], 'device')}: {ms(b['wall']['median'])} ms/step "
                     "wall, "
                     f"{ms(b['cpu']['median'])} ms/step CPU against the default step's "
                     f"{ms(a['wall']['median'])} wall, {ms(a['cpu']['median'])} CPU: cost "
                     f"{d['wall_cost_percent']:+.1f}% wall, {d['cpu_cost_percent']:+.1f}% CPU "
                     "(process CPU time, all threads; interleaved epochs, medians)")
    p = r.get("pipeline")
    if p:
        pct = ", ".join(f"{v:.1f}% of the fused epoch on {plural(int(k), 'device')}"
                        for k, v in p["percent_of_epoch"].items())
        lines.append(f"input pipeline (train loader alone): {p['sec_per_epoch']:.3f} s/epoch"
                     + ("*" if p["extrapolated"] else "") + (f" = {pct}" if pct else ""))
    for e in r.get("evaluation", []):
        pct = e["percent_of_epoch"]
        lines.append(f"evaluation (evaluate_accuracy, {plural(e['num_devices'], 'device')}): "
                     f"{e['sec_per_eval']:.3f} s per test pass" + ("*" if e["extrapolated"] else "")
                     + (f" = {pct:.1f}% of the fused training epoch" if pct is not None else ""))
    f = r.get("flops")
    if f:
        g = f["sgemm"]
        lines.append(f"FLOPs: {f['per_image'] / 1e6:.2f} MFLOP per image (forward + backward), "
                     f"{f['per_step'] / 1e9:.2f} GFLOP per step, {f['per_epoch'] / 1e12:.3f} TFLOP "
                     f"per epoch; sgemm {g['n']}x{g['n']} via mgpu.mm on cpu(0), {g['threads']} "
                     f"threads: {g['gflops']:.1f} GFLOP/s")
        for a in f["achieved"]:
            lines.append(f"  {a['name']}: {a['gflops']:.1f} GFLOP/s = "
                         f"{a['percent_of_sgemm']:.0f}% of sgemm")
    lines += _rival_lines(r, ", shards of the chapter's code run one after the other on the CPU",
                          ", the chapter's pmap_step on k host devices")
    if r.get("comparisons"):
        lines.append("")
        lines.append("ratio = rival ms/step / mgpu ms/step (medians; above 1: mgpu is faster)")
        lines += table(["mgpu", "rival", "ratio"],
                        [[c["mgpu"], c[c["rival"]], f"{c['ratio']:.2f}"]
                         for c in r["comparisons"]], "llr")
    return "\n".join(lines)


def _jax_line(j: Dict) -> str:
    return (f"JAX {j['jax_version']} (Flax {j['flax_version']}, Optax {j['optax_version']}; "
            f"{j['python']}), {j['threads']} CPUs for XLA's threads, one process per device "
            "count k (XLA_FLAGS --xla_force_host_platform_device_count=k)")


def _rival_lines(r: Dict, torch_note: str, jax_note: str) -> List[str]:
    """A line for each rival that ran (its version, interpreter and threads, then ``torch_note``
    or ``jax_note``) and one for each that was skipped."""
    lines = []
    t = r.get("torch")
    if t and "skipped" not in t:
        lines.append(f"PyTorch {t['torch_version']} ({t['python']}), {t.get('threads')} threads"
                     + torch_note)
    j = r.get("jax")
    if j and "skipped" not in j:
        lines.append(_jax_line(j) + jax_note)
    return lines + _skipped_lines(r)


def _skipped_lines(r: Dict) -> List[str]:
    return [f"{FRAMEWORK[name]} comparison skipped: {r[name]['skipped']}"
            for name in RIVALS if "skipped" in r.get(name, {})]


# --- ResNet-18 (sec. 12.6): the fused step, the book's loop, PyTorch eager and compiled --------

RESNET_PARTS = ("fused", "op-by-op")


def _resnet18_side(cfg: Dict) -> Dict:
    """One mgpu configuration (``cfg['impl']`` 'fused' or 'op-by-op' on ``cfg['num_devices']``
    devices), timed by ``rival_common.run_config`` as the rivals are; run in its own process
    so its peak RSS is its own."""
    from .. import nn
    from ..chapter import make_optimizer
    from ..models import resnet18
    from ..random import seed as mgpu_seed
    k = int(cfg["num_devices"])
    devices = [try_gpu(i) for i in range(k)]
    if cfg["synthetic"]:
        images, labels = rival_common.synthetic_split(cfg["synthetic"], cfg["seed"])
    else:
        images, labels = rival_common.load_split(cfg["data_dir"], "train")
    # The rivals' shuffled batches, made mgpu tensors on the first device.
    batches = rival_common.Batches(images, labels, cfg["batch_size"], cfg["limit"], cfg["seed"],
                            make=lambda X, y: (array(X, device=devices[0]),
                                               array(y, device=devices[0])))
    mgpu_seed(cfg["seed"])
    net = resnet18(10, 1)
    model = nn.DataParallel(net, device_ids=devices)
    trainer = make_optimizer(model.parameters(), cfg["lr"], cfg.get("optimizer", "sgd"),
                             cfg.get("weight_decay"))
    clip = cfg.get("clip_grad_norm")
    loss = nn.CrossEntropyLoss()
    precision = cfg.get("precision", "float32")
    tag = "" if precision == "float32" else f", {precision}"
    if cfg["impl"] == "fused":
        def step(X, y):
            return model.train_step(X, y, loss, trainer, clip_grad_norm=clip,
                                    precision=precision).item() * X.shape[0]
        name = f"mgpu ResNet-18 fused train_step, {plural(k, 'device')}{tag}"
    else:
        def step(X, y):
            trainer.zero_grad()
            with autocast(precision):
                out = loss(model(X), y)
            out.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            trainer.step()
            return out.item() * X.shape[0]
        name = f"mgpu ResNet-18 book's loop (autograd), {plural(k, 'device')}{tag}"
    if cfg.get("optimizer", "sgd") != "sgd" or clip is not None:
        name += f", {cfg.get('optimizer', 'sgd')}" + ("" if clip is None else f" + clip {clip}")
    # The allocator's counters from the end of the warm-up: the first steps fill its cache (the
    # first step's blocks, then the reserve made before the second), the timed ones should not.
    before = {}
    r = rival_common.run_config(name, step, batches, cfg["epochs"], cfg["warmup"],
                         on_timed=lambda: before.update(_core.cpu_memory_stats()))
    after = _core.cpu_memory_stats()
    r.update(impl=f"mgpu {cfg['impl']}{' ' + precision if tag else ''}", num_devices=k,
             precision=precision, global_batch=cfg["batch_size"],
             threads=_core.num_threads(), devices=[str(d) for d in devices],
             peak_rss_bytes=rival_common.peak_rss_bytes(),
             allocator_peak_bytes=after["peak_allocated"],
             allocator_held_bytes=after["system_bytes"],
             system_mallocs_timed=after["system_mallocs"] - before["system_mallocs"])
    return r


def _resnet18_side_main(argv: Sequence[str]) -> int:
    """Entry of a side's process: one JSON config in, one JSON result line out."""
    print(json.dumps(_resnet18_side(json.loads(argv[0]))))
    return 0


def _run_side(cfg: Dict) -> Dict:
    boot = ("import sys; from mgpu.bench.train import _resnet18_side_main; "
            "sys.exit(_resnet18_side_main(sys.argv[1:]))")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", boot, json.dumps(cfg)], capture_output=True,
                           text=True, cwd=cwd, env=dict(os.environ, PYTHONPATH=package_root()
                                                        + os.pathsep
                                                        + os.environ.get("PYTHONPATH", "")))
    if r.returncode != 0:
        raise RuntimeError(f"bench train: the mgpu run {cfg['impl']} on "
                           f"{plural(cfg['num_devices'], 'device')} failed:\n"
                           f"{r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def resnet18_step_flops(batch_size: int) -> int:
    """FLOPs of one ResNet-18 training step (d2l's resnet18(10, 1) on 28x28 images)."""
    from ..models import resnet18
    return module_step_flops(resnet18(10, 1), (1, 28, 28), batch_size)


def _entry(r: Dict, flops: int) -> Dict:
    out = dict(r)
    per_step = summarize([t / r["steps_per_epoch"] for t in r["epoch_times"]])
    out.update(sec_per_step=per_step, sec_per_epoch=per_step["median"] * r["full_batches"],
               images_per_sec=r["global_batch"] / per_step["median"],
               sec_per_image=per_step["median"] / r["global_batch"],
               gflops=flops / per_step["median"] / 1e9)
    if r.get("epoch_cpu_times"):
        out["cpu_sec_per_step"] = summarize([t / r["steps_per_epoch"]
                                             for t in r["epoch_cpu_times"]])
    return out


def bench_train_resnet18(devices: Sequence[int] = (1, 2), batch_size: int = 256,
                         lr: float = 0.1, epochs: int = 1, limit_batches: Optional[int] = 5,
                         warmup: int = 2, data_dir: Optional[str] = None, synthetic: int = 0,
                         seed: int = 0, compare: Optional[str] = None,
                         torch_python: Optional[str] = None, torch_threads: int = 2,
                         parts: Sequence[str] = RESNET_PARTS, log: Log = None,
                         torch_variants: Sequence[str] = ("resnet18", "resnet18-compile"),
                         weak_scaling: bool = False, jax_python: Optional[str] = None,
                         jax_threads: int = 2, optimizer: str = "sgd",
                         weight_decay: Optional[float] = None,
                         clip_grad_norm: Optional[float] = None,
                         precisions: Sequence[str] = ("float32",)) -> Dict:
    """Times a ResNet-18 training step (sec. 12.6) on the same batches: the fused step
    (``DataParallel.train_step``) and the book's loop through autograd on each k in ``devices``,
    and with ``compare='torch'`` d2l's PyTorch ResNet-18 eager and through torch.compile
    (``torch_threads`` threads, one device; ``torch_variants`` picks), with ``compare='jax'``
    the JAX concise chapter's Flax ResNet18 (jitted step on one device, pmapped on k > 1 host
    devices, each k in ``devices``; ``jax_threads`` CPUs), with 'torch,jax' both. Every
    configuration runs in its own process, so its peak RSS (ru_maxrss) is its own. Reports
    ms/step, ms per image, GFLOP/s (conv and linear FLOPs of forward and backward), peak memory
    and the ratios against the rivals.
    ``weak_scaling``: k devices train on batches of k x ``batch_size`` (the issue's "2 devices at
    batch 512 against 1 at 256"), and ``weak_scaling`` in the result compares each k's time per
    image with 1 device's (PyTorch keeps ``batch_size``).
    ``optimizer`` ('sgd', 'adam' or 'adamw'), ``weight_decay`` (None: the optimizer's default)
    and ``clip_grad_norm`` (the gradients' global norm clipped to it before every update) set
    mgpu's sides as ``mgpu train --model resnet18`` sets its run; the rivals keep their SGD.
    ``precisions``: each mgpu configuration once per precision ('float32', 'bf16': the fused
    step's ``precision``, the loop under ``mgpu.autocast``); with 'bf16' among them, PyTorch runs
    its eager step under ``torch.autocast("cpu", torch.bfloat16)`` too."""
    precisions = [check_precision(p, "bench train: precision") for p in precisions]
    if "bf16" in precisions and "resnet18-autocast" not in torch_variants:
        torch_variants = tuple(torch_variants) + ("resnet18-autocast",)
    devices = [int(k) for k in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"bench train: devices must be numbers of devices >= 1, got {devices}")
    for name, v in (("batch_size", batch_size), ("epochs", epochs)):
        if int(v) < 1:
            raise ValueError(f"bench train: {name} must be >= 1, got {v}")
    sides = [p for p in RESNET_PARTS if p in parts]
    if not sides:
        raise ValueError(f"bench train --model resnet18: parts must include one of "
                         f"{RESNET_PARTS}, got {list(parts)}")
    rivals = find_rivals(parse_compare(compare), {"torch": torch_python, "jax": jax_python})
    limit, warmup = int(limit_batches or 0), max(0, int(warmup))
    if synthetic:
        data = {"source": "synthetic", "train_examples": int(synthetic)}
    else:
        data_dir = find_data_dir(data_dir)
        data = {"source": "fashion-mnist", "dir": data_dir, "train_examples": 60000}
    largest = int(batch_size) * (max(devices) if weak_scaling else 1)
    if data["train_examples"] < largest:
        raise ValueError(f"bench train: the training set has {data['train_examples']} examples, "
                         f"fewer than one batch of {largest}; use --synthetic >= "
                         "the largest batch or a smaller --batch-size")
    from ..chapter import OPTIMIZERS
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"bench train: optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                         f"{optimizer!r}")
    if clip_grad_norm is not None and not 0 <= clip_grad_norm < float("inf"):
        raise ValueError(f"bench train: clip_grad_norm must be a finite number >= 0, got "
                         f"{clip_grad_norm!r}")
    settings = dict(model="resnet18", devices=devices, batch_size=batch_size, lr=lr,
                    optimizer=optimizer, weight_decay=weight_decay,
                    clip_grad_norm=clip_grad_norm,
                    epochs=epochs, limit_batches=limit, warmup=warmup, seed=seed,
                    compare=compare, torch_threads=torch_threads, jax_threads=jax_threads,
                    parts=sides, data=data, weak_scaling=bool(weak_scaling),
                    precisions=precisions)
    out = header("train", settings)
    flops = resnet18_step_flops(batch_size)
    out["flops"] = {"per_step": flops, "per_image": flops // int(batch_size)}
    results: List[Dict] = []
    out["results"] = results
    base = dict(batch_size=int(batch_size), lr=float(lr), epochs=int(epochs), limit=limit,
                warmup=warmup, seed=int(seed), synthetic=int(synthetic),
                data_dir=data.get("dir"), optimizer=optimizer, weight_decay=weight_decay,
                clip_grad_norm=clip_grad_norm)
    for side in sides:
        for k in devices:
            for precision in precisions:
                batch = int(batch_size) * (k if weak_scaling else 1)
                say(log, f"bench train: ResNet-18 {side} {precision} on {plural(k, 'device')}, "
                          f"batch {batch} (own process) ...")
                results.append(_entry(_run_side(dict(base, impl=side, num_devices=k,
                                                     batch_size=batch, precision=precision)),
                                      flops * batch // int(batch_size)))
    run = dict(data_dir=data.get("dir"), synthetic=int(synthetic), lr=lr, epochs=epochs,
               limit=limit, warmup=warmup, seed=seed)
    for name, (py, info) in rivals.items():
        if py is None:
            say(log, f"bench train: skipping the {FRAMEWORK[name]} comparison: {info}")
            out[name] = {"skipped": info}
            continue
        out[name] = {"python": py, f"{name}_version": info}
        # torch: each variant on one device; jax: the Flax step on each k (batch as mgpu's).
        configs = ([(v, 1, int(batch_size)) for v in torch_variants] if name == "torch" else
                   [("resnet18", k, int(batch_size) * (k if weak_scaling else 1))
                    for k in devices])
        for variant, k, batch in configs:
            say(log, f"bench train: {FRAMEWORK[name]} {variant} on {plural(k, 'device')}, batch "
                      f"{batch}, with {py} (own process) ...")
            rival = run_rival(name, py, devices=[k], batch_size=batch, variants=variant,
                              threads=torch_threads if name == "torch" else jax_threads, **run)
            for key, v in rival.items():
                if key != "results" and key not in out[name]:
                    out[name][key] = v
            for r in rival["results"]:
                r["impl"] = ("torch " + ("compile" if variant.endswith("compile") else
                                         "eager bf16" if variant.endswith("autocast") else
                                         "eager")
                             if name == "torch" else "jax flax")
                r["threads"] = rival["threads"]
                results.append(_entry(r, flops * batch // int(batch_size)))
    out["comparisons"] = _resnet_comparisons(results)
    if weak_scaling:
        out["weak_scaling"] = _weak_scaling(results)
    out["machine"]["loadavg_end"] = machine_info()["loadavg"]
    return out


def _weak_scaling(results: List[Dict]) -> List[Dict]:
    """For each mgpu side on k > 1 devices: its time per image against the same side's on 1
    device (ratio above 1: k devices take longer per image)."""
    out = []
    for mine in (r for r in results if r["impl"].startswith("mgpu") and r["num_devices"] > 1):
        one = next((r for r in results if r["impl"] == mine["impl"] and r["num_devices"] == 1),
                   None)
        if one is None:
            continue
        out.append({"impl": mine["impl"], "num_devices": mine["num_devices"],
                    "batch": mine["global_batch"], "one_device_batch": one["global_batch"],
                    "sec_per_image": mine["sec_per_image"],
                    "one_device_sec_per_image": one["sec_per_image"],
                    "ratio": mine["sec_per_image"] / one["sec_per_image"]})
    return out


def _resnet_comparisons(results: List[Dict]) -> List[Dict]:
    """time ratio = rival sec/image / mgpu sec/image (above 1: mgpu is faster; with equal
    batches the ratio of sec/step); memory ratio = mgpu peak RSS / rival peak RSS (below 1: mgpu
    uses less). A rival's one-device run is compared with every mgpu configuration, its run on
    k > 1 devices with mgpu's on k. Each row names its rival ("rival": 'torch' or 'jax') and
    holds the rival configuration's name under that key."""
    out = []
    for theirs in (r for r in results if not r["impl"].startswith("mgpu")):
        rival = theirs["impl"].split()[0]
        for mine in (r for r in results if r["impl"].startswith("mgpu")):
            if theirs["num_devices"] > 1 and mine["num_devices"] != theirs["num_devices"]:
                continue
            a, b = mine["sec_per_step"]["median"], theirs["sec_per_step"]["median"]
            per_image = mine["global_batch"] / theirs["global_batch"]  # 1.0 for equal batches
            out.append({"mgpu": mine["name"], "rival": rival, rival: theirs["name"],
                        "time_ratio": b / a * per_image,
                        "memory_ratio": mine["peak_rss_bytes"] / theirs["peak_rss_bytes"]})
    return out


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.0f}"


def format_train_resnet18(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench train: ResNet-18 (d2l resnet18(10, 1)) on {s['data']['source']}, "
             f"batch {s['batch_size']}, lr {s['lr']}; every configuration in its own process"]
    if s.get("optimizer", "sgd") != "sgd" or s.get("clip_grad_norm") is not None:
        wd = "" if s.get("weight_decay") is None else f", weight decay {s['weight_decay']}"
        clip = ("" if s.get("clip_grad_norm") is None
                else f", gradients clipped to global norm {s['clip_grad_norm']}")
        lines.append(f"mgpu's optimizer: {s['optimizer']}{wd}{clip} (the rivals keep SGD)")
    lines += machine_lines(r)
    cut = f"cut at {s['limit_batches']} batches" if s["limit_batches"] else "whole"
    lines.append(f"each configuration: {s['warmup']} warm-up batches, then {s['epochs']} timed "
                 f"epoch(s) ({cut}); the same shuffled batches on every side")
    f = r["flops"]
    lines.append(f"FLOPs (conv + linear, forward + backward): {f['per_image'] / 1e9:.2f} GFLOP "
                 f"per image, {f['per_step'] / 1e9:.1f} GFLOP per step")
    lines.append("")
    rows = []
    for x in r["results"]:
        cpu = x.get("cpu_sec_per_step")
        rows.append([x["name"], str(x.get("threads", "")), str(x["global_batch"]),
                     ms(x["sec_per_step"]["median"]), f"{x['sec_per_image'] * 1e3:.3f}",
                     ms(cpu["median"]) if cpu else "-", f"{x['gflops']:.1f}",
                     _mib(x.get("peak_rss_bytes")), _mib(x.get("allocator_peak_bytes")),
                     _mib(x.get("allocator_held_bytes")),
                     str(x.get("system_mallocs_timed", "-"))])
    lines += table(["configuration", "threads", "batch", "ms/step", "ms/image", "cpu ms/step",
                     "GFLOP/s", "peak RSS MiB", "alloc peak MiB", "alloc held MiB", "mallocs"],
                   rows, "lrrrrrrrrrr")
    lines.append("cpu ms/step: process CPU time per step (all threads); peak RSS: the process's "
                 "most resident memory (ru_maxrss: Python, data, libraries and mgpu's allocator); "
                 "alloc peak: the most bytes mgpu's CPU allocator had handed out at once; alloc "
                 "held: what it took from the system (address space, resident once written); "
                 "mallocs: blocks it took from the system during the timed epochs")
    lines += _rival_lines(r, "", "; the Flax step jitted on 1 device, pmapped on more")
    if r.get("comparisons"):
        lines.append("")
        lines.append("time = rival ms/image / mgpu ms/image (above 1: mgpu faster); memory = mgpu "
                     "peak RSS / rival peak RSS (below 1: mgpu smaller)")
        lines += table(["mgpu", "rival", "time", "memory"],
                        [[c["mgpu"], c[c["rival"]], f"{c['time_ratio']:.2f}",
                          f"{c['memory_ratio']:.2f}"] for c in r["comparisons"]], "llrr")
    if r.get("weak_scaling"):
        lines.append("")
        lines.append("weak scaling: ms per image on k devices at batch k x b against 1 device at "
                     "b (the target: within 10 %, ratio <= 1.10)")
        for w in r["weak_scaling"]:
            lines.append(f"  {w['impl']}, {plural(w['num_devices'], 'device')} at batch "
                         f"{w['batch']}: "
                         f"{w['sec_per_image'] * 1e3:.3f} ms/image vs 1 device at batch "
                         f"{w['one_device_batch']}: {w['one_device_sec_per_image'] * 1e3:.3f} "
                         f"ms/image, ratio {w['ratio']:.3f}")
    return "\n".join(lines)
