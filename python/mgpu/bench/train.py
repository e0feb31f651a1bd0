"""``bench train``: the chapter's training step (sec. 12.5.6) fused and op by op, scaling, the data
pipeline, evaluation, achieved FLOP/s, and optionally the chapters' PyTorch and JAX code run by
other interpreters (``_torch_rival.py``, ``_jax_rival.py``)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .. import _core, _rival_common
from ..data import DataLoader, find_data_dir
from ..device import cpu, try_gpu
from ..models import lenet_params
from ..parallel import get_params, train_batch
from ..tensor import array
from .common import (
    Log,
    _machine_lines,
    _ms,
    _n,
    _pct,
    _say,
    _table,
    header,
    lenet_layer_flops,
    lenet_step_flops,
    machine_info,
    measure,
    module_step_flops,
    summarize,
)


def _synthetic_split(n: int, seed: int):
    # The rivals' draw (_rival_common.synthetic_split), so every side trains on identical data.
    return _core.make_split(*_rival_common.synthetic_split(n, seed))


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


def interpreter_path(py: Optional[str]) -> Optional[str]:
    """``py`` made absolute when it is a path (``build/peers/torch/bin/python``), so it names the
    same file from the children's working directories; a bare name (``python3``) stays as it is,
    for the PATH search."""
    return os.path.abspath(py) if py and os.sep in py else py


def _probe_python(candidates: tuple, code: str):
    """(interpreter, what ``code`` printed) for the first of ``candidates`` that runs ``code``,
    else (None, [each candidate with why it failed]). The answer is cached by the absolute paths,
    so a relative one is probed again from another working directory."""
    return _probe_absolute(tuple(map(interpreter_path, candidates)), code)


@functools.lru_cache(maxsize=None)
def _probe_absolute(candidates: tuple, code: str):
    tried = []
    for py in candidates:
        if not py or not os.path.exists(py):
            tried.append(f"{py} (missing)")
            continue
        try:
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300,
                               cwd=tempfile.gettempdir())
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py} ({e})")
            continue
        if r.returncode == 0:
            return py, r.stdout.strip()
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        tried.append(f"{py} ({last})")
    return None, tried


def find_torch_python(explicit: Optional[str] = None):
    """(interpreter, torch version) of a Python that can ``import torch``, or (None, reason).

    Tries ``explicit`` only when given; else the project's peer first ($MGPU_TORCH_PYTHON, or
    build/peers/torch/bin/python made by ``bash .ci/peers.sh torch``: PyTorch 2.15 from PyPI),
    then this interpreter, then ``python3`` on PATH (e.g. Debian's python3-torch, 1.13: older and
    slower, the last resort; the version found is in every report, and the tests skip a PyTorch
    older than they support). The answer is cached.
    """
    import shutil
    candidates = ((explicit,) if explicit else
                  (*peer_python_candidates("torch"), sys.executable,
                   shutil.which("python3") or "/usr/bin/python3"))
    py, found = _probe_python(tuple(dict.fromkeys(candidates)),
                              "import torch, numpy; print(torch.__version__)")
    if py is not None:
        return py, found
    return None, ("no Python with PyTorch found (tried " + "; ".join(found) + "); run `bash "
                  ".ci/peers.sh torch` (it makes build/peers/torch), or pass --torch-python")


# The variable that names each peer's interpreter (see mgpu.environment).
PEER_PYTHON_ENV = {"torch": "MGPU_TORCH_PYTHON", "jax": "MGPU_JAX_PYTHON"}


def peer_python_candidates(peer: str) -> List[str]:
    """Where a peer's interpreter is looked for: $MGPU_<PEER>_PYTHON when set, else
    build/peers/<peer>/bin/python (made by ``bash .ci/peers.sh <peer>``) in the current directory
    or in a directory above this package (the repository's, when mgpu runs from build/dev)."""
    env = os.environ.get(PEER_PYTHON_ENV[peer])
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [os.getcwd()] + [os.path.dirname(here)]
    while os.path.dirname(roots[-1]) != roots[-1]:
        roots.append(os.path.dirname(roots[-1]))
    out = []
    for root in roots:
        py = os.path.join(root, "build", "peers", peer, "bin", "python")
        if os.path.exists(py) and py not in out:
            out.append(py)
    return out or [os.path.join(os.getcwd(), "build", "peers", peer, "bin", "python")]


def jax_python_candidates() -> List[str]:
    """Where ``find_jax_python`` looks when no interpreter is given: $MGPU_JAX_PYTHON when set,
    else build/peers/jax/bin/python (``peer_python_candidates``)."""
    return peer_python_candidates("jax")


def find_jax_python(explicit: Optional[str] = None):
    """(interpreter, jax version) of a Python that can import jax, flax and optax, or (None,
    reason). Tries ``explicit`` only when given, else ``jax_python_candidates()``."""
    candidates = tuple([explicit] if explicit else jax_python_candidates())
    py, found = _probe_python(candidates, "import jax, flax, optax, numpy; print(jax.__version__)")
    if py is not None:
        return py, found
    return None, ("no Python with JAX, Flax and Optax found (tried " + "; ".join(found) + "); run "
                  "`bash .ci/peers.sh jax` (it makes build/peers/jax) or pass --jax-python")


RIVALS = ("torch", "jax")
_FRAMEWORK = {"torch": "PyTorch", "jax": "JAX"}


def parse_compare(compare: Optional[str]) -> List[str]:
    """``--compare``: None, or rivals separated by commas ('torch', 'jax', 'torch,jax')."""
    if compare is None:
        return []
    names = [c.strip() for c in str(compare).split(",") if c.strip()]
    if not names or set(names) - set(RIVALS) or len(set(names)) != len(names):
        raise ValueError(f"bench train: --compare takes 'torch', 'jax' or 'torch,jax', got "
                         f"{compare!r}")
    return names


def _find_rivals(names: Sequence[str], explicit: Dict[str, Optional[str]]) -> Dict:
    """{rival: (interpreter or None, version or why not)}; an interpreter given explicitly that
    cannot import the rival's framework is a ValueError, before anything is timed."""
    finders = {"torch": (find_torch_python, "torch"), "jax": (find_jax_python, "jax, flax, optax")}
    out = {}
    for name in names:
        find, modules = finders[name]
        py, info = find(explicit.get(name))
        if py is None and explicit.get(name):
            raise ValueError(f"bench train: --{name}-python {explicit[name]} cannot import "
                             f"{modules}: {info}")
        out[name] = (py, info)
    return out


def _run_rival(name: str, py: str, data_dir: Optional[str], synthetic: int,
               devices: Sequence[int], batch_size: int, lr: float, epochs: int, limit: int,
               warmup: int, threads: int, seed: int, variants: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> Dict:
    """Runs ``_{name}_rival.py`` with ``py`` (in ``env``, default this process's environment);
    returns the JSON object it prints."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--batch-size", str(batch_size), "--lr", repr(lr),
            "--devices", ",".join(str(k) for k in devices), "--epochs", str(epochs),
            "--limit-batches", str(limit), "--warmup", str(warmup), "--threads", str(threads),
            "--seed", str(seed)]
    args += ["--synthetic", str(synthetic)] if synthetic else ["--data-dir", data_dir]
    if variants:
        args += ["--variants", variants]
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(rival_command(py, os.path.join(here, f"_{name}_rival.py")) + args,
                           capture_output=True, text=True, cwd=cwd, env=env)
    what = _FRAMEWORK[name]
    if r.returncode != 0:
        raise RuntimeError(f"bench train: the {what} run ({py}) failed:\n"
                           f"{r.stderr.strip()[-2000:]}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"bench train: the {what} run ({py}) printed no JSON result:\n"
                           f"{r.stdout.strip()[-2000:]}") from None


def rival_command(py: str, script: str) -> List[str]:
    """The command that runs a rival script with ``py``: by path, from the caller's (empty)
    directory, so the package's own modules (random.py, data.py) cannot shadow the standard
    library's in that interpreter and mgpu is never imported; _rival_common.py, next to the
    script, is loaded first as the top-level module the script imports."""
    boot = ("import importlib.util, os, runpy, sys; p = sys.argv[1]; sys.argv = sys.argv[1:]; "
            "s = importlib.util.spec_from_file_location('_rival_common', "
            "os.path.join(os.path.dirname(p), '_rival_common.py')); "
            "m = sys.modules['_rival_common'] = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m); runpy.run_path(p, run_name='__main__')")
    return [py, "-c", boot, script]


def _rival_entry(name: str, r: Dict) -> Dict:
    """A rival's LeNet result with the bench's statistics; impl is e.g. 'torch chapter'."""
    per_step = summarize([t / r["steps_per_epoch"] for t in r["epoch_times"]])
    impl = name + " " + {"chapter": "chapter", "loader": "chapter + loader"}.get(
        r["variant"], "idiomatic")
    out = dict(r)
    out.update(impl=impl, sec_per_step=per_step,
               sec_per_epoch=per_step["median"] * r["full_batches"],
               images_per_sec=r["global_batch"] / per_step["median"])
    return out


TRAIN_PARTS = ("fused", "op-by-op", "scaling", "pipeline", "eval", "flops", "deterministic")


def bench_train(devices: Sequence[int] = (1, 2), batch_size: int = 256, lr: float = 0.2,
                epochs: int = 3, limit_batches: Optional[int] = 20, warmup: int = 3,
                repeat: int = 3, data_dir: Optional[str] = None, synthetic: int = 0,
                seed: int = 0, compare: Optional[str] = None, torch_python: Optional[str] = None,
                torch_threads: int = 2, parts: Sequence[str] = TRAIN_PARTS,
                gemm_size: int = 1024, log: Log = None, model: str = "lenet",
                weak_scaling: bool = False, jax_python: Optional[str] = None,
                jax_threads: int = 2) -> Dict:
    """Times LeNet training on Fashion-MNIST (or ``synthetic`` random images); returns a dict.
    ``model='resnet18'``: bench_train_resnet18 instead (``repeat`` and ``gemm_size`` unused).

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
        return bench_layers(model, batch_size, steps=max(1, int(limit_batches or 3)),
                            warmup=max(1, int(warmup)), log=log)
    if model == "resnet18":
        return bench_train_resnet18(devices, batch_size, lr, epochs, limit_batches, warmup,
                                    data_dir, synthetic, seed, compare, torch_python,
                                    torch_threads, parts, log, weak_scaling=weak_scaling,
                                    jax_python=jax_python, jax_threads=jax_threads)
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
    rivals = _find_rivals(parse_compare(compare), {"torch": torch_python, "jax": jax_python})
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
                    parts=list(parts), gemm_size=gemm_size, data=data)
    out = header("train", settings)
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
        from ..chapter import train_batch as chapter_train_batch
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

    if "deterministic" in parts:
        out["deterministic"] = _bench_deterministic(timing, devices, lr, seed, log)

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

    for name, (py, info) in rivals.items():
        out[name] = _bench_rival(name, py, info, data, devices, batch_size, lr, epochs, limit,
                                 warmup, {"torch": torch_threads, "jax": jax_threads}[name], seed,
                                 results, log)

    if "flops" in parts:
        _say(log, f"bench train: sgemm {gemm_size}x{gemm_size} on cpu(0) with all threads ...")
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
        _say(log, f"bench train: deterministic against default step on {_n(k, 'device')} ...")
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


def _bench_rival(name, py, info, data, devices, batch_size, lr, epochs, limit, warmup,
                 threads, seed, results, log) -> Dict:
    """Runs a rival's LeNet variants (torch: the chapter's code on each k, nn.Sequential, the
    chapter with its DataLoader; jax: the chapter's pmap_step on each k) and adds their rows to
    ``results``; returns the rival's settings (versions, threads) or {"skipped": why}."""
    what = _FRAMEWORK[name]
    if py is None:
        _say(log, f"bench train: skipping the {what} comparison: {info}")
        return {"skipped": info}
    # JAX: one process per device count, each with exactly k host devices, because XLA divides
    # its CPU threads among a process's host devices (a 1-device step in a process with 2 of
    # them runs on one thread).
    runs = [list(devices)] if name == "torch" else [[k] for k in devices]
    rival: Dict = {}
    for ks in runs:
        _say(log, f"bench train: the chapter's {what} code on {','.join(map(str, ks))} "
                  f"device(s) with {py} ({name} {info}) ...")
        got = _run_rival(name, py, data.get("dir"), data["train_examples"] if data["source"] ==
                         "synthetic" else 0, ks, batch_size, lr, epochs, limit, warmup, threads,
                         seed)
        for r in got.pop("results"):
            r.setdefault("threads", got["threads"])
            results.append(_rival_entry(name, r))
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
    if rows:  # none when only the side parts (e.g. --parts deterministic) ran
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
    for d in r.get("deterministic", []):
        a, b = d["default"], d["deterministic"]
        lines.append(f"deterministic (train_batch deterministic=True, {d['shards']} shards) on "
                     f"{_n(d['num_devices'], 'device')}: {_ms(b['wall']['median'])} ms/step wall, "
                     f"{_ms(b['cpu']['median'])} ms/step CPU against the default step's "
                     f"{_ms(a['wall']['median'])} wall, {_ms(a['cpu']['median'])} CPU: cost "
                     f"{d['wall_cost_percent']:+.1f}% wall, {d['cpu_cost_percent']:+.1f}% CPU "
                     "(process CPU time, all threads; interleaved epochs, medians)")
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
    if t and "skipped" not in t:
        lines.append(f"PyTorch {t['torch_version']} ({t['python']}), {t['threads']} threads, "
                     "shards of the chapter's code run one after the other on the CPU")
    j = r.get("jax")
    if j and "skipped" not in j:
        lines.append(_jax_line(j) + ", the chapter's pmap_step on k host devices")
    lines += _skipped_lines(r)
    if r.get("comparisons"):
        lines.append("")
        lines.append("ratio = rival ms/step / mgpu ms/step (medians; above 1: mgpu is faster)")
        lines += _table(["mgpu", "rival", "ratio"],
                        [[c["mgpu"], c[c["rival"]], f"{c['ratio']:.2f}"]
                         for c in r["comparisons"]], "llr")
    return "\n".join(lines)


def _jax_line(j: Dict) -> str:
    return (f"JAX {j['jax_version']} (Flax {j['flax_version']}, Optax {j['optax_version']}; "
            f"{j['python']}), {j['threads']} CPUs for XLA's threads, one process per device "
            "count k (XLA_FLAGS --xla_force_host_platform_device_count=k)")


def _skipped_lines(r: Dict) -> List[str]:
    return [f"{_FRAMEWORK[name]} comparison skipped: {r[name]['skipped']}"
            for name in RIVALS if "skipped" in r.get(name, {})]


# --- ResNet-18 (sec. 12.6): the fused step, the book's loop, PyTorch eager and compiled --------

RESNET_PARTS = ("fused", "op-by-op")


def _resnet18_side(cfg: Dict) -> Dict:
    """One mgpu configuration (``cfg['impl']`` 'fused' or 'op-by-op' on ``cfg['num_devices']``
    devices), timed by ``_rival_common.run_config`` as the rivals are; run in its own process
    so its peak RSS is its own."""
    from .. import _rival_common as rival
    from .. import nn, optim
    from ..models import resnet18
    from ..random import seed as mgpu_seed
    k = int(cfg["num_devices"])
    devices = [try_gpu(i) for i in range(k)]
    if cfg["synthetic"]:
        images, labels = rival.synthetic_split(cfg["synthetic"], cfg["seed"])
    else:
        images, labels = rival.load_split(cfg["data_dir"], "train")
    # The rivals' shuffled batches, made mgpu tensors on the first device.
    batches = rival.Batches(images, labels, cfg["batch_size"], cfg["limit"], cfg["seed"],
                            make=lambda X, y: (array(X, device=devices[0]),
                                               array(y, device=devices[0])))
    mgpu_seed(cfg["seed"])
    net = resnet18(10, 1)
    model = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(model.parameters(), lr=cfg["lr"])
    loss = nn.CrossEntropyLoss()
    if cfg["impl"] == "fused":
        def step(X, y):
            return model.train_step(X, y, loss, trainer).item() * X.shape[0]
        name = f"mgpu ResNet-18 fused train_step, {_n(k, 'device')}"
    else:
        def step(X, y):
            trainer.zero_grad()
            out = loss(model(X), y)
            out.backward()
            trainer.step()
            return out.item() * X.shape[0]
        name = f"mgpu ResNet-18 book's loop (autograd), {_n(k, 'device')}"
    # The allocator's counters from the end of the warm-up: the first steps fill its cache (the
    # first step's blocks, then the reserve made before the second), the timed ones should not.
    before = {}
    r = rival.run_config(name, step, batches, cfg["epochs"], cfg["warmup"],
                         on_timed=lambda: before.update(_core.cpu_memory_stats()))
    after = _core.cpu_memory_stats()
    r.update(impl=f"mgpu {cfg['impl']}", num_devices=k, global_batch=cfg["batch_size"],
             threads=_core.num_threads(), devices=[str(d) for d in devices],
             peak_rss_bytes=rival.peak_rss_bytes(),
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
                           text=True, cwd=cwd, env=dict(os.environ, PYTHONPATH=_package_root()
                                                        + os.pathsep
                                                        + os.environ.get("PYTHONPATH", "")))
    if r.returncode != 0:
        raise RuntimeError(f"bench train: the mgpu run {cfg['impl']} on "
                           f"{_n(cfg['num_devices'], 'device')} failed:\n"
                           f"{r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _package_root() -> str:
    # The directory holding this mgpu package, so the side process imports the same build.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
                         jax_threads: int = 2) -> Dict:
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
    image with 1 device's (PyTorch keeps ``batch_size``)."""
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
    rivals = _find_rivals(parse_compare(compare), {"torch": torch_python, "jax": jax_python})
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
    settings = dict(model="resnet18", devices=devices, batch_size=batch_size, lr=lr,
                    epochs=epochs, limit_batches=limit, warmup=warmup, seed=seed,
                    compare=compare, torch_threads=torch_threads, jax_threads=jax_threads,
                    parts=sides, data=data, weak_scaling=bool(weak_scaling))
    out = header("train", settings)
    flops = resnet18_step_flops(batch_size)
    out["flops"] = {"per_step": flops, "per_image": flops // int(batch_size)}
    results: List[Dict] = []
    out["results"] = results
    base = dict(batch_size=int(batch_size), lr=float(lr), epochs=int(epochs), limit=limit,
                warmup=warmup, seed=int(seed), synthetic=int(synthetic),
                data_dir=data.get("dir"))
    for side in sides:
        for k in devices:
            batch = int(batch_size) * (k if weak_scaling else 1)
            _say(log, f"bench train: ResNet-18 {side} on {_n(k, 'device')}, batch {batch} "
                      "(own process) ...")
            results.append(_entry(_run_side(dict(base, impl=side, num_devices=k,
                                                 batch_size=batch)),
                                  flops * batch // int(batch_size)))
    run = dict(data_dir=data.get("dir"), synthetic=int(synthetic), lr=lr, epochs=epochs,
               limit=limit, warmup=warmup, seed=seed)
    for name, (py, info) in rivals.items():
        if py is None:
            _say(log, f"bench train: skipping the {_FRAMEWORK[name]} comparison: {info}")
            out[name] = {"skipped": info}
            continue
        out[name] = {"python": py, f"{name}_version": info}
        # torch: each variant on one device; jax: the Flax step on each k (batch as mgpu's).
        configs = ([(v, 1, int(batch_size)) for v in torch_variants] if name == "torch" else
                   [("resnet18", k, int(batch_size) * (k if weak_scaling else 1))
                    for k in devices])
        for variant, k, batch in configs:
            _say(log, f"bench train: {_FRAMEWORK[name]} {variant} on {_n(k, 'device')}, batch "
                      f"{batch}, with {py} (own process) ...")
            rival = _run_rival(name, py, devices=[k], batch_size=batch, variants=variant,
                               threads=torch_threads if name == "torch" else jax_threads, **run)
            for key, v in rival.items():
                if key != "results" and key not in out[name]:
                    out[name][key] = v
            for r in rival["results"]:
                r["impl"] = ("torch " + ("compile" if variant.endswith("compile") else "eager")
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
    lines += _machine_lines(r)
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
                     _ms(x["sec_per_step"]["median"]), f"{x['sec_per_image'] * 1e3:.3f}",
                     _ms(cpu["median"]) if cpu else "-", f"{x['gflops']:.1f}",
                     _mib(x.get("peak_rss_bytes")), _mib(x.get("allocator_peak_bytes")),
                     _mib(x.get("allocator_held_bytes")),
                     str(x.get("system_mallocs_timed", "-"))])
    lines += _table(["configuration", "threads", "batch", "ms/step", "ms/image", "cpu ms/step",
                     "GFLOP/s", "peak RSS MiB", "alloc peak MiB", "alloc held MiB", "mallocs"],
                    rows, "lrrrrrrrrrr")
    lines.append("cpu ms/step: process CPU time per step (all threads); peak RSS: the process's "
                 "most resident memory (ru_maxrss: Python, data, libraries and mgpu's allocator); "
                 "alloc peak: the most bytes mgpu's CPU allocator had handed out at once; alloc "
                 "held: what it took from the system (address space, resident once written); "
                 "mallocs: blocks it took from the system during the timed epochs")
    t = r.get("torch")
    if t and "skipped" not in t:
        lines.append(f"PyTorch {t['torch_version']} ({t['python']}), {t.get('threads')} threads")
    j = r.get("jax")
    if j and "skipped" not in j:
        lines.append(_jax_line(j) + "; the Flax step jitted on 1 device, pmapped on more")
    lines += _skipped_lines(r)
    if r.get("comparisons"):
        lines.append("")
        lines.append("time = rival ms/image / mgpu ms/image (above 1: mgpu faster); memory = mgpu "
                     "peak RSS / rival peak RSS (below 1: mgpu smaller)")
        lines += _table(["mgpu", "rival", "time", "memory"],
                        [[c["mgpu"], c[c["rival"]], f"{c['time_ratio']:.2f}",
                          f"{c['memory_ratio']:.2f}"] for c in r["comparisons"]], "llrr")
    if r.get("weak_scaling"):
        lines.append("")
        lines.append("weak scaling: ms per image on k devices at batch k x b against 1 device at "
                     "b (issue 17's target: within 10 %, ratio <= 1.10)")
        for w in r["weak_scaling"]:
            lines.append(f"  {w['impl']}, {_n(w['num_devices'], 'device')} at batch {w['batch']}: "
                         f"{w['sec_per_image'] * 1e3:.3f} ms/image vs 1 device at batch "
                         f"{w['one_device_batch']}: {w['one_device_sec_per_image'] * 1e3:.3f} "
                         f"ms/image, ratio {w['ratio']:.3f}")
    return "\n".join(lines)
