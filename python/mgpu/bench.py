"""Benchmarks behind ``python -m mgpu bench {train,ops,batch_norm,allreduce}``; results are plain dicts (JSON).

Every measurement warms up first, repeats, and keeps each raw time; tables show the median and the
spread ((max - min) / median), because a shared machine is noisy. ``train`` times the chapter's
training step (sec. 12.5.6) fused and op by op, and optionally the chapter's PyTorch code run by
another interpreter (``_torch_rival.py``); ``ops`` times LeNet's layers one op at a time;
``allreduce`` sweeps sizes and reports algbw = bytes / time and busbw = algbw * 2(k-1)/k.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from . import _core
from .data import DataLoader, find_data_dir
from .device import as_device, cpu, try_gpu
from .models import LENET_SHAPES, lenet_params
from .parallel import allreduce, get_params, train_batch
from .tensor import array, zeros

SCHEMA = "mgpu-bench/1"
Log = Optional[Callable[[str], None]]


# --- measuring -----------------------------------------------------------------------------

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
    from . import __version__
    return {
        "nproc": usable, "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(),
        "loadavg": load, "platform": platform.platform(), "python": platform.python_version(),
        "numpy": np.__version__, "mgpu_version": __version__,
        "mgpu_threads": _core.num_threads(), "build_info": dict(_core.build_info()),
        "num_gpus": _core.num_gpus(),
    }


def _header(benchmark: str, settings: Dict) -> Dict:
    return {"schema": SCHEMA, "benchmark": benchmark,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
            "settings": settings}


def _say(log: Log, msg: str) -> None:
    if log is not None:
        log(msg)


# --- LeNet's arithmetic --------------------------------------------------------------------

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
    return sum(l["forward"] + l["backward"] for l in lenet_layer_flops(batch_size))


# --- bench train ---------------------------------------------------------------------------

def _synthetic_split(n: int, seed: int):
    # The same draw as _torch_rival.synthetic_split, so both sides train on identical data.
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    return _core.make_split(images, labels)


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
            losses.append(sum(l.item() for out in outs for l in out) / loader.num_examples)
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


@functools.lru_cache(maxsize=None)
def find_torch_python(explicit: Optional[str] = None):
    """(interpreter, torch version) of a Python that can ``import torch``, or (None, reason).

    Tries ``explicit`` only when given; else this interpreter, then /usr/bin/python3 (Debian's
    python3-torch works only with Debian's Python and NumPy 1.x). The answer is cached.
    """
    candidates = [explicit] if explicit else [sys.executable, "/usr/bin/python3"]
    tried = []
    for py in candidates:
        if not py or not os.path.exists(py):
            tried.append(f"{py} (missing)")
            continue
        try:
            r = subprocess.run([py, "-c", "import torch, numpy; print(torch.__version__)"],
                               capture_output=True, text=True, timeout=300,
                               cwd=tempfile.gettempdir())
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py} ({e})")
            continue
        if r.returncode == 0:
            return py, r.stdout.strip()
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        tried.append(f"{py} ({last})")
    return None, ("no Python with PyTorch found (tried " + "; ".join(tried) + "); install "
                  "PyTorch, or Debian's python3-torch for /usr/bin/python3, or pass --torch-python")


def _run_torch_rival(py: str, data_dir: Optional[str], synthetic: int, devices: Sequence[int],
                     batch_size: int, lr: float, epochs: int, limit: int, warmup: int,
                     threads: int, seed: int) -> Dict:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_rival.py")
    args = ["--batch-size", str(batch_size), "--lr", repr(lr),
            "--devices", ",".join(str(k) for k in devices), "--epochs", str(epochs),
            "--limit-batches", str(limit), "--warmup", str(warmup), "--threads", str(threads),
            "--seed", str(seed)]
    args += ["--synthetic", str(synthetic)] if synthetic else ["--data-dir", data_dir]
    # Run by path from an empty directory, so the package's own modules (random.py, data.py)
    # cannot shadow the standard library's in that interpreter, and mgpu is never imported.
    boot = ("import runpy, sys; p = sys.argv[1]; sys.argv = sys.argv[1:]; "
            "runpy.run_path(p, run_name='__main__')")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([py, "-c", boot, script] + args, capture_output=True, text=True,
                           cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"bench train: the PyTorch run ({py}) failed:\n"
                           f"{r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _torch_entry(r: Dict) -> Dict:
    per_step = summarize([t / r["steps_per_epoch"] for t in r["epoch_times"]])
    impl = {"chapter": "torch chapter", "loader": "torch chapter + loader"}.get(
        r["variant"], "torch idiomatic")
    out = dict(r)
    out.update(impl=impl, sec_per_step=per_step,
               sec_per_epoch=per_step["median"] * r["full_batches"],
               images_per_sec=r["global_batch"] / per_step["median"])
    return out


TRAIN_PARTS = ("fused", "op-by-op", "scaling", "pipeline", "eval", "flops")


def bench_train(devices: Sequence[int] = (1, 2), batch_size: int = 256, lr: float = 0.2,
                epochs: int = 3, limit_batches: Optional[int] = 20, warmup: int = 3,
                repeat: int = 3, data_dir: Optional[str] = None, synthetic: int = 0,
                seed: int = 0, compare: Optional[str] = None, torch_python: Optional[str] = None,
                torch_threads: int = 2, parts: Sequence[str] = TRAIN_PARTS,
                gemm_size: int = 1024, log: Log = None) -> Dict:
    """Times LeNet training on Fashion-MNIST (or ``synthetic`` random images); returns a dict.

    Each training configuration runs ``warmup`` untimed batches, then ``epochs`` timed epochs
    cut at ``limit_batches`` (0 or None: whole epochs); sec/epoch is the median sec/step times
    the batches of a whole epoch, marked ``extrapolated`` when epochs were cut. ``parts``:
    fused (``train_batch`` on each k in ``devices``), op-by-op (``mgpu.chapter.train_batch``),
    scaling (batch 2b on 2 devices vs b on 1 device with 1 thread), pipeline (the train loader
    alone), eval (``evaluate_accuracy`` on all devices), flops (achieved GFLOP/s vs an sgemm of
    ``gemm_size``, ``repeat`` samples like pipeline and eval). ``compare='torch'`` also runs the
    chapter's PyTorch code and an nn.Sequential version with ``torch_threads`` threads.
    """
    devices = [int(k) for k in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"bench train: devices must be numbers of devices >= 1, got {devices}")
    for name, v in (("batch_size", batch_size), ("epochs", epochs), ("repeat", repeat)):
        if int(v) < 1:
            raise ValueError(f"bench train: {name} must be >= 1, got {v}")
    unknown = set(parts) - set(TRAIN_PARTS)
    if unknown:
        raise ValueError(f"bench train: unknown parts {sorted(unknown)}; choose from {TRAIN_PARTS}")
    if compare not in (None, "torch"):
        raise ValueError(f"bench train: --compare takes 'torch', got {compare!r}")
    limit = int(limit_batches or 0)
    warmup = max(0, int(warmup))
    if compare == "torch":  # before anything is timed, so a wrong --torch-python fails fast
        torch_py, torch_info = find_torch_python(torch_python)
        if torch_py is None and torch_python:
            raise ValueError(f"bench train: --torch-python {torch_python} cannot import torch: "
                             f"{torch_info}")
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
                    compare=compare, torch_threads=torch_threads, parts=list(parts),
                    gemm_size=gemm_size, data=data)
    out = _header("train", settings)
    results: List[Dict] = []
    out["results"] = results
    timing = dict(split=train_split, batch_size=batch_size, epochs=epochs, limit=limit,
                  warmup=warmup, seed=seed)

    fused_params = {}
    if "fused" in parts:
        for k in devices:
            _say(log, f"bench train: fused train_batch on {k} device(s) ...")
            devs = [try_gpu(i) for i in range(k)]
            dp = [get_params(lenet_params(seed=seed), d) for d in devs]
            step = lambda X, y, dp=dp, devs=devs: train_batch(X, y, dp, devs, lr)  # noqa: E731
            results.append(_time_training(f"mgpu train_batch (fused), {_n(k, 'device')}", step,
                                          impl="mgpu fused", num_devices=k,
                                          threads=_core.num_threads(), **timing))
            fused_params[k] = (dp, devs)

    if "op-by-op" in parts:
        from .chapter import train_batch as chapter_train_batch
        for k in devices:
            _say(log, f"bench train: the chapter's op-by-op train_batch on {k} device(s) ...")
            devs = [try_gpu(i) for i in range(k)]
            dp = [get_params(lenet_params(seed=seed), d) for d in devs]
            def step(X, y, dp=dp, devs=devs):
                return chapter_train_batch(X, y, dp, devs, lr)
            results.append(_time_training(f"mgpu chapter.train_batch (op by op), {_n(k, 'device')}",
                                          step, impl="mgpu op-by-op", num_devices=k,
                                          threads=_core.num_threads(), **timing))

    if "scaling" in parts:
        out["scaling"] = _bench_scaling(timing, lr, seed, log)

    if "pipeline" in parts:
        _say(log, "bench train: the train loader alone ...")
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

    if compare == "torch":
        out["torch"] = _bench_torch(torch_py, torch_info, data, devices, batch_size, lr, epochs,
                                    limit, warmup, torch_threads, seed, results, log)

    if "flops" in parts:
        _say(log, f"bench train: sgemm {gemm_size}x{gemm_size} on cpu(0) with all threads ...")
        out["flops"] = _bench_flops(batch_size, gemm_size, repeat,
                                    results + out.get("scaling", {}).get("runs", []), data)
    out["comparisons"] = _comparisons(results)
    out["machine"]["loadavg_end"] = machine_info()["loadavg"]
    return out


def _n(k: int, what: str) -> str:
    return f"{k} {what}{'s' if k != 1 else ''}"


def _percent_of_fused(seconds: float, results: List[Dict]) -> Dict[str, float]:
    """``seconds`` as % of each fused configuration's sec/epoch, keyed by its device count."""
    return {str(r["num_devices"]): 100.0 * seconds / r["sec_per_epoch"]
            for r in results if r.get("impl") == "mgpu fused" and r["sec_per_epoch"] > 0}


def _bench_scaling(timing: Dict, lr: float, seed: int, log: Log) -> Dict:
    """Weak scaling: batch 2b on 2 devices against batch b on 1 device of one core."""
    b = timing["batch_size"]
    runs = []
    for k, batch, threads in ((2, 2 * b, None), (1, b, 1)):
        _say(log, f"bench train: scaling, batch {batch} on {_n(k, 'device')}"
                  + (f", {_n(threads, 'thread')}" if threads else "") + " ...")
        devs = [try_gpu(i) for i in range(k)]
        dp = [get_params(lenet_params(seed=seed), d) for d in devs]
        step = lambda X, y, dp=dp, devs=devs: train_batch(X, y, dp, devs, lr)  # noqa: E731
        old = _core.num_threads()
        if threads:
            _core.set_num_threads(threads)
        try:
            t = dict(timing, batch_size=batch)
            runs.append(_time_training(
                f"scaling: batch {batch} on {_n(k, 'device')}"
                + (f", {_n(threads, 'thread')}" if threads else ""), step, impl="mgpu fused",
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
    from .train import evaluate_accuracy
    out = []
    loader = DataLoader(test_split, batch_size, False, seed, limit)
    full = _full_batches(test_split, batch_size)
    for k in devices:
        if k in fused_params:
            dp, devs = fused_params[k]
        else:
            devs = [try_gpu(i) for i in range(k)]
            dp = [get_params(lenet_params(seed=seed), d) for d in devs]
        _say(log, f"bench train: evaluate_accuracy on {_n(k, 'device')} ...")
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


def _bench_torch(py, info, data, devices, batch_size, lr, epochs, limit, warmup, threads,
                 seed, results, log) -> Dict:
    if py is None:
        _say(log, f"bench train: skipping the PyTorch comparison: {info}")
        return {"skipped": info}
    _say(log, f"bench train: the chapter's PyTorch code with {py} (torch {info}) ...")
    rival = _run_torch_rival(py, data.get("dir"), data["train_examples"] if data["source"] ==
                             "synthetic" else 0, devices, batch_size, lr, epochs, limit, warmup,
                             threads, seed)
    for r in rival.pop("results"):
        results.append(_torch_entry(r))
    rival["python"] = py
    return rival


def _comparisons(results: List[Dict]) -> List[Dict]:
    """ratio = torch sec/step / mgpu sec/step (medians): above 1, mgpu is faster."""
    def find(impl, k):
        for r in results:
            if r.get("impl") == impl and r["num_devices"] == k:
                return r
        return None

    out = []
    pairs = []
    for k in sorted({r["num_devices"] for r in results}):
        pairs.append(("mgpu fused", "torch chapter", k))
        pairs.append(("mgpu op-by-op", "torch chapter", k))
    pairs.append(("mgpu fused", "torch idiomatic", 1))
    # The chapter's code with the chapter's data pipeline, against mgpu with its own: both times
    # include feeding the step.
    pairs.append(("mgpu fused", "torch chapter + loader", 1))
    for mine, theirs, k in pairs:
        a, b = find(mine, k), find(theirs, k)
        if a is None or b is None:
            continue
        ma, mb = a["sec_per_step"]["median"], b["sec_per_step"]["median"]
        out.append({"mgpu": a["name"], "torch": b["name"], "num_devices": k,
                    "mgpu_sec_per_step": ma, "torch_sec_per_step": mb, "ratio": mb / ma})
    return out


# --- bench ops -----------------------------------------------------------------------------

def _lenet_op_cases(n: int, rng, dev=None) -> List[Dict]:
    """LeNet's ops in forward order at batch n, each with forward and backward closures."""
    dev = cpu(0) if dev is None else dev

    def t(shape, scale=1.0):
        return array(rng.standard_normal(shape) * scale, device=dev)._t

    W = [t(s, 0.1) if len(s) > 1 else t(s, 0.0) for s in LENET_SHAPES]
    X = t((n, 1, 28, 28))
    y = array(rng.integers(0, 10, n), device=dev)._t
    flops = {l["layer"]: l for l in lenet_layer_flops(n)}
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
    out = _header("ops", dict(batch_sizes=batch_sizes, warmup=warmup, repeat=repeat,
                              min_time=min_time, device=str(dev)))
    sync = lambda: _core.synchronize(dev)  # noqa: E731
    rng = np.random.default_rng(0)
    rows = []
    steps = []
    for n in batch_sizes:
        _say(log, f"bench ops: LeNet's ops at batch {n} on {dev} ...")
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


# --- bench batch_norm ----------------------------------------------------------------------

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
    out = _header("batch_norm", dict(shape=shape, warmup=warmup, repeat=repeat,
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
    _say(log, f"bench batch_norm: {tuple(shape)} on {dev} ...")
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
    lines += _machine_lines(r)
    lines.append(f"{s['warmup']} warm-up calls, {s['repeat']} samples of >= "
                 f"{s['min_time'] * 1e3:.0f} ms; median, spread = (max - min) / median; GB/s = "
                 "bytes the op must read and write / time")
    copy_gbps = r["ops"][0]["gbps"]
    rows = [[x["op"], _ms(x["time"]["median"]), _pct(100 * x["time"]["spread"]),
             f"{x['bytes'] / 1e6:.0f}", f"{x['gbps']:.1f}", f"{100 * x['gbps'] / copy_gbps:.0f}%"]
            for x in r["ops"]]
    lines += _table(["kernel", "ms", "spread", "MB moved", "GB/s", "of copy"], rows, "lrrrrr")
    t = r["totals"]
    lines.append(f"training forward (stats + normalise): {_ms(t['forward_training'])} ms = "
                 f"{t['forward_training'] / t['copy']:.2f} copies; backward (reduce + dx): "
                 f"{_ms(t['backward_training'])} ms = {t['backward_training'] / t['copy']:.2f} "
                 "copies")
    return "\n".join(lines)


# --- bench allreduce -----------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'1K', '4KiB', '16M', '1G' or plain bytes -> bytes (powers of 1024)."""
    s = str(text).strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" and s else s
    try:
        value = int(float(digits) * mult)
    except ValueError:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 4096, 4K, 16M") from None
    if value < 4:
        raise ValueError(f"size {text!r} is below one float32 (4 bytes)")
    return value


def format_size(nbytes: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            v = nbytes / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"


DEFAULT_SIZES = [1 << s for s in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB


def bus_factor(k: int) -> float:
    """busbw / algbw for an all-reduce over k devices: 2(k-1)/k (nccl-tests' convention)."""
    return 2.0 * (k - 1) / k


def bench_allreduce(devices: Sequence[int] = (2,), sizes: Sequence[int] = DEFAULT_SIZES,
                    warmup: int = 3, repeat: int = 10, min_time: float = 0.002,
                    log: Log = None) -> Dict:
    """mgpu.allreduce of one float32 tensor of each size per device, over k CPU devices.

    time is per all-reduce (back-to-back calls, then ``waitall``); algbw = size / time, busbw =
    algbw * 2(k-1)/k. A single copy cpu(0) -> cpu(1) and a NumPy host copy of the largest size
    are the memory-bandwidth baselines.
    """
    ks = [int(k) for k in devices]
    if not ks or min(ks) < 2:
        raise ValueError(f"bench allreduce: every device count must be >= 2, got {ks}")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 4:
        raise ValueError(f"bench allreduce: sizes must be >= 4 bytes, got {sizes}")
    out = _header("allreduce", dict(devices=ks, sizes=sizes, warmup=warmup, repeat=repeat,
                                    min_time=min_time, dtype="float32"))
    rows = []
    for k in ks:
        devs = [try_gpu(i) for i in range(k)]
        for size in sizes:
            n = max(1, size // 4)
            _say(log, f"bench allreduce: {format_size(4 * n)} over {_n(k, 'device')} ...")
            # Zeros stay zeros however often they are summed: no overflow, no denormals.
            data = [zeros((n,), device=d) for d in devs]
            m = measure(lambda: allreduce(data), warmup, repeat, _core.waitall, min_time)
            algbw = 4 * n / m["median"]
            rows.append({"devices": k, "bytes": 4 * n, "time": m, "algbw": algbw,
                         "busbw": algbw * bus_factor(k)})
    out["results"] = rows
    big = max(sizes) // 4
    src = zeros((big,), device=cpu(0))
    dst = zeros((big,), device=cpu(1))
    m = measure(lambda: _core.copy(dst._t, src._t), warmup, repeat, _core.waitall, min_time)
    a, b = np.zeros(big, np.float32), np.ones(big, np.float32)
    h = measure(lambda: np.copyto(a, b), warmup, repeat, lambda: None, min_time)
    out["baselines"] = [
        {"name": name, "bytes": 4 * big, "time": t, "bandwidth": 4 * big / t["median"]}
        for name, t in (("copy cpu(0) -> cpu(1)", m), ("numpy copyto (host memcpy)", h))]
    return out


# --- output --------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}%"


def _machine_lines(r: Dict) -> List[str]:
    m = r["machine"]
    b = m["build_info"]
    load = m.get("loadavg")
    lines = [f"machine: {m['nproc']} CPUs ({m['cpu_model']}), load average "
             f"{load[0]:.1f}" if load else f"machine: {m['nproc']} CPUs ({m['cpu_model']})"]
    lines.append(f"mgpu {m['mgpu_version']}: {m['mgpu_threads']} threads, BLAS {b.get('blas')}, "
                 f"CUDA {b.get('cuda')}, GPUs {m['num_gpus']}; Python {m['python']}, "
                 f"NumPy {m['numpy']}")
    return lines


def _table(header: List[str], rows: List[List[str]], align: str) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_train(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench train: LeNet on {s['data']['source']} ({s['data']['train_examples']} "
             f"train / {s['data']['test_examples']} test images), batch {s['batch_size']}, "
             f"lr {s['lr']}"]
    lines += _machine_lines(r)
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
                     _ms(x["sec_per_step"]["median"]), _pct(100 * x["sec_per_step"]["spread"]),
                     f"{x['sec_per_epoch']:.2f}" + ("*" if x["extrapolated"] else ""),
                     f"{x['images_per_sec']:.0f}",
                     f"{x['gflops']:.1f}" if "gflops" in x else "-"])
    lines += _table(["configuration", "batch", "threads", "ms/step", "spread", "sec/epoch",
                     "img/s", "GFLOP/s"], rows, "lrrrrrrr")
    if extrapolated:
        lines.append("* sec/epoch extrapolated: median sec/step x batches in a whole epoch")
    sc = r.get("scaling")
    if sc:
        two, one = sc["runs"]
        lines.append(f"scaling: batch {two['global_batch']} on 2 devices "
                     f"{_ms(two['sec_per_step']['median'])} ms/step vs batch {one['global_batch']} "
                     f"on 1 device, 1 thread {_ms(one['sec_per_step']['median'])} ms/step: "
                     f"efficiency {sc['efficiency']:.2f} (1.0 = perfect weak scaling)")
    p = r.get("pipeline")
    if p:
        pct = ", ".join(f"{v:.1f}% of the fused epoch on {_n(int(k), 'device')}"
                        for k, v in p["percent_of_epoch"].items())
        lines.append(f"input pipeline (train loader alone): {p['sec_per_epoch']:.3f} s/epoch"
                     + ("*" if p["extrapolated"] else "") + (f" = {pct}" if pct else ""))
    for e in r.get("evaluation", []):
        pct = e["percent_of_epoch"]
        lines.append(f"evaluation (evaluate_accuracy, {_n(e['num_devices'], 'device')}): "
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
    t = r.get("torch")
    if t:
        if "skipped" in t:
            lines.append(f"PyTorch comparison skipped: {t['skipped']}")
        else:
            lines.append(f"PyTorch {t['torch_version']} ({t['python']}), {t['threads']} threads, "
                         "shards of the chapter's code run one after the other on the CPU")
    if r.get("comparisons"):
        lines.append("")
        lines.append("ratio = torch ms/step / mgpu ms/step (medians; above 1: mgpu is faster)")
        lines += _table(["mgpu", "torch", "ratio"],
                        [[c["mgpu"], c["torch"], f"{c['ratio']:.2f}"] for c in r["comparisons"]],
                        "llr")
    return "\n".join(lines)


def format_ops(r: Dict) -> str:
    lines = [f"mgpu bench ops: LeNet's ops on {r['settings'].get('device', 'cpu(0)')}, "
             "forward and backward"]
    lines += _machine_lines(r)
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
            rows.append([x["op"], _ms(x["forward"]["median"]), _pct(100 * x["forward"]["spread"]),
                         g(x["gflops_forward"]), _ms(x["backward"]["median"]),
                         _pct(100 * x["backward"]["spread"]), g(x["gflops_backward"])])
        st = [x for x in r["steps"] if x["batch"] == n][0]
        lines.append(f"batch {n}")
        lines += _table(["op", "fwd ms", "spread", "GFLOP/s", "bwd ms", "spread", "GFLOP/s"],
                        rows, "lrrrrrr")
        lines.append(f"sum of the ops, forward + backward: {_ms(st['sum_of_ops'])} ms; fused "
                     f"train_batch on 1 device: {_ms(st['fused_step']['median'])} ms (spread "
                     f"{_pct(100 * st['fused_step']['spread'])}), {st['gflops']:.1f} GFLOP/s")
    return "\n".join(lines)


def format_allreduce(r: Dict) -> str:
    lines = ["mgpu bench allreduce: mgpu.allreduce of one float32 tensor per device"]
    lines += _machine_lines(r)
    s = r["settings"]
    lines.append(f"{s['warmup']} warm-up calls, {s['repeat']} samples of >= "
                 f"{s['min_time'] * 1e3:.0f} ms each; algbw = bytes / time, "
                 "busbw = algbw * 2(k-1)/k")
    for k in s["devices"]:
        lines.append("")
        rows = [[format_size(x["bytes"]), f"{x['time']['median'] * 1e6:.1f}",
                 _pct(100 * x["time"]["spread"]), f"{x['algbw'] / 1e9:.2f}",
                 f"{x['busbw'] / 1e9:.2f}"] for x in r["results"] if x["devices"] == k]
        lines.append(f"k = {k} devices")
        lines += _table(["size", "time us", "spread", "algbw GB/s", "busbw GB/s"], rows, "rrrrr")
    lines.append("")
    for b in r["baselines"]:
        lines.append(f"baseline {b['name']}, {format_size(b['bytes'])}: "
                     f"{b['time']['median'] * 1e6:.1f} us, {b['bandwidth'] / 1e9:.2f} GB/s")
    return "\n".join(lines)


def format_result(r: Dict) -> str:
    """The readable table for any bench result."""
    return {"train": format_train, "ops": format_ops, "batch_norm": format_batch_norm,
            "allreduce": format_allreduce}[r["benchmark"]](r)


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


def plot(r: Dict, path: Optional[str] = None, ax=None):
    """Draws a result (matplotlib) and returns the Figure; writes it to ``path`` when given.

    train: ms/step per configuration with min-max error bars; ops: forward and backward ms per
    op; allreduce: busbw against size per k, with the copy baselines as lines.
    """
    from matplotlib.figure import Figure
    fig = None
    if ax is None:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
    kind = r["benchmark"]
    if kind == "train":
        runs = r["results"] + r.get("scaling", {}).get("runs", [])
        names = [x["name"] for x in runs]
        med = np.array([x["sec_per_step"]["median"] for x in runs]) * 1e3
        lo = med - np.array([x["sec_per_step"]["min"] for x in runs]) * 1e3
        hi = np.array([x["sec_per_step"]["max"] for x in runs]) * 1e3 - med
        colors = ["C1" if x.get("impl", "").startswith("torch") else "C0" for x in runs]
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
    else:
        raise ValueError(f"plot: unknown benchmark {kind!r}")
    ax.grid(True, alpha=0.3)
    fig = fig or ax.figure
    if path:
        fig.savefig(path, dpi=120)
    return fig


__all__ = ["bench_train", "bench_ops", "bench_allreduce", "format_result", "plot", "save", "load",
           "summarize", "measure", "machine_info", "lenet_layer_flops", "lenet_step_flops",
           "find_torch_python", "bus_factor", "parse_size", "format_size", "TRAIN_PARTS"]
