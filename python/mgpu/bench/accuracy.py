"""``python -m mgpu bench accuracy``: the test accuracy a recipe reaches in each precision, over
several seeds (issue 43's accuracy targets: ResNet-18's one epoch of sec. 12.6 in bf16 within a
point of float32's mean over 3 seeds; LeNet's 10 epochs of sec. 12.5 within 0.01).

Each (seed, precision) run trains from scratch in this process, in order: seeds outer, precisions
inner, so an interrupted sweep has compared pairs. ResNet-18 trains with
``chapter.train_concise(..., fused=True)`` on ``num_gpus`` devices; LeNet with ``mgpu.train``.
Both report the test accuracy the book's loop prints (ResNet-18: batch norm's running
statistics). ResNet-18 also reports it with the statistics recomputed from ``recompute_batches``
training batches (``mgpu.optim.swa_utils.update_bn``: their plain average under the final
weights). Each row also keeps the test accuracy after every epoch (``epoch_acc``): LeNet's swings
by a point or two from one epoch to the next at lr 0.2, so its last value alone is a noisy
measure. A run's training lines go to the log (stderr), not stdout.

``checkpoint``: a directory where each run saves its state (``ckpt-PRECISION-SEED``) and from
which it resumes: a sweep of hours survives a kill and a new session.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from ..amp import check_precision
from .common import Log, header, say

MODELS = ("resnet18", "lenet")
# The chapters' recipes: sec. 12.6's ResNet-18 (one epoch, as the issue asks) and sec. 12.5's LeNet.
DEFAULTS = {"resnet18": dict(epochs=1, lr=0.1), "lenet": dict(epochs=10, lr=0.2)}


def _synthetic(n: int, seed: int, batch_size: int):
    """n random images whose label is a function of the image (which of 10 horizontal bands of
    2 rows is bright): something to learn in a few steps, for quick runs and tests; and a test
    set of n // 4 + 1."""
    import numpy as np

    from ..data import array_loader

    def split(m, s):
        rng = np.random.default_rng(s)
        labels = rng.integers(0, 10, size=m)
        images = rng.integers(0, 100, size=(m, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 * c:2 * c + 2] = rng.integers(150, 256, size=(2, 28), dtype=np.uint8)
        return images, labels.astype(np.uint8)

    train = split(n, seed)
    test = split(n // 4 + 1, seed + 1)
    return (array_loader(*train, batch_size, shuffle=True, seed=seed),
            array_loader(*test, batch_size))


def _recomputed_accuracy(net, train_iter, test_iter, device, batches: int) -> float:
    """Test accuracy after batch norm's statistics are recomputed from `batches` training
    batches (``optim.swa_utils.update_bn``: reset, then their plain average)."""
    from ..optim.swa_utils import update_bn
    from ..train import evaluate_accuracy_gpu
    update_bn(itertools.islice(train_iter, batches), net, device)
    net.eval()
    return float(evaluate_accuracy_gpu(net, test_iter, device))


def _run(model: str, seed: int, precision: str, s: Dict, checkpoint: Optional[str]) -> Dict:
    from .. import random
    from ..chapter import train_concise
    from ..data import load_data_fashion_mnist
    from ..device import try_gpu
    from ..models import resnet18
    from ..train import train
    ckpt = (os.path.join(checkpoint, f"ckpt-{precision}-{seed}") if checkpoint else None)
    data = (_synthetic(s["synthetic"], seed, s["batch_size"]) if s["synthetic"] else None)
    common = dict(data=data, data_dir=s["data_dir"], limit_batches=s["limit_batches"] or None,
                  seed=seed, progress=False, checkpoint=ckpt, resume=ckpt is not None,
                  precision=precision)
    t0 = time.perf_counter()
    if model == "lenet":
        r = train(s["num_gpus"], s["batch_size"], s["lr"], s["epochs"], plot=False, **common)
        return dict(seed=seed, precision=precision, test_acc=float(r.test_acc[-1]),
                    test_acc_recomputed=None, epoch_acc=[float(a) for a in r.test_acc],
                    seconds=time.perf_counter() - t0)
    random.seed(seed)
    net = resnet18(10)
    r = train_concise(net, s["num_gpus"], s["batch_size"], s["lr"], s["epochs"], fused=True,
                      **common)
    if data is None:
        data = load_data_fashion_mnist(s["batch_size"], data_dir=s["data_dir"],
                                       limit_batches=s["limit_batches"] or None)
    recomputed = _recomputed_accuracy(net, data[0], data[1], try_gpu(0), s["recompute_batches"])
    return dict(seed=seed, precision=precision, test_acc=float(r.test_acc[-1]),
                test_acc_recomputed=recomputed, epoch_acc=[float(a) for a in r.test_acc],
                seconds=time.perf_counter() - t0)


def summarize_accuracy(results: List[Dict], precisions: Sequence[str]) -> Dict:
    """Per precision: mean, min and max of each accuracy over the seeds; and bf16's mean minus
    float32's, in points of accuracy (where both ran)."""
    out: Dict = {}
    for p in precisions:
        rows = [r for r in results if r["precision"] == p]
        out[p] = {}
        for key in ("test_acc", "test_acc_recomputed"):
            vals = [r[key] for r in rows if r[key] is not None]
            if vals:
                out[p][key] = dict(mean=statistics.fmean(vals), min=min(vals), max=max(vals),
                                   seeds=len(vals))
    if "float32" in out and "bf16" in out:
        out["bf16_minus_float32_points"] = {
            key: 100 * (out["bf16"][key]["mean"] - out["float32"][key]["mean"])
            for key in ("test_acc", "test_acc_recomputed")
            if key in out["bf16"] and key in out["float32"]}
    return out


def bench_accuracy(model: str = "resnet18", precisions: Sequence[str] = ("float32", "bf16"),
                   seeds: Sequence[int] = (0, 1, 2), epochs: Optional[int] = None,
                   batch_size: int = 256, lr: Optional[float] = None, num_gpus: int = 1,
                   limit_batches: int = 0, recompute_batches: int = 40,
                   data_dir: Optional[str] = None, synthetic: int = 0,
                   checkpoint: Optional[str] = None, log: Log = None) -> Dict:
    """Trains ``model`` ('resnet18' or 'lenet') once per seed and precision and returns the test
    accuracies with their summary (module docstring). ``epochs`` and ``lr`` default to the
    chapter's recipe (ResNet-18: 1 epoch at 0.1; LeNet: 10 at 0.2); ``limit_batches`` shortens
    every epoch and evaluation, ``synthetic`` N trains on N generated images instead of
    Fashion-MNIST."""
    if model not in MODELS:
        raise ValueError(f"bench accuracy: model must be one of {', '.join(MODELS)}, got "
                         f"{model!r}")
    precisions = [check_precision(p, "bench accuracy: precision") for p in precisions]
    if not precisions or len(set(precisions)) != len(precisions):
        raise ValueError(f"bench accuracy: precisions must name float32 and/or bf16 once each, "
                         f"got {list(precisions)}")
    seeds = [int(x) for x in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"bench accuracy: seeds must be distinct integers, at least one, got "
                         f"{seeds}")
    epochs = DEFAULTS[model]["epochs"] if epochs is None else int(epochs)
    lr = DEFAULTS[model]["lr"] if lr is None else float(lr)
    for name, v in (("epochs", epochs), ("batch_size", batch_size), ("num_gpus", num_gpus),
                    ("recompute_batches", recompute_batches)):
        if int(v) < 1:
            raise ValueError(f"bench accuracy: {name} must be >= 1, got {v}")
    if int(limit_batches) < 0 or int(synthetic) < 0:
        raise ValueError(f"bench accuracy: limit_batches and synthetic must be >= 0, got "
                         f"{limit_batches} and {synthetic}")
    if synthetic and int(synthetic) < int(batch_size):
        raise ValueError(f"bench accuracy: --synthetic {synthetic} is less than one batch of "
                         f"{batch_size}; use a larger --synthetic or a smaller --batch-size")
    settings = dict(model=model, precisions=precisions, seeds=seeds, epochs=epochs,
                    batch_size=int(batch_size), lr=lr, num_gpus=int(num_gpus),
                    limit_batches=int(limit_batches), recompute_batches=int(recompute_batches),
                    data_dir=data_dir, synthetic=int(synthetic),
                    data="synthetic" if synthetic else "fashion-mnist")
    out = header("accuracy", settings)
    results: List[Dict] = []
    out["results"] = results
    # The training functions print their lines; they go to the log (or nowhere), not stdout.
    sink = sys.stderr if log is not None else io.StringIO()
    for seed in seeds:
        for p in precisions:
            say(log, f"bench accuracy: {model}, seed {seed}, {p}, {epochs} epoch(s) ...")
            with contextlib.redirect_stdout(sink):
                results.append(_run(model, seed, p, settings, checkpoint))
    out["summary"] = summarize_accuracy(results, precisions)
    return out


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def format_accuracy(r: Dict) -> str:
    s = r["settings"]
    lines = [f"mgpu bench accuracy: {s['model']}, {s['epochs']} epoch(s), batch {s['batch_size']}, "
             f"lr {s['lr']}, {s['num_gpus']} device(s), {s['data']}"
             + (f", {s['limit_batches']} batches per epoch" if s["limit_batches"] else ""),
             f"machine: {r['machine'].get('cpu_model', '?')}, load average "
             f"{(r['machine'].get('loadavg') or [float('nan')])[0]:.1f}", "",
             f"{'seed':>4}  {'precision':9}  {'test acc %':>10}  {'recomputed BN %':>15}  "
             f"{'minutes':>7}"]
    for x in r["results"]:
        lines.append(f"{x['seed']:>4}  {x['precision']:9}  {_pct(x['test_acc']):>10}  "
                     f"{_pct(x['test_acc_recomputed']):>15}  {x['seconds'] / 60:7.1f}")
    summ = r.get("summary", {})
    for p in s["precisions"]:
        if p in summ and "test_acc" in summ[p]:
            m = summ[p]
            rec = m.get("test_acc_recomputed")
            lines.append(f"mean {p:9}  {_pct(m['test_acc']['mean']):>10}  "
                         f"{_pct(rec['mean'] if rec else None):>15}  over "
                         f"{m['test_acc']['seeds']} seed(s)")
    diff = summ.get("bf16_minus_float32_points")
    if diff:
        lines.append("bf16 - float32 (points): " + ", ".join(
            f"{'recomputed BN' if k.endswith('recomputed') else 'test acc'} {v:+.2f}"
            for k, v in diff.items()))
    return "\n".join(lines)
