"""The advisor's measurements on this machine: effective cores, GEMM rate, all-reduce against
size, the input pipeline, each layer's time against the per-device batch, and the same under
mpirun (one rank per process)."""
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

from .model import fit_allreduce, fit_line
from .steps import (
    MIN_TRACED_SECONDS,
    feed,
    parse_step_trace,
    runner,
    trace_steps,
    tracks,
    train_split,
    warm_up,
)


def measure_effective_cores(cores: int, n: int = 384, reps: int = 6, rounds: int = 7) -> float:
    """How many cores this process really gets: `cores` CPU devices each multiply matrices with
    one thread at the same time, against one device alone (interleaved, the median of `rounds`).
    On a quiet machine each runs as fast as alone (the full count); where other jobs hold the
    cores (or a scheduler caps this process's share) they slow each other down, and k busy
    device threads run k / effective-cores slower than alone. At most `cores`."""
    from ..device import cpu
    from ..engine import core as _core
    from ..ops import mm
    from ..tensor import array
    if cores <= 1:
        return 1.0
    rng = np.random.default_rng(0)
    mats = [array(rng.random((n, n), dtype=np.float32), device=cpu(i)) for i in range(cores)]
    own = _core.num_threads()

    def run(devs: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            for a in mats[:devs]:
                mm(a, a)
        _core.waitall()
        return time.perf_counter() - t0
    ratios = []
    try:
        _core.set_num_threads(cores)
        run(cores)  # warm up every device
        for _ in range(rounds):
            _core.set_num_threads(1)
            alone = run(1)
            _core.set_num_threads(cores)  # each of `cores` busy devices gets one thread
            together = run(cores)
            ratios.append(alone / together)
    finally:
        _core.set_num_threads(own)
    return float(min(cores, max(1.0, cores * statistics.median(ratios))))


def _gemm_flops(threads: int, n: int = 384, repeat: int = 5) -> float:
    """This machine's sgemm rate (FLOP/s) with `threads` threads: the yardstick that turns its
    per-example times into FLOPs for a described machine."""
    from ..engine import core as _core
    from ..ops import mm
    from ..tensor import array
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
    from ..device import try_gpu
    from ..engine import core as _core
    from ..parallel import allreduce
    from ..tensor import zeros
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
    from .. import distributed
    from ..engine import core as _core
    if distributed.world_size() <= 1:
        return None
    from ..tensor import zeros
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
    from ..data import load_data_fashion_mnist
    from ..trace import profile
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
                tr = tracks(json.load(f))
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
    a, c = fit_line(xs, ys)
    return {"fixed": a, "per_example": c}


def small_batches(model: str, quick: bool = False) -> List[int]:
    """The small batches measure() times every layer at, whatever the batches asked for."""
    return ([16, 64] if quick else [32, 128, 512]) if model == "lenet" else \
        ([8, 32] if quick else [8, 32, 64])


def calibration_shard(model: str, quick: bool = False) -> int:
    """The examples per rank of the ranks' contention calibration (and per device of k devices'
    where no batch was asked for: contention_shards): 3/4 of the largest small batch, among
    the sizes where the layers' per-example costs dominate and no power of two, so that no
    batch size a validation predicts is its own calibration."""
    return max(1, small_batches(model, quick)[-1] * 3 // 4)


def calibration_shards(model: str, quick: bool = False) -> List[int]:
    """The examples per rank the ranks' contention and wait are calibrated at under mpirun
    (measure_rank_calibration): 3/4 of each small batch, so that the wait, a step's wall time
    less its busy time and all-reduce, is measured near the shards predicted without being
    the very step a validation measures (its last, calibration_shard, is the one of older
    tables)."""
    return sorted({max(1, b * 3 // 4) for b in small_batches(model, quick)})


# The largest shard measure() times for a batch asked for (larger ones are extrapolated from the
# points below): ResNet-18 takes ~10 ms per example with 2 threads here.
MAX_MEASURED_SHARD = {"lenet": 2048, "resnet18": 256}


# The largest shard measure() traces k devices at once on for the contention (concurrency):
# each such shard costs one device alone and k at once, a few steps each.
MAX_CONTENTION_SHARD = {"lenet": 512, "resnet18": 64}


def contention_shards(model: str, batches: Sequence[int], k: int,
                      quick: bool = False) -> List[int]:
    """The shards measure() traces k devices at once on: ceil(b / k) of each batch asked for, up
    to MAX_CONTENTION_SHARD (the ratio is held beyond the largest), as the layers are timed at
    the shards the predictions need; calibration_shard alone where no batch was asked for."""
    cap = MAX_CONTENTION_SHARD.get(model, 64)
    return sorted({min(cap, max(1, math.ceil(b / k))) for b in batches}) or \
        [calibration_shard(model, quick)]


def needed_shards(model: str, batches: Sequence[int], max_devices: int, own: int,
                  ranks: Sequence[int] = ()) -> Dict[int, List[int]]:
    """The shards each thread count computes in the configurations predicted, which measure()
    times besides its small batches: ceil(b / k) at own // k threads for k devices in this
    process, ceil(b / r) for r ranks at own // r threads, at least 1 (under mpirun each rank
    of a machine takes its share of the cores: mgpu.distributed.init), up to
    MAX_MEASURED_SHARD."""
    cap = MAX_MEASURED_SHARD.get(model, 256)
    out: Dict[int, set] = {}
    for n in [*range(1, max_devices + 1), *(r for r in ranks if r > 1)]:
        out.setdefault(max(1, own // n), set()).update(min(cap, math.ceil(b / n))
                                                       for b in batches)
    return {t: sorted(v) for t, v in out.items()}


def measure(model: str = "lenet", max_devices: int = 2, quick: bool = False,
            log: Callable[[str], None] = lambda s: None, batches: Sequence[int] = (),
            ranks: Sequence[int] = ()) -> Dict:
    """The measurement table of this machine for `model` (see predict for what it holds): the
    layers' times at a few small batches and at the shards of `batches` (the global batch
    sizes to predict) on 1..max_devices devices and on `ranks` MPI ranks, and how much slower
    k devices' layers run at once than one device's alone, at the shards of `batches` on k
    devices (contention, see concurrency and concurrent_idle). Every traced step is fed by the
    data loader as training is (feed), and short steps are traced for at least
    MIN_TRACED_SECONDS (warm_up)."""
    from .. import distributed
    from ..device import try_gpu
    from ..engine import core as _core
    world = distributed.world_size()
    # The machine's cores (under mpirun a rank may be bound to fewer: its threads say so).
    cores = (os.cpu_count() or 1) if world > 1 else len(os.sched_getaffinity(0))
    own = _core.num_threads()
    gpus = _core.num_gpus() > 0
    # Every thread count is timed at the small batches (the points below the shards asked for;
    # ResNet-18's go up to 32 and 64 examples, as its layers do not scale linearly from a few).
    asked = list(batches)
    batches = small_batches(model, quick)
    steps = 3 if quick else 6
    min_traced = MIN_TRACED_SECONDS / 2 if quick else MIN_TRACED_SECONDS
    split = train_split()  # every configuration below is fed from this one load (feed)
    ks = range(1, max_devices + 1)
    # Every thread count a device gets in the configurations predicted: own // k for k devices
    # in this process, and 1 (a rank bound to one core, or a device among more than the cores).
    threads = sorted({max(1, own // k) for k in ks} | {1}) if not gpus else [own]
    # Each thread count's shards: the small batches, and the shards the predictions need (a
    # layer's time is not one line from the small batches up: interpolate).
    need = needed_shards(model, asked, max_devices, own, ranks) if not gpus else \
        {own: sorted({min(MAX_MEASURED_SHARD.get(model, 256), math.ceil(b / k))
                      for b in asked for k in ks})}
    shards = {t: sorted(set(batches) | set(need.get(t, []))) for t in threads}
    meas: Dict = {"model": model, "cores": cores, "threads": own,
                  "device_kind": "gpu" if gpus else "cpu",
                  "measured_on": _machine_name(), "compute": {}, "gemm_flops": {},
                  "batches": batches, "quick": quick}
    try:
        host_by_k: Dict[int, float] = {}
        if not gpus and world == 1:
            log("advise: the cores this process really gets ...")
            meas["effective_cores"] = measure_effective_cores(own)
        for t in threads:
            _core.set_num_threads(t)
            meas["gemm_flops"][str(t)] = _gemm_flops(t)
        # Each batch size at every thread count in turn, so the counts compared with each other
        # are measured close together (on a shared machine the load drifts).
        per_batch: Dict[int, List[Tuple[int, Dict]]] = {t: [] for t in threads}
        for b in sorted(set().union(*shards.values())):
            for t in threads:
                if b not in shards[t]:
                    continue
                _core.set_num_threads(t)
                log(f"advise: {model} step, batch {b} on 1 device, {t} thread(s) ...")
                dev = [try_gpu(0)]
                step = runner(model, dev)
                data = feed(b, split=split)
                # Beyond the small batches a step is long enough that one warm-up and two
                # traced steps (their median is their mean) keep the quick mode quick.
                big = quick and b > batches[-1]
                n = warm_up(step, data, 1 if big else 2, 2 if big else steps, min_traced)
                per_batch[t].append((b, parse_step_trace(trace_steps(step, data, n), n,
                                                         str(dev[0]))))
                if t == max(threads) and b == batches[0]:
                    host_by_k[1] = per_batch[t][-1][1]["host"]
        for t in threads:
            pts = [(b, p["idle"]) for b, p in per_batch[t]]
            a, c = fit_line([b for b, _ in pts], [i for _, i in pts])
            meas["compute"][str(t)] = {"steps": _fit_steps(per_batch[t]),
                                       "idle": {"fixed": a, "per_example": c,
                                                "points": [list(x) for x in pts]},
                                       "shards": shards[t]}
        _core.set_num_threads(own)
        # k devices at once, each with own // k threads, at each shard the predictions of k
        # devices need (contention_shards), against one device alone with those threads on
        # that shard, traced just before (on a shared machine the load drifts: the two are
        # compared under the same load): how much slower their layers run together, by shard
        # (concurrency). And the host's overhead per extra device, from the 2-device steps' host
        # time (same code path; the median over the shards).
        meas["contention"] = {}
        host_two: List[float] = []
        for k in ks:
            if k < 2 or gpus:
                continue
            t = max(1, own // k)
            by_shard = []
            for c in contention_shards(model, asked, k, quick):
                log(f"advise: {model} step, batch {c} per device on {k} devices at once, and "
                    f"on 1 device with {t} thread(s) ...")
                busy: Dict[int, List[float]] = {}
                idle: Dict[int, List[float]] = {}
                for n in (1, k):
                    _core.set_num_threads(own if n > 1 else t)
                    devs = [try_gpu(i) for i in range(n)]
                    step = runner(model, devs)
                    data = feed(c * n, split=split)
                    traced = warm_up(step, data, 2, steps, min_traced)
                    doc = trace_steps(step, data, traced)
                    parsed = [parse_step_trace(doc, traced, str(d)) for d in devs]
                    busy[n] = [sum(e["seconds"] for e in p["entries"]) for p in parsed]
                    idle[n] = [p["idle"] for p in parsed]
                    if n == 2:
                        host_two.append(parsed[0]["host"])
                _core.set_num_threads(own)
                slow_busy, slow_idle = slowest_device(busy[k], idle[k])
                by_shard.append({"shard": c, "busy": slow_busy, "devices": busy[k],
                                 "alone": busy[1][0], "idle": slow_idle,
                                 "idle_devices": idle[k], "idle_alone": idle[1][0]})
            # The single-shard keys of older tables: the shard nearest the calibration shard.
            near = min(by_shard, key=lambda p: abs(p["shard"] - calibration_shard(model, quick)))
            meas["contention"][str(k)] = {"shard": near["shard"], "threads": t,
                                          "busy": near["busy"], "devices": near["devices"],
                                          "alone": near["alone"], "by_shard": by_shard}
        if host_two:
            host_by_k[2] = statistics.median(host_two)
        h1 = max(0.0, host_by_k.get(2, host_by_k[1]) - host_by_k[1])
        meas["host"] = {"fixed": max(0.0, host_by_k[1] - h1), "per_device": h1}
        sizes = [4096, 262144, 2097152] if quick else [4096, 65536, 524288, 4194304]
        log("advise: all-reduce over " + ", ".join(f"{k} devices" for k in ks if k > 1) + " ...")
        meas["allreduce"] = measure_allreduce([k for k in ks if k > 1] or [2], sizes,
                                              3 if quick else 7)
        here = measure_mpi_allreduce(sizes, 3 if quick else 7)
        meas["mpi"] = {str(world): dict(here, threads=own,
                                        cores=len(os.sched_getaffinity(0)))} if here else {}
        meas["world_size"] = world
        log("advise: input pipeline ...")
        meas["input"] = measure_input([batches[0] * 4, batches[-1] * 4], 3 if quick else 8)
        meas["param_floats"] = sum(b["floats"] for b in
                                   meas["compute"][str(threads[0])]["steps"]
                                   if b["phase"] == "bucket")
    finally:
        _core.set_num_threads(own)
    return meas


def slowest_device(busy: Sequence[float], idle: Sequence[float]) -> Tuple[float, float]:
    """(busy, idle) per step of the slowest of k devices traced at once: the one with the most
    busy time, with its own idle. The devices meet at each step's all-reduce, so each one's
    busy + idle spans the same steps, and a faster device's longer idle is its wait for the
    slowest: the largest busy with the largest idle would count that wait twice."""
    i = max(range(len(busy)), key=lambda j: busy[j])
    return busy[i], idle[i]


def _fit_steps(per_batch: List[Tuple[int, Dict]]) -> List[Dict]:
    """Per-batch parsed steps -> the step's entries with fixed + per-example times, buckets in
    place (after the backward that produced them)."""
    first = per_batch[-1][1]
    out = []
    for e in first["entries"]:
        pts = [(b, x["seconds"]) for b, p in per_batch for x in p["entries"]
               if x["name"] == e["name"]]
        a, c = fit_line([b for b, _ in pts], [s for _, s in pts])
        out.append({"name": e["name"], "phase": e["phase"], "fixed": a, "per_example": c,
                    "points": [list(x) for x in pts], "ops": e["ops"]})
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
    from ..bench.common import machine_info
    m = machine_info()
    load = m.get("loadavg")
    return f"{m.get('cpu_model') or '?'}, load {load[0]:.1f}" if load else m.get("cpu_model", "?")


def seconds_per_step(step: Callable, data: Callable[[], Tuple], n: int) -> float:
    """The wall time per step of ``n`` steps back to back on the next ``data()`` batches, from
    idle devices and, under mpirun, from a barrier (the ranks start together) to the last
    device's end."""
    from .. import distributed
    from ..engine import core as _core
    _core.waitall()
    if distributed.world_size() > 1:
        distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        step(*data())
    _core.waitall()
    return (time.perf_counter() - t0) / n


def measure_step(model: str, k: int, batch: int, steps: int = 5, repeat: int = 3,
                devices=None) -> List[float]:
    """Real runs: after 2 warm-up steps, `repeat` times the seconds per step of `steps`
    back-to-back steps drawn from the data loader (Fashion-MNIST, its prefetch thread at work as
    in training; one synthetic batch reused when it is not installed). Returns every
    repetition's time (the caller takes the median). Under mpirun every rank runs this and the
    ranks start each repetition together."""
    from ..device import try_gpu
    devs = devices or [try_gpu(i) for i in range(k)]
    step = runner(model, devs)
    data = feed(batch)
    for _ in range(2):
        step(*data())
    return [seconds_per_step(step, data, steps) for _ in range(repeat)]


# ---- MPI ranks, through mpirun ----------------------------------------------------------------

def mpirun_command(ranks: int) -> List[str]:
    """mpirun for `ranks` processes of this Python on this machine (more ranks than cores need
    --oversubscribe; Open MPI refuses root without --allow-run-as-root)."""
    import shutil
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("advise: --ranks needs mpirun (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", "-np", str(ranks), sys.executable]


def calibration_batch(model: str, quick: bool = False, ranks: int = 1) -> int:
    """The global batch of the ranks' contention calibration: each of `ranks` ranks on
    calibration_shard examples, as k devices in one process are calibrated (measure)."""
    return calibration_shard(model, quick) * ranks


def measure_mpi(model: str, ranks: int, batches: Sequence[int], steps: int, repeat: int,
                quick: bool = False, timeout: float = 600) -> Dict:
    """One mpirun of `ranks` processes (1 device each): each rank's threads and cores, the MPI
    all-reduce fit of that many ranks, the contention calibration (measure_rank_calibration at
    each of calibration_shards' shards) and the measured step time of each batch size (every
    repetition). All come from the same launch, so they see the same load."""
    import subprocess
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    for var in ("MGPU_NUM_THREADS", "MGPU_TRACE"):  # each rank chooses as a user's would
        env.pop(var, None)
    job = {"model": model, "batches": list(batches), "steps": steps, "repeat": repeat,
           "quick": quick, "out": out,
           "calibration_batches": [s * ranks for s in calibration_shards(model, quick)]}
    try:
        r = subprocess.run(mpirun_command(ranks) + ["-m", "mgpu.advisor", "--mpi-worker",
                                                    json.dumps(job)],
                           capture_output=True, text=True, env=env, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"advise: mpirun -np {ranks} failed ({r.returncode}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


# The groups of back-to-back steps measure_rank_calibration times a step's wall time in.
CALIBRATION_GROUPS = 3


def measure_rank_calibration(model: str, batch: int, steps: int) -> Dict:
    """Under mpirun, every rank at once: the device's busy time per step (its layers' kernels, from
    the step's timeline, the mean step's) and the step's wall time (untraced), on a shard of the
    global `batch`, with every rank running the same step as in training. The wall time is
    timed as a real run's is: CALIBRATION_GROUPS groups of steps // CALIBRATION_GROUPS steps
    back to back (the ranks meet only at the steps' all-reduces, as in training), each group's
    total over its steps, and the median group's (one group slowed by a burst of other work
    does not move it). Where the ranks' threads exceed the cores, both show what time slicing
    costs: a kernel's threads wait for a sibling the scheduler took off its core (the busy time
    grows beyond the fair share), and a collective waits for the last rank to be scheduled,
    while a waiting rank polls and holds a core (the wall time grows beyond busy time + the
    all-reduce)."""
    from .. import distributed
    from ..engine import core as _core
    ranks = distributed.world_size()
    shard = math.ceil(batch / ranks)
    dev = distributed.device()
    step = runner(model, [dev])
    # The global batch: under mpirun each rank's step trains on its slice of it (split_batch),
    # `shard` examples, as in training (a batch of `shard` would leave each rank shard / ranks);
    # every rank's loader draws the same global batches.
    data = feed(batch)
    for _ in range(2):
        step(*data())
    _core.waitall()
    distributed.barrier()
    parsed = parse_step_trace(trace_steps(step, data, steps), steps, str(dev))
    per = max(1, steps // CALIBRATION_GROUPS)
    walls = [seconds_per_step(step, data, per) for _ in range(CALIBRATION_GROUPS)]
    return {"batch": batch, "shard": shard, "rows": batch,
            "threads": _core.num_threads(),
            "compute": sum(e["seconds"] for e in parsed["entries"]),
            "step": statistics.median(walls), "steps": walls}


def mpi_worker(job: Dict) -> None:
    """One rank of measure_mpi."""
    from .. import distributed
    from ..engine import core as _core
    distributed.init()
    sizes = [4096, 262144, 2097152] if job["quick"] else [4096, 65536, 524288, 4194304]
    fit = measure_mpi_allreduce(sizes, 3 if job["quick"] else 7)
    res = dict(fit, threads=_core.num_threads(), cores=len(os.sched_getaffinity(0)),
               ranks=distributed.world_size(), steps={})
    cal_batches = job.get("calibration_batches") or \
        ([job["calibration_batch"]] if job.get("calibration_batch") else [])
    if cal_batches:
        # Each calibration shard in turn; the largest keeps the single keys of older tables.
        by = [measure_rank_calibration(job["model"], b, 3 if job["quick"] else 6)
              for b in sorted(cal_batches)]
        res["calibration"] = dict(by[-1], by_shard=by)
    for b in job["batches"]:
        res["steps"][str(b)] = measure_step(job["model"], 1, b, job["steps"], job["repeat"],
                                            devices=[distributed.device()])
    if distributed.rank() == 0:
        with open(job["out"], "w") as f:
            json.dump(res, f)
