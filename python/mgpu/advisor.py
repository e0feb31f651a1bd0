"""``python -m mgpu advise``: why two devices are not twice as fast (issue 14). Measures, on this
machine, each layer's forward and backward time against the per-device batch (from the timeline of
a one-device step), the all-reduce time against size (latency + bytes / bandwidth), the host's
per-step overhead and the input pipeline; then predicts step time, epoch time and speed-up for 1..N
devices and several batch sizes, and names the part that bounds each case. A described machine
(JSON) is predicted from the same measurements, scaled by its FLOP rate and links: not measured.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Example described machines (rough public figures of the hardware class, effective rates, not
# peaks): what --machine takes. Nothing here is measured.
EXAMPLE_MACHINES = {
    "8gpu-nvlink": {"name": "8 GPUs on NVLink (described)", "devices": 8,
                    "device_flops": 60e12, "memory_bandwidth": 1.5e12,
                    "link_bandwidth": 150e9, "link_latency": 8e-6, "launch_overhead": 5e-6},
    "8gpu-pcie": {"name": "8 GPUs on PCIe 4 (described)", "devices": 8,
                  "device_flops": 60e12, "memory_bandwidth": 1.5e12,
                  "link_bandwidth": 12e9, "link_latency": 20e-6, "launch_overhead": 5e-6},
}
MACHINE_KEYS = ("devices", "device_flops", "memory_bandwidth", "link_bandwidth", "link_latency")


# ---- the model: a measurement table in, predictions out (no measuring here) ------------------

def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least squares y = a + b x, with a >= 0 (a negative fixed cost is noise: refit through 0)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1 or np.ptp(xs) == 0:
        return 0.0, float(np.mean(ys / np.maximum(xs, 1e-30)))
    b, a = np.polyfit(xs, ys, 1)
    if a < 0:
        return 0.0, float(np.sum(xs * ys) / np.sum(xs * xs))
    return float(a), float(b)


def allreduce_time(nbytes: float, k: int, latency: float, bus_bandwidth: float) -> float:
    """A ring all-reduce of nbytes per device over k participants: 2(k-1) latency-bound steps
    and 2(k-1)/k of the data through each link (what busbw measures)."""
    if k <= 1:
        return 0.0
    return 2 * (k - 1) * latency + 2 * (k - 1) / k * nbytes / bus_bandwidth


def fit_allreduce(points: Sequence[Tuple[int, int, float]]) -> Dict:
    """(k, bytes, seconds) samples -> latency and bus bandwidth of allreduce_time (least squares
    on t = 2(k-1) latency + 2(k-1)/k bytes / bw)."""
    A = np.array([[2 * (k - 1), 2 * (k - 1) / k * n] for k, n, _ in points], float)
    t = np.array([s for _, _, s in points], float)
    (lat, inv_bw), *_ = np.linalg.lstsq(A, t, rcond=None)
    if lat < 0:  # noise at small sizes: keep the bandwidth term only
        lat, inv_bw = 0.0, float(np.sum(A[:, 1] * t) / np.sum(A[:, 1] ** 2))
    return {"latency": float(lat), "bus_bandwidth": float(1.0 / max(inv_bw, 1e-30)),
            "points": [list(p) for p in points]}


def _threads_for(meas: Dict, k: int) -> Tuple[str, float]:
    """The measured thread count nearest to a CPU device's share with k devices, and the slowdown
    when k devices are more than the cores (they then time-share them)."""
    cores = int(meas["cores"])
    share = max(1, cores // k)
    have = sorted(int(t) for t in meas["compute"])
    t = min(have, key=lambda x: (abs(x - share), x))
    return str(t), max(1.0, k * t / cores)


def predict(meas: Dict, k: int, batch: int, ranks: int = 1, machine: Optional[Dict] = None,
            epoch_examples: int = 60000) -> Dict:
    """Step time of k devices per rank (ranks processes) with global batch `batch`.

    The step: the host enqueues it (overhead: fixed + per device), the devices run it, the input
    pipeline prepares the next batch, all at once: step = max(host, device, input). A device runs
    its steps in order (split/copy, each layer forward, loss, each layer backward, update); a
    gradient bucket's all-reduce runs when the last device has produced it: on CPU devices on the
    same worker threads (in series with compute), on a described GPU machine on a communication
    stream (overlapping the remaining backward; the update waits for it). On CPU devices that
    share the machine's cores with the host, the cores also bound it: (host + busy core-seconds)
    / cores. Returns the parts, the step, the epoch time and the bounding part.
    """
    if k < 1 or batch < 1 or ranks < 1:
        raise ValueError(f"predict: devices, batch and ranks must be >= 1, got {k}, {batch}, "
                         f"{ranks}")
    shard = math.ceil(batch / (k * ranks))
    if machine is None:
        tkey, slow = _threads_for(meas, k)
        steps = meas["compute"][tkey]["steps"]

        def dur(e):
            return (e["fixed"] + e["per_example"] * shard) * slow
        ar = meas.get("allreduce") or {}
        mpi = meas.get("mpi") or {}

        def comm(nbytes):
            t = allreduce_time(nbytes, k, ar.get("latency", 0.0), ar.get("bus_bandwidth", 1e30))
            if ranks > 1:
                if not mpi:
                    raise ValueError("predict: ranks > 1 needs an MPI all-reduce measurement "
                                     "(run the advisor under mpirun)")
                t += allreduce_time(nbytes, ranks, mpi["latency"], mpi["bus_bandwidth"])
            return t
        overlap = False
    else:
        top = str(max(int(t) for t in meas["compute"]))
        steps = meas["compute"][top]["steps"]
        flops_here = meas["gemm_flops"][top]

        def dur(e):
            if e["phase"] == "update":
                return (e["ops"] * machine.get("launch_overhead", 5e-6) +
                        3 * 4 * meas["param_floats"] / machine["memory_bandwidth"])
            # This machine's time per example, as FLOPs at its sgemm rate, at the target's rate.
            return (e["ops"] * machine.get("launch_overhead", 5e-6) +
                    e["per_example"] * flops_here * shard / machine["device_flops"])

        def comm(nbytes):
            return allreduce_time(nbytes, k * ranks, machine["link_latency"],
                                  machine["link_bandwidth"])
        overlap = machine.get("overlap", True)
    t = comm_free = compute = comm_total = 0.0
    for e in steps:
        if e["phase"] == "bucket":
            c = comm(4 * e["floats"])
            comm_total += c
            if overlap:
                comm_free = max(t, comm_free) + c
            else:
                t += c
            continue
        if e["phase"] == "update" and overlap:
            t = max(t, comm_free)
        d = dur(e)
        compute += d
        t += d
    device = max(t, comm_free)
    host = meas["host"]["fixed"] + meas["host"]["per_device"] * k
    inp = meas.get("input")
    input_t = (inp["fixed"] + inp["per_example"] * batch) if inp else 0.0
    cores_t = 0.0
    if machine is None and meas.get("device_kind", "cpu") == "cpu":
        cores_t = (host + k * compute * int(tkey) / slow) / int(meas["cores"])
    step = max(host, device, input_t, cores_t)
    parts = {"compute": compute, "communication": device - compute, "overhead": host,
             "input": input_t}
    bound = max(parts, key=parts.get)
    return {"devices": k, "ranks": ranks, "batch": batch, "shard": shard, "step": step,
            "device": device, "cores": cores_t, "parts": parts, "comm_total": comm_total,
            "bound": bound, "epoch": step * math.ceil(epoch_examples / batch),
            "measured": machine is None}


def predict_table(meas: Dict, max_devices: int, batches: Sequence[int], ranks: int = 1,
                  machine: Optional[Dict] = None, epoch_examples: int = 60000) -> List[Dict]:
    rows = []
    for b in batches:
        base = predict(meas, 1, b, ranks, machine, epoch_examples)["step"]
        for k in range(1, max_devices + 1):
            r = predict(meas, k, b, ranks, machine, epoch_examples)
            r["speedup"] = base / r["step"]
            rows.append(r)
    return rows


def crossover(meas: Dict, k: int = 2, machine: Optional[Dict] = None,
              batches: Sequence[int] = tuple(2 ** i for i in range(4, 15))) -> Optional[int]:
    """The smallest global batch at which k devices beat one (None if none in `batches`)."""
    for b in batches:
        one, more = (predict(meas, n, b, machine=machine)["step"] for n in (1, k))
        if one > more:
            return b
    return None


# ---- measuring ---------------------------------------------------------------------------------

def _runner(model: str, devices, seed: int = 0) -> Callable:
    """A function (X, y) -> None doing one fused data-parallel step of `model` on `devices`."""
    from . import models, nn, optim
    from .parallel import get_params, train_batch
    if model == "lenet":
        params = models.lenet_params(seed=seed)
        device_params = [get_params(params, d) for d in devices]
        return lambda X, y: train_batch(X, y, device_params, devices, 0.05)
    if model == "resnet18":
        from . import random
        random.seed(seed)
        net = nn.DataParallel(models.resnet18(10, 1), device_ids=devices)
        trainer = optim.SGD(net.parameters(), 0.01)
        loss = nn.CrossEntropyLoss()
        return lambda X, y: net.train_step(X, y, loss, trainer)
    raise ValueError(f"advise: --model must be lenet or resnet18, got {model!r}")


def _batch(n: int, seed: int = 0):
    from .tensor import array
    rng = np.random.default_rng(seed)
    X = array(rng.random((n, 1, 28, 28), dtype=np.float32))
    y = array(rng.integers(0, 10, n).astype(np.int64))
    return X, y


def _trace_steps(step: Callable, X, y, steps: int) -> Dict:
    """Runs `steps` steps (each waited for) inside mgpu.profile and returns the parsed trace."""
    from . import _core
    from .trace import profile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof = profile(path)
    try:
        with prof:
            for _ in range(steps):
                step(X, y)
                _core.waitall()
        with open(prof.written[0]) as f:  # under mpirun, this rank's file
            return json.load(f)
    finally:
        for f in {path, *prof.written}:
            if os.path.exists(f):
                os.unlink(f)


def _tracks(doc: Dict) -> Dict[str, List[Dict]]:
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out: Dict[str, List[Dict]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(names.get(e["tid"], str(e["tid"])), []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


_HOST_STEP = ("train_batch", "DataParallel.train_step")


def parse_step_trace(doc: Dict, steps: int, device: str = "cpu(0)") -> Dict:
    """One device's step from a trace of `steps` steps: the layer spans in order with their
    median time (s) and op count, the buckets (after which span, how many floats), and the
    host's time per step (median of the Python step call)."""
    tr = _tracks(doc)
    dev = tr.get(device, [])
    groups = [e for e in dev if e.get("cat") == "layer"]
    tasks = [e for e in dev if e.get("cat") == "task"]
    order: List[str] = []
    times: Dict[str, List[float]] = {}
    counts: Dict[str, List[int]] = {}
    j = 0
    for g in groups:
        # A layer's time is its tasks' (busy) time: the gaps between them are the device
        # waiting for the host or for the operating system, not the layer's work.
        busy, n = 0.0, 0
        while j < len(tasks) and tasks[j]["ts"] < g["ts"] + g["dur"]:
            if tasks[j]["ts"] >= g["ts"]:
                busy += tasks[j]["dur"] * 1e-6
                n += 1
            j += 1
        name = g["name"]
        if name not in times:
            order.append(name)
        times.setdefault(name, []).append(busy)
        counts.setdefault(name, []).append(n)
    entries = []
    for name in order:
        ts = times[name]
        # The least perturbed step (timings on a shared machine only ever grow); a name met
        # more often than once per step (a layer run twice) counts its mean total.
        per_step = sum(ts) / steps if len(ts) > steps else min(ts)
        phase = ("update" if name == "sgd update" else "split" if name.startswith("split")
                 else "loss" if name.startswith("loss") else
                 "backward" if name.endswith("backward") else "forward")
        entries.append({"name": name, "phase": phase, "seconds": per_step,
                        "ops": int(statistics.median(counts[name]))})
    host = tr.get("host", [])
    buckets = []
    scopes = [e for e in host if e.get("cat") == "scope"]
    for e in scopes:
        if not e["name"].startswith("allreduce bucket"):
            continue
        floats = int(e["name"].split("(")[1].split()[0])
        inside = [s for s in scopes if s is not e and s["ts"] <= e["ts"] and
                  s["ts"] + s["dur"] >= e["ts"] + e["dur"] and s["name"].endswith("backward")]
        after = inside[-1]["name"] if inside else None
        b = {"name": e["name"].split(" (")[0], "after": after, "floats": floats}
        if b not in buckets:
            buckets.append(b)
    host_steps = [e["dur"] * 1e-6 for e in host if e["name"] in _HOST_STEP]
    if not entries or not host_steps:
        raise ValueError("advise: the step's trace has no layer spans on " + device)
    return {"entries": entries, "buckets": buckets, "host": min(host_steps)}


def _gemm_flops(threads: int, n: int = 384, repeat: int = 5) -> float:
    """This machine's sgemm rate (FLOP/s) with `threads` threads: the yardstick that turns its
    per-example times into FLOPs for a described machine."""
    from . import _core
    from .ops import mm
    from .tensor import array
    A = array(np.random.default_rng(0).random((n, n), dtype=np.float32))
    _core.set_num_threads(threads)
    mm(A, A)
    _core.waitall()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mm(A, A)
        _core.waitall()
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(ts)


def measure_allreduce(ks: Sequence[int], sizes: Sequence[int], repeat: int = 5) -> Dict:
    from . import _core
    from .device import try_gpu
    from .parallel import allreduce
    from .tensor import zeros
    points = []
    for k in ks:
        devs = [try_gpu(i) for i in range(k)]
        for size in sizes:
            data = [zeros((size // 4,), device=d) for d in devs]
            allreduce(data)
            _core.waitall()
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                allreduce(data)
                _core.waitall()
                ts.append(time.perf_counter() - t0)
            points.append((k, size, min(ts)))
    return fit_allreduce(points)


def measure_mpi_allreduce(sizes: Sequence[int], repeat: int = 5) -> Optional[Dict]:
    from . import _core, distributed
    if distributed.world_size() <= 1:
        return None
    from .tensor import zeros
    points = []
    for size in sizes:
        t = zeros((size // 4,), device=distributed.device())
        distributed.allreduce(t)
        _core.waitall()
        ts = []
        for _ in range(repeat):
            distributed.barrier()
            _core.waitall()
            t0 = time.perf_counter()
            distributed.allreduce(t)
            _core.waitall()
            ts.append(time.perf_counter() - t0)
        points.append((distributed.world_size(), size, min(ts)))
    return fit_allreduce(points)


def measure_input(batches: Sequence[int], n: int) -> Optional[Dict]:
    """The data loader's time per batch (its "load batch" spans), fitted against batch size."""
    from .data import load_data_fashion_mnist
    from .trace import profile
    xs, ys = [], []
    for b in batches:
        try:
            it, _ = load_data_fashion_mnist(b, limit_batches=n)
        except FileNotFoundError:
            return None
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof = profile(path)
        try:
            with prof:
                for _ in it:
                    pass
            with open(prof.written[0]) as f:  # under mpirun, this rank's file
                tr = _tracks(json.load(f))
        finally:
            for f in {path, *prof.written}:
                if os.path.exists(f):
                    os.unlink(f)
        loads = [e["dur"] * 1e-6 for e in tr.get("data loader", []) if e["name"] == "load batch"]
        if loads:
            xs.append(b)
            ys.append(min(loads))
    if not xs:
        return None
    a, c = _fit_line(xs, ys)
    return {"fixed": a, "per_example": c}


def measure(model: str = "lenet", max_devices: int = 2, quick: bool = False,
            log: Callable[[str], None] = lambda s: None) -> Dict:
    """The measurement table of this machine for `model` (see predict for what it holds)."""
    from . import _core, distributed
    from .device import try_gpu
    cores = _core.num_threads()
    gpus = _core.num_gpus() > 0
    batches = ([16, 64] if quick else [32, 128, 512]) if model == "lenet" else \
        ([4, 8] if quick else [8, 16, 32])
    steps = 3 if quick else 6
    ks = range(1, max_devices + 1)
    threads = sorted({max(1, cores // k) for k in ks}) if not gpus else [cores]
    meas: Dict = {"model": model, "cores": cores, "device_kind": "gpu" if gpus else "cpu",
                  "measured_on": _machine_name(), "compute": {}, "gemm_flops": {},
                  "batches": batches, "quick": quick}
    try:
        host_by_k: Dict[int, float] = {}
        for t in threads:
            _core.set_num_threads(t)
            meas["gemm_flops"][str(t)] = _gemm_flops(t)
            per_batch = []
            for b in batches:
                log(f"advise: {model} step, batch {b} on 1 device, {t} thread(s) ...")
                dev = [try_gpu(0)]
                step = _runner(model, dev)
                X, y = _batch(b)
                for _ in range(2):
                    step(X, y)
                _core.waitall()
                per_batch.append((b, parse_step_trace(_trace_steps(step, X, y, steps), steps,
                                                      str(dev[0]))))
                if t == max(threads):
                    host_by_k.setdefault(1, per_batch[-1][1]["host"])
            meas["compute"][str(t)] = {"steps": _fit_steps(per_batch)}
        _core.set_num_threads(cores)
        # The host's overhead per extra device: a 2-device step's host time (same code path).
        if max_devices >= 2:
            devs = [try_gpu(i) for i in range(2)]
            step = _runner(model, devs)
            X, y = _batch(batches[0])
            for _ in range(2):
                step(X, y)
            _core.waitall()
            host_by_k[2] = parse_step_trace(_trace_steps(step, X, y, steps), steps,
                                            str(devs[0]))["host"]
        h1 = max(0.0, host_by_k.get(2, host_by_k[1]) - host_by_k[1])
        meas["host"] = {"fixed": max(0.0, host_by_k[1] - h1), "per_device": h1}
        sizes = [4096, 262144, 2097152] if quick else [4096, 65536, 524288, 4194304]
        log("advise: all-reduce over " + ", ".join(f"{k} devices" for k in ks if k > 1) + " ...")
        meas["allreduce"] = measure_allreduce([k for k in ks if k > 1] or [2], sizes,
                                              3 if quick else 7)
        meas["mpi"] = measure_mpi_allreduce(sizes, 3 if quick else 7)
        meas["world_size"] = distributed.world_size()
        log("advise: input pipeline ...")
        meas["input"] = measure_input([batches[0] * 4, batches[-1] * 4], 3 if quick else 8)
        meas["param_floats"] = sum(b["floats"] for b in
                                   meas["compute"][str(threads[0])]["steps"]
                                   if b["phase"] == "bucket")
    finally:
        _core.set_num_threads(cores)
    return meas


def _fit_steps(per_batch: List[Tuple[int, Dict]]) -> List[Dict]:
    """Per-batch parsed steps -> the step's entries with fixed + per-example times, buckets in
    place (after the backward that produced them)."""
    first = per_batch[-1][1]
    out = []
    for e in first["entries"]:
        pts = [(b, x["seconds"]) for b, p in per_batch for x in p["entries"]
               if x["name"] == e["name"]]
        a, c = _fit_line([b for b, _ in pts], [s for _, s in pts])
        out.append({"name": e["name"], "phase": e["phase"], "fixed": a, "per_example": c,
                    "ops": e["ops"]})
        for bk in first["buckets"]:
            if bk["after"] == e["name"]:
                out.append({"name": bk["name"], "phase": "bucket", "floats": bk["floats"]})
    placed = {e["name"] for e in out}
    # A bucket whose backward span was not found (none expected) is reduced before the update.
    at = next((i for i, e in enumerate(out) if e["phase"] == "update"), len(out))
    for bk in first["buckets"]:
        if bk["name"] not in placed:
            out.insert(at, {"name": bk["name"], "phase": "bucket", "floats": bk["floats"]})
    return out


def _machine_name() -> str:
    from .bench.common import machine_info
    m = machine_info()
    load = m.get("loadavg")
    return f"{m.get('cpu_model') or '?'}, load {load[0]:.1f}" if load else m.get("cpu_model", "?")


def measure_step(model: str, k: int, batch: int, steps: int = 5, repeat: int = 3) -> float:
    """A real run: seconds per step of `steps` back-to-back steps (the best of `repeat`: the
    model predicts an unloaded machine, and load only ever adds time)."""
    from . import _core
    from .device import try_gpu
    devs = [try_gpu(i) for i in range(k)]
    step = _runner(model, devs)
    X, y = _batch(batch)
    for _ in range(2):
        step(X, y)
    _core.waitall()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(X, y)
        _core.waitall()
        ts.append((time.perf_counter() - t0) / steps)
    return min(ts)


# ---- the command ---------------------------------------------------------------------------------

def _load_machine(path: str) -> Dict:
    if path in EXAMPLE_MACHINES:
        return dict(EXAMPLE_MACHINES[path])
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"advise: --machine {path!r} not found; give a JSON file or one "
                                f"of {', '.join(EXAMPLE_MACHINES)}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"advise: --machine {path}: not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise ValueError(f"advise: --machine {path}: expected a JSON object")
    missing = [k for k in MACHINE_KEYS if k not in m]
    if missing:
        raise ValueError(f"advise: --machine {path} lacks {', '.join(missing)}; e.g. "
                         f"{json.dumps(EXAMPLE_MACHINES['8gpu-nvlink'])}")
    for k in MACHINE_KEYS:
        if not isinstance(m[k], (int, float)) or m[k] <= 0:
            raise ValueError(f"advise: --machine {path}: {k} must be a positive number, got "
                             f"{m[k]!r}")
    m.setdefault("name", os.path.basename(path) + " (described)")
    return m


def format_table(rows: List[Dict], measured: bool, title: str) -> str:
    lines = [title, "figures are " + ("predicted from measurements on this machine" if measured
                                      else "NOT MEASURED: predicted for a described machine"),
             f"{'batch':>6} {'dev':>3} {'step ms':>9} {'epoch s':>8} {'speedup':>7} "
             f"{'compute':>8} {'comm':>7} {'host':>7} {'input':>7}  bound"]
    for r in rows:
        p = r["parts"]
        extra = f"  measured {r['measured_step'] * 1e3:.2f} ms ({r['error'] * 100:+.0f} %)" \
            if "measured_step" in r else ""
        lines.append(f"{r['batch']:>6} {r['devices']:>3} {r['step'] * 1e3:>9.2f} "
                     f"{r['epoch']:>8.2f} {r['speedup']:>7.2f} {p['compute'] * 1e3:>8.2f} "
                     f"{p['communication'] * 1e3:>7.2f} {p['overhead'] * 1e3:>7.2f} "
                     f"{p['input'] * 1e3:>7.2f}  {r['bound']}{extra}")
    return "\n".join(lines)


def plot_speedup(rows: List[Dict], path: Optional[str] = None, ax=None, title: str = ""):
    """Speed-up against global batch size, one line per device count (measured points, where
    the rows carry them, as markers)."""
    from matplotlib.figure import Figure
    fig = None
    if ax is None:
        fig = Figure(figsize=(6, 3.5), layout="constrained")
        ax = fig.subplots()
    ks = sorted({r["devices"] for r in rows if r["devices"] > 1})
    for i, k in enumerate(ks):
        rs = sorted((r for r in rows if r["devices"] == k), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], marker=".",
                color=f"C{i}", label=f"{k} devices, predicted")
        ms = [r for r in rs if "measured_speedup" in r]
        if ms:
            ax.plot([r["batch"] for r in ms], [r["measured_speedup"] for r in ms], "x",
                    color=f"C{i}", markersize=8, label=f"{k} devices, measured")
    ax.axhline(1.0, color="0.5", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel("speed-up over 1 device")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, linewidth=0.3)
    fig = fig or ax.figure
    if path:
        fig.savefig(path, dpi=130)
    return fig


def validate(meas: Dict, model: str, batches: Sequence[int], max_devices: int,
             steps: int = 5, repeat: int = 3, log=lambda s: None) -> List[Dict]:
    """Predicted against measured step time for 1..max_devices devices and each batch size."""
    rows = predict_table(meas, max_devices, batches)
    base: Dict[int, float] = {}
    for r in rows:
        log(f"advise: validating {r['devices']} device(s), batch {r['batch']} ...")
        r["measured_step"] = measure_step(model, r["devices"], r["batch"], steps, repeat)
        r["error"] = r["step"] / r["measured_step"] - 1
        if r["devices"] == 1:
            base[r["batch"]] = r["measured_step"]
        r["measured_speedup"] = base[r["batch"]] / r["measured_step"]
    return rows


def main(args) -> int:
    from . import distributed
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    machine = _load_machine(args.machine) if args.machine else None
    if any(b < 1 for b in args.batch_size):
        raise ValueError(f"advise: batch sizes must be >= 1, got {args.batch_size}")
    n = args.devices or (machine["devices"] if machine else 2)
    if n < 1:
        raise ValueError(f"advise: --devices must be >= 1, got {n}")
    if args.from_json:
        with open(args.from_json) as f:
            meas = json.load(f)["measurements"]
    else:
        meas = measure(args.model, max(2, n) if machine is None else 2, args.quick, log)
    out = {"measurements": meas}
    world = distributed.world_size()
    if machine is None:
        batches = sorted(set(args.batch_size))
        if args.validate:
            rows = validate(meas, args.model, batches, n, 3 if args.quick else 8,
                            2 if args.quick else 5, log)
            errs = [abs(r["error"]) for r in rows]
            summary = (f"prediction error: median {statistics.median(errs) * 100:.1f} %, worst "
                       f"{max(errs) * 100:.1f} % over {len(rows)} runs")
        else:
            rows = predict_table(meas, n, batches)
            summary = ""
        title = f"{args.model}: this machine ({meas['measured_on']}, {meas['cores']} cores)"
        if world > 1 and meas.get("mpi"):
            extra = [predict(meas, 1, b, ranks=world) for b in batches]
            summary += f"\n{world} MPI ranks, 1 device each: " + ", ".join(
                f"batch {r['batch']}: {r['step'] * 1e3:.2f} ms/step ({r['bound']})" for r in extra)
            out["mpi_predictions"] = extra
    else:
        batches = sorted(set(args.batch_size))
        rows = predict_table(meas, n, batches, machine=machine, epoch_examples=args.epoch_examples)
        title = f"{args.model}: {machine['name']}"
        summary = ""
        out["machine"] = machine
    out["predictions"] = rows
    cross = crossover(meas, 2, machine)
    out["crossover_2_devices"] = cross
    if distributed.rank() == 0:
        print(format_table(rows, machine is None, title))
        print(f"2 devices beat 1 from global batch {cross} on" if cross else
              "2 devices never beat 1 up to batch 16384 on",
              "this machine" if machine is None else machine["name"])
        if summary:
            print(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
            print(f"written to {args.json}")
        if args.plot:
            plot_speedup(rows, args.plot, title=title)
            print(f"plot written to {args.plot}")
    return 0
