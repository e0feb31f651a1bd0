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


def interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """The time at batch x from measured (batch, seconds) points: straight lines between
    neighbouring points, beyond the ends the end segment's line (its slope at least 0: a time
    does not fall as the batch grows); one point alone scales in proportion. At least 0.

    A layer's time is not one line from a few examples to many: below a few blocks of work per
    thread a kernel cannot keep its threads busy (ResNet-18's 512-channel layers are one 4x4
    tile per image, and their Winograd forward takes 64 tiles to a task: up to 64 images give
    2 threads one task), and fixed costs such as Winograd's weight transforms weigh less as
    the batch grows. Points measured near the batches predicted carry that; the line between
    them is only used in between."""
    pts = sorted((float(b), float(s)) for b, s in points)
    if not pts:
        raise ValueError("interpolate: no points")
    if len(pts) == 1:
        b, s = pts[0]
        return max(0.0, s * x / b) if b > 0 else max(0.0, s)
    if x <= pts[0][0]:
        (b0, s0), (b1, s1) = pts[0], pts[1]
    elif x >= pts[-1][0]:
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if pts[i][0] >= x)
        (b0, s0), (b1, s1) = pts[i - 1], pts[i]
    slope = (s1 - s0) / (b1 - b0) if b1 != b0 else 0.0
    if x >= pts[-1][0] or x <= pts[0][0]:
        slope = max(0.0, slope)
    # Outside the points the line passes through the nearer end point.
    b_ref, s_ref = (b1, s1) if x >= pts[-1][0] else (b0, s0)
    return max(0.0, s_ref + slope * (x - b_ref))


def entry_time(e: Dict, shard: float) -> float:
    """One step entry's time at `shard` examples: through its measured points where the table
    has them (interpolate), else its line fixed + per_example x shard."""
    if e.get("points"):
        return interpolate(e["points"], shard)
    return e["fixed"] + e["per_example"] * shard


def _layers_time(steps: Sequence[Dict], shard: float) -> float:
    """A step table's compute at `shard` examples: every entry but the gradient buckets."""
    return sum(entry_time(e, shard) for e in steps if e["phase"] != "bucket")


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


def _rank_layout(meas: Dict, ranks: int) -> Tuple[int, int]:
    """(threads, cores) of one process: the threads its mgpu runs kernels with and the cores its
    affinity lets it use. One process owns the machine; under mpirun each rank's measured layout
    (Open MPI 4 binds each of 2 ranks to a core of its own and leaves 3 ranks on 2 cores
    unbound, each rank with 2 threads)."""
    cores = int(meas["cores"])
    if ranks <= 1:
        return int(meas.get("threads", cores)), cores
    info = (meas.get("mpi") or {}).get(str(ranks))
    if not info:
        raise ValueError(f"predict: {ranks} ranks need an MPI measurement with {ranks} ranks "
                         "(advise --validate --ranks runs them through mpirun, or run the "
                         "advisor under mpirun)")
    return int(info["threads"]), int(info["cores"])


def core_share(meas: Dict, k: int, ranks: int = 1) -> Tuple[int, float, float, float]:
    """How one of k busy devices (per rank, `ranks` processes) computes: with how many threads
    (k devices in a rank get threads/k each), how much slower its layers run than measured (the
    measurement ran those threads alone; here all ranks' device threads share the cores this
    process really gets, `effective_cores`, and a rank's own cores, in proportion), and the
    effective cores of one rank and of the machine: (threads, slowdown, rank's cores, cores)."""
    threads, rank_cores = _rank_layout(meas, ranks)
    cores = int(meas["cores"])
    eff = float(meas.get("effective_cores") or cores)
    rank_eff = rank_cores * eff / cores
    t = max(1, threads // k)
    slow = max(1.0, k * t / rank_eff, ranks * k * t / eff) / max(1.0, t / eff)
    return t, slow, rank_eff, eff


def _rank_calibrations(cal: Dict) -> List[Dict]:
    """The ranks' calibration points, by shard: the table's "by_shard" list where it has one
    (measure_rank_calibration at each calibration_shards shard), else its one calibration."""
    return sorted(cal.get("by_shard") or [cal], key=lambda c: c["shard"])


def oversubscription(meas: Dict, ranks: int, shard: Optional[float] = None) -> Optional[Dict]:
    """Where `ranks` processes' threads exceed the machine's cores (Open MPI leaves 3 ranks on 2
    cores unbound, each with its threads): what the calibration under mpirun measured
    (measure_rank_calibration, every rank at once on a shard of its batch). The layers' busy
    time against this table's at the rank's thread count is the `contention` the ranks' layers
    run at (it replaces core_share's fair share, which assumes each thread gets its share
    without waiting: a kernel's threads meet at its end, and a sibling descheduled for a time
    slice holds them all); the step's wall time beyond busy time and the fitted all-reduce of
    its buckets is the `wait` per step (a collective waits for the last rank to be scheduled,
    and the ranks that wait poll, holding a core). Both depend on the shard (a short step
    loses less to a rank's time slice than a long one): where the ranks were calibrated at
    several shards, each lies at `shard` on the line between the two calibrated shards around
    it (held at the nearest end beyond them); one calibration gives its one contention and
    wait at every shard. None where the threads fit the cores or nothing was calibrated
    (core_share's model then)."""
    if ranks <= 1:
        return None
    mpi = (meas.get("mpi") or {}).get(str(ranks)) or {}
    cal = mpi.get("calibration")
    threads, _ = _rank_layout(meas, ranks)
    if not cal or ranks * threads <= int(meas["cores"]):
        return None
    steps = _compute_table(meas, threads)
    comm = sum(allreduce_time(4 * e["floats"], ranks, mpi["latency"], mpi["bus_bandwidth"])
               for e in steps if e["phase"] == "bucket")
    pts = _rank_calibrations(cal)
    at = pts[0]["shard"] if shard is None or len(pts) == 1 else shard
    # Calibrated by shard, the ranks' busy time is what they ran at, also where it lies below
    # this table's (measured in this process at another time: on a shared machine the load
    # drifts between the two), and their wall time holds the cores' share (`by_shard`:
    # predict adds no bound of the cores). A table calibrated at one shard keeps the fair
    # share's floor of 1 and the cores' bound, as it predicted before.
    by_shard = "by_shard" in cal
    floor = 0.0 if by_shard else 1.0
    contention = held_interpolate(
        [(c["shard"], max(floor, c["compute"] / _layers_time(steps, c["shard"]))) for c in pts],
        at)
    wait = held_interpolate([(c["shard"], max(0.0, c["step"] - c["compute"] - comm))
                             for c in pts], at)
    return {"contention": contention, "wait": wait,
            "shard": at if len(pts) > 1 else cal["shard"], "threads": threads,
            "by_shard": by_shard}


def held_interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """The value at x from measured (x, value) points: straight lines between neighbouring
    points, beyond the ends the nearer end's value (a ratio measured at a few shards: its line
    beyond them is no measurement, and would run below 1 or without bound)."""
    pts = sorted((float(a), float(v)) for a, v in points)
    if not pts:
        raise ValueError("held_interpolate: no points")
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    i = next(i for i in range(1, len(pts)) if pts[i][0] >= x)
    (a0, v0), (a1, v1) = pts[i - 1], pts[i]
    return v0 + (v1 - v0) * (x - a0) / (a1 - a0)


def concurrency(meas: Dict, k: int, ranks: int = 1,
                shard: Optional[float] = None) -> Optional[float]:
    """How much slower a device's layers run when k devices per rank and `ranks` ranks compute
    at once than they ran alone with the same threads, as measured where the threads fit the
    cores: in this process, traced steps of k devices at once against one device alone with
    the same threads on the same shard (measure: "contention"); under mpirun, the ranks'
    calibration (measure_rank_calibration). Cores that other jobs hold, the memory bandwidth
    and caches the devices share and the host's and input's threads are all in it, where a
    fair share of `effective_cores` (core_share) only counts cores. The ratio depends on the
    shard (at a few examples per device a layer's kernels are short, and the devices' hand-offs
    and the host's thread weigh more): where k devices were traced at several shards
    ("by_shard"), the ratio at `shard` lies on the line between the two measured shards around
    it (held at the nearest end beyond them); a table with one calibration shard gives its one
    ratio at every shard. None where nothing was measured for this configuration or the ranks'
    threads exceed the cores (oversubscription's case)."""
    if ranks <= 1:
        if k <= 1:
            return None
        cal = (meas.get("contention") or {}).get(str(k))
        if not cal:
            return None
        pts = [(p["shard"], p["busy"] / p["alone"]) for p in cal.get("by_shard") or []
               if p.get("alone")]
        if pts and shard is not None:
            return held_interpolate(pts, shard)
        if cal.get("alone"):  # traced alone just before, under the same load
            return cal["busy"] / cal["alone"]
        steps = _compute_table(meas, cal["threads"])
    else:
        if k != 1:
            return None
        mpi = (meas.get("mpi") or {}).get(str(ranks)) or {}
        cal = mpi.get("calibration")
        threads, _ = _rank_layout(meas, ranks)
        if not cal or ranks * threads > int(meas["cores"]):
            return None
        steps = _compute_table(meas, threads)
        pts = [(c["shard"], c["compute"] / _layers_time(steps, c["shard"]))
               for c in _rank_calibrations(cal) if _layers_time(steps, c["shard"]) > 0]
        if len(pts) > 1 and shard is not None:  # calibrated at several shards
            return held_interpolate(pts, shard)
        cal = dict(cal, busy=cal["compute"])
    alone = _layers_time(steps, cal["shard"])
    # Below 1 where other jobs load the machine: the scheduler shares the cores among threads,
    # so k device threads get more of them than one.
    return cal["busy"] / alone if alone > 0 else None


def concurrent_idle(meas: Dict, k: int, shard: float) -> float:
    """The idle time per step a device has beyond one device alone when k devices in this process
    run at once (the slowest device's idle less the alone device's, traced beside each other
    by measure: "contention" "by_shard"), at `shard` examples as concurrency interpolates its
    ratio; 0 where the table has no such points (older tables)."""
    cal = (meas.get("contention") or {}).get(str(k)) or {}
    pts = [(p["shard"], p["idle"] - p["idle_alone"]) for p in cal.get("by_shard") or []
           if "idle" in p and "idle_alone" in p]
    return held_interpolate(pts, shard) if pts else 0.0


def _compute_entry(meas: Dict, t: int) -> Dict:
    """What was measured with t threads (the nearest measured count if t was not)."""
    have = sorted(int(x) for x in meas["compute"])
    return meas["compute"][str(min(have, key=lambda x: (abs(x - t), x)))]


def _compute_table(meas: Dict, t: int) -> List[Dict]:
    """The step's entries measured with t threads (the nearest measured count if t was not)."""
    return _compute_entry(meas, t)["steps"]


def device_idle(meas: Dict, t: int, shard: int) -> float:
    """A device's idle time per step between its tasks (hand-offs; parse_step_trace) at t
    threads and `shard` examples: fixed + per example, 0 where the table has none."""
    idle = _compute_entry(meas, t).get("idle") or {}
    if idle.get("points"):
        return interpolate(idle["points"], shard)
    return max(0.0, idle.get("fixed", 0.0) + idle.get("per_example", 0.0) * shard)


def predict(meas: Dict, k: int, batch: int, ranks: int = 1, machine: Optional[Dict] = None,
            epoch_examples: int = 60000) -> Dict:
    """Step time of k devices per rank (`ranks` processes) with global batch `batch`.

    The step: the host enqueues it (overhead: fixed + per device), the devices run it, the input
    pipeline's thread prepares the next batch, all at once: step = max(host, device, input). A
    device runs its steps in order (split/copy, each layer forward, loss, each layer backward,
    update) with the threads it gets (core_share: the layer times measured at that thread count,
    slowed down where more threads than cores want to run, or by the slowdown measured with that
    many devices at once at the shard where measure traced it: concurrency, and with the extra
    idle such devices had: concurrent_idle); a gradient bucket's all-reduce runs
    when the last device has produced it: on CPU devices on the same worker threads (in series
    with compute), then across ranks (the MPI fit of that many ranks), on a described GPU machine
    on a communication stream (overlapping the remaining backward; the update waits for it). On
    CPU devices the host and input threads share the cores with the kernels, so the cores also
    bound a step: the core-seconds of host, input and kernels over the cores a rank may use, and
    over the machine's cores for all ranks together. Where MPI ranks' threads exceed the cores
    and the ranks' contention was calibrated under mpirun (oversubscription), the layers run at
    the measured contention instead of the fair share, and each step adds the measured wait of
    its collectives for descheduled ranks, both taken at the step's shard between the shards
    calibrated (calibrated by shard, the ranks' measured wall time holds the cores' share: no
    bound of the cores applies). Returns the parts, the step, the epoch time and the bounding
    part.
    """
    if k < 1 or batch < 1 or ranks < 1:
        raise ValueError(f"predict: devices, batch and ranks must be >= 1, got {k}, {batch}, "
                         f"{ranks}")
    shard = math.ceil(batch / (k * ranks))
    cpu = machine is None and meas.get("device_kind", "cpu") == "cpu"
    over = None
    slow = 1.0
    if machine is None:
        if cpu:
            t, slow, rank_cores, eff = core_share(meas, k, ranks)
            over = oversubscription(meas, ranks, shard) if k == 1 else None
            measured = None if over else concurrency(meas, k, ranks, shard)
            if over:
                slow = over["contention"]
            elif measured is not None:
                # The measured slowdown replaces the fair share; each of the ranks' k x t
                # threads held a core, at 1 / slowdown of it.
                slow = measured
                rank_cores = min(float(_rank_layout(meas, ranks)[1]), k * t / slow)
                eff = min(float(meas["cores"]), ranks * k * t / slow)
        else:
            t, slow, rank_cores, eff = int(meas["cores"]), 1.0, 1.0, 1.0
        steps = _compute_table(meas, t)

        def dur(e):
            return entry_time(e, shard) * slow
        ar = meas.get("allreduce") or {}
        mpi = (meas.get("mpi") or {}).get(str(ranks)) if ranks > 1 else None
        if ranks > 1 and not mpi:
            _rank_layout(meas, ranks)  # raises the clear error

        def comm(nbytes):
            # (seconds, of which on this rank's device threads): the in-process all-reduce
            # runs on the devices' threads; the MPI one between ranks.
            local = allreduce_time(nbytes, k, ar.get("latency", 0.0),
                                   ar.get("bus_bandwidth", 1e30)) * slow
            across = allreduce_time(nbytes, ranks, mpi["latency"], mpi["bus_bandwidth"]) \
                if mpi else 0.0
            return local + across, local
        overlap = False
    else:
        top = str(max(int(x) for x in meas["compute"]))
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
                                  machine["link_bandwidth"]), 0.0
        overlap = machine.get("overlap", True)
    now = comm_free = compute = comm_total = comm_local = 0.0
    for e in steps:
        if e["phase"] == "bucket":
            c, local = comm(4 * e["floats"])
            comm_total += c
            comm_local += local
            if overlap:
                comm_free = max(now, comm_free) + c
            else:
                now += c
            continue
        if e["phase"] == "update" and overlap:
            now = max(now, comm_free)
        d = dur(e)
        compute += d
        now += d
    idle = 0.0
    if over:
        now += over["wait"]  # the collective's wait for descheduled ranks, once per step
    elif machine is None:
        # The device's hand-offs between tasks: idle time on its chain, no core-seconds (where
        # ranks were calibrated, their measured wait holds them).
        idle = device_idle(meas, t, shard)
        if cpu and ranks == 1 and k > 1:
            # k devices at once hand off more slowly than one alone (their threads and the
            # host's wake each other on shared cores): the extra idle traced beside them.
            idle = max(0.0, idle + concurrent_idle(meas, k, shard))
        now += idle
    device = max(now, comm_free)
    host = meas["host"]["fixed"] + meas["host"]["per_device"] * k
    inp = meas.get("input")
    # Under mpirun every rank loads the whole global batch and takes its slice.
    input_t = (inp["fixed"] + inp["per_example"] * batch) if inp and machine is None else 0.0
    cores_t = 0.0
    if cpu and not (over and over.get("by_shard")):
        # Core-seconds of one rank's step: host, input thread, k devices' t threads each (the
        # compute and in-process all-reduce as measured with t threads, which ran on min(t,
        # effective cores) cores), over the effective cores of a rank and of the machine.
        busy = host + input_t + k * min(t, eff) * (compute + comm_local) / slow
        cores_t = max(busy / rank_cores, ranks * busy / eff)
    step = max(host, device, input_t, cores_t)
    parts = {"compute": compute, "communication": max(0.0, device - compute - idle),
             "overhead": host + idle, "input": input_t}
    bound = max(parts, key=parts.get)
    return {"devices": k, "ranks": ranks, "batch": batch, "shard": shard, "step": step,
            "device": device, "cores": cores_t, "parts": parts, "comm_total": comm_total,
            "oversubscription": over, "idle": idle, "slowdown": slow,
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


def train_split():
    """Fashion-MNIST's training split as the data loader reads it (one load of the files), or
    None where the data set is not installed."""
    from . import _core
    from .data import find_data_dir
    try:
        return _core.load_fashion_mnist(find_data_dir())[0]
    except FileNotFoundError:
        return None


def feed(batch: int, seed: int = 0, split=None) -> Callable[[], Tuple]:
    """A function returning the next (X, y) of `batch` examples as training gets them: from the
    Fashion-MNIST loader (shuffled, whole batches only, a new epoch where one ends), whose
    prefetch thread works beside the step as in training (on 2 cores it takes a core from a
    2-thread kernel now and then, and keeps both cores awake for the devices' hand-offs:
    measured on 2 cores at LeNet's batches 32 and 128, a step fed by it ran up to 9 % slower on
    1 device and 7 % faster on 2 devices than one fed a fixed batch, and a model traced on a
    fixed batch under-predicted 2 devices' speed-up at small batches); one synthetic batch,
    reused, where the data set is not installed. `split`: the training split already loaded
    (train_split), so that a caller feeding many configurations reads the files once."""
    from .data import DataLoader
    split = split if split is not None else train_split()
    if split is None:
        X, y = _batch(batch, seed)
        return lambda: (X, y)
    train = DataLoader(split, batch, True, seed)
    it = iter(train)

    def next_batch():
        nonlocal it
        while True:
            for X, y in it:
                if X.shape[0] == batch:
                    return X, y
            it = iter(train)
    return next_batch


def _trace_steps(step: Callable, batches: Callable[[], Tuple], steps: int) -> Dict:
    """Runs `steps` steps back to back (as training does: the host enqueues the next step while
    the device runs this one), each on the next batches() (X, y), inside mgpu.profile, waits for
    them, and returns the parsed trace."""
    from . import _core
    from .trace import profile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof = profile(path)
    try:
        with prof:
            for _ in range(steps):
                step(*batches())
            _core.waitall()
        with open(prof.written[0]) as f:  # under mpirun, this rank's file
            return json.load(f)
    finally:
        for f in {path, *prof.written}:
            if os.path.exists(f):
                os.unlink(f)


# The shortest traced window of a step measurement (seconds; quick mode half): a mean over a few
# milliseconds of steps is one scheduler time slice from another figure (a 2-thread kernel whose
# sibling thread is descheduled waits out the slice), so short steps are traced for more steps
# than `steps`, up to MAX_TRACED_STEPS.
MIN_TRACED_SECONDS = 0.2
MAX_TRACED_STEPS = 100


def warm_up(step: Callable, batches: Callable[[], Tuple], warm: int, steps: int,
            min_seconds: float) -> int:
    """Runs `warm` (at least 1) warm-up steps on batches(), the last one timed alone, and returns
    how many steps to trace: `steps`, or as many more as fill `min_seconds` at the last warm-up
    step's time, at most MAX_TRACED_STEPS (never fewer than `steps`)."""
    from . import _core
    for _ in range(max(1, warm) - 1):
        step(*batches())
    _core.waitall()
    t0 = time.perf_counter()
    step(*batches())
    _core.waitall()
    return traced_steps(time.perf_counter() - t0, steps, min_seconds)


def traced_steps(step_seconds: float, steps: int, min_seconds: float) -> int:
    """At least `steps`; as many as fill `min_seconds` at `step_seconds` each, at most
    MAX_TRACED_STEPS."""
    fill = math.ceil(min_seconds / max(step_seconds, 1e-9))
    return max(steps, min(MAX_TRACED_STEPS, fill))


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


def parse_step_trace(doc: Dict, steps: int, device: str = "cpu(0)",
                     statistic: str = "mean") -> Dict:
    """One device's step from a trace of `steps` steps: the layer spans in order with their
    time per step (s; `statistic` "mean": their total over `steps`, "median": the median
    step's) and op count, the buckets (after which span, how many floats), and the host's time
    per step (median of the Python step call)."""
    if statistic not in ("mean", "median"):
        raise ValueError(f"parse_step_trace: statistic must be 'mean' or 'median', got "
                         f"{statistic!r}")
    tr = _tracks(doc)
    dev = tr.get(device, [])
    groups = [e for e in dev if e.get("cat") == "layer"]
    tasks = [e for e in dev if e.get("cat") == "task"]
    order: List[str] = []
    times: Dict[str, List[float]] = {}
    counts: Dict[str, List[int]] = {}
    j = 0
    other, other_n = 0.0, 0  # tasks in no layer span (input copies, the label guard's copies)
    for g in groups:
        # A layer's time is its tasks' (busy) time: the gaps between them are the device
        # waiting for the host or for the operating system, not the layer's work.
        busy, n = 0.0, 0
        while j < len(tasks) and tasks[j]["ts"] < g["ts"] + g["dur"]:
            if tasks[j]["ts"] >= g["ts"]:
                busy += tasks[j]["dur"] * 1e-6
                n += 1
            else:
                other += tasks[j]["dur"] * 1e-6
                other_n += 1
            j += 1
        name = g["name"]
        if name not in times:
            order.append(name)
        times.setdefault(name, []).append(busy)
        counts.setdefault(name, []).append(n)
    other += sum(e["dur"] for e in tasks[j:]) * 1e-6
    other_n += len(tasks) - j
    entries = []
    if other_n:
        entries.append({"name": "other device work", "phase": "split", "seconds": other / steps,
                        "ops": round(other_n / steps)})
    for name in order:
        ts = times[name]
        # The mean step: a real run's step time is its total over its steps, so a step that a
        # descheduled kernel thread held up (on a shared machine the time slices of other jobs
        # stall a 2-thread kernel for a slice) counts in full, as it does there; the median
        # step leaves such stalls out. A name met more often than once per step (a layer run
        # twice) counts its mean total either way.
        per_step = sum(ts) / steps if statistic == "mean" or len(ts) > steps else \
            statistics.median(ts)
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
    # The host's own work per step: the step call less the time it sat blocked (a device queue
    # full, a wait for a device): on a GPU machine those waits would be other work's time. Of
    # the calls that never blocked (the first steps of a window, before the queue fills) where
    # there are any: a call that blocks wakes many times per step (a full queue wakes its host
    # as each task ends), and each wake-up's own cost on cores the device threads keep busy
    # (measured here: the median call of 60 steps 0.18-0.25 ms against 0.06-0.12 ms of 6
    # steps, LeNet batch 32) is this machine's contention, not the step's host work.
    waits = [e for e in host if e["name"] == "queue full" or e["name"].startswith("wait")]
    calls = [(e["dur"] * 1e-6, [w["dur"] * 1e-6 for w in waits if e["ts"] <= w["ts"] and
                                w["ts"] + w["dur"] <= e["ts"] + e["dur"]])
             for e in host if e["name"] in _HOST_STEP]
    host_steps = [d for d, ws in calls if not ws] or [d - sum(ws) for d, ws in calls]
    if not entries or not host_steps:
        raise ValueError("advise: the step's trace has no layer spans on " + device)
    # The device's idle time inside the traced window per step: from its first task to its last,
    # the time it ran no task (the steps run back to back, so the host is ahead and the queue
    # holds the next task: each gap is a hand-off from one task to the next, which the layers'
    # busy times leave out; with one device of 2 threads both cores wait through it).
    idle = 0.0
    if tasks:
        end = max(t["ts"] + t["dur"] for t in tasks)
        idle = max(0.0, (end - tasks[0]["ts"] - sum(t["dur"] for t in tasks)) * 1e-6 / steps)
    return {"entries": entries, "buckets": buckets, "host": statistics.median(host_steps),
            "idle": idle}


def measure_effective_cores(cores: int, n: int = 384, reps: int = 6, rounds: int = 7) -> float:
    """How many cores this process really gets: `cores` CPU devices each multiply matrices with
    one thread at the same time, against one device alone (interleaved, the median of `rounds`).
    On a quiet machine each runs as fast as alone (the full count); where other jobs hold the
    cores (or a scheduler caps this process's share) they slow each other down, and k busy
    device threads run k / effective-cores slower than alone. At most `cores`."""
    from . import _core
    from .device import cpu
    from .ops import mm
    from .tensor import array
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
    from . import _core, distributed
    from .device import try_gpu
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
                step = _runner(model, dev)
                data = feed(b, split=split)
                # Beyond the small batches a step is long enough that one warm-up and two
                # traced steps (their median is their mean) keep the quick mode quick.
                big = quick and b > batches[-1]
                n = warm_up(step, data, 1 if big else 2, 2 if big else steps, min_traced)
                per_batch[t].append((b, parse_step_trace(_trace_steps(step, data, n), n,
                                                         str(dev[0]))))
                if t == max(threads) and b == batches[0]:
                    host_by_k[1] = per_batch[t][-1][1]["host"]
        for t in threads:
            pts = [(b, p["idle"]) for b, p in per_batch[t]]
            a, c = _fit_line([b for b, _ in pts], [i for _, i in pts])
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
                    step = _runner(model, devs)
                    data = feed(c * n, split=split)
                    traced = warm_up(step, data, 2, steps, min_traced)
                    doc = _trace_steps(step, data, traced)
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
        a, c = _fit_line([b for b, _ in pts], [s for _, s in pts])
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
    from .bench.common import machine_info
    m = machine_info()
    load = m.get("loadavg")
    return f"{m.get('cpu_model') or '?'}, load {load[0]:.1f}" if load else m.get("cpu_model", "?")


def measure_step(model: str, k: int, batch: int, steps: int = 5, repeat: int = 3,
                devices=None) -> List[float]:
    """Real runs: after 2 warm-up steps, `repeat` times the seconds per step of `steps`
    back-to-back steps drawn from the data loader (Fashion-MNIST, its prefetch thread at work as
    in training; one synthetic batch reused when it is not installed). Returns every
    repetition's time (the caller takes the median). Under mpirun every rank runs this and the
    ranks start each repetition together."""
    from . import _core, distributed
    from .device import try_gpu
    devs = devices or [try_gpu(i) for i in range(k)]
    step = _runner(model, devs)
    data = feed(batch)
    for _ in range(2):
        step(*data())
    ts = []
    for _ in range(repeat):
        _core.waitall()
        if distributed.world_size() > 1:
            distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(*data())
        _core.waitall()
        ts.append((time.perf_counter() - t0) / steps)
    return ts


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
    from . import _core, distributed
    ranks = distributed.world_size()
    shard = math.ceil(batch / ranks)
    dev = distributed.device()
    step = _runner(model, [dev])
    # The global batch: under mpirun each rank's step trains on its slice of it (split_batch),
    # `shard` examples, as in training (a batch of `shard` would leave each rank shard / ranks);
    # every rank's loader draws the same global batches.
    data = feed(batch)
    for _ in range(2):
        step(*data())
    _core.waitall()
    distributed.barrier()
    parsed = parse_step_trace(_trace_steps(step, data, steps), steps, str(dev))
    per = max(1, steps // CALIBRATION_GROUPS)
    walls = []
    for _ in range(CALIBRATION_GROUPS):
        _core.waitall()
        distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(per):
            step(*data())
        _core.waitall()
        walls.append((time.perf_counter() - t0) / per)
    return {"batch": batch, "shard": shard, "rows": batch,
            "threads": _core.num_threads(),
            "compute": sum(e["seconds"] for e in parsed["entries"]),
            "step": statistics.median(walls), "steps": walls}


def _mpi_worker(job: Dict) -> None:
    """One rank of measure_mpi."""
    from . import _core, distributed
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
    """The predictions as text: one line per batch size and configuration (devices per process
    x processes), the parts of the step and what bounds it; validated rows add the measured
    step (the median, and the spread of the rounds) and the error."""
    lines = [title, "figures are " + ("predicted from measurements on this machine" if measured
                                      else "NOT MEASURED: predicted for a described machine"),
             f"{'batch':>6} {'config':>9} {'step ms':>9} {'epoch s':>8} {'speedup':>7} "
             f"{'compute':>8} {'comm':>7} {'host':>7} {'input':>7}  bound"]
    for r in rows:
        p = r["parts"]
        config = f"{r['devices']} dev" if r.get("ranks", 1) == 1 else f"{r['ranks']} ranks"
        extra = ""
        if "measured_step" in r:
            ms = r["measured_steps"]
            extra = (f"  measured {r['measured_step'] * 1e3:.2f} ms "
                     f"[{min(ms) * 1e3:.2f}-{max(ms) * 1e3:.2f}], speed-up "
                     f"{r['measured_speedup']:.2f}, error {r['error'] * 100:+.0f} %")
        lines.append(f"{r['batch']:>6} {config:>9} {r['step'] * 1e3:>9.2f} "
                     f"{r['epoch']:>8.2f} {r['speedup']:>7.2f} {p['compute'] * 1e3:>8.2f} "
                     f"{p['communication'] * 1e3:>7.2f} {p['overhead'] * 1e3:>7.2f} "
                     f"{p['input'] * 1e3:>7.2f}  {r['bound']}{extra}")
    return "\n".join(lines)


def plot_speedup(rows: List[Dict], path: Optional[str] = None, ax=None, title: str = ""):
    """Speed-up against global batch size, one line per configuration (devices in a process,
    or MPI ranks), the measured points, where the rows carry them, as markers."""
    from matplotlib.figure import Figure
    fig = None
    if ax is None:
        fig = Figure(figsize=(6, 3.5), layout="constrained")
        ax = fig.subplots()
    configs = sorted({(r["devices"], r.get("ranks", 1)) for r in rows} - {(1, 1)},
                     key=lambda c: (c[1], c[0]))
    for i, (k, n) in enumerate(configs):
        rs = sorted((r for r in rows if (r["devices"], r.get("ranks", 1)) == (k, n)),
                    key=lambda r: r["batch"])
        what = f"{k} devices" if n == 1 else f"{n} MPI ranks"
        ax.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], marker=".",
                color=f"C{i}", label=f"{what}, predicted")
        ms = [r for r in rs if "measured_speedup" in r]
        if ms:
            ax.plot([r["batch"] for r in ms], [r["measured_speedup"] for r in ms], "x",
                    color=f"C{i}", markersize=8, label=f"{what}, measured")
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


def median_table(tables: Sequence[Dict]):
    """The measurement table whose every number is the median of the tables' (same layout: the
    rounds of validate); strings and layout come from the first."""
    first = tables[0]
    if all(t == first for t in tables):
        return first
    if isinstance(first, dict):
        return {key: median_table([t.get(key) for t in tables]) if all(
            isinstance(t, dict) and key in t for t in tables) else first[key] for key in first}
    if isinstance(first, list) and all(isinstance(t, list) and len(t) == len(first)
                                       for t in tables):
        return [median_table([t[i] for t in tables]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool) and all(
            isinstance(t, (int, float)) for t in tables):
        return statistics.median(tables)
    return first


def median_prediction(preds: Sequence[Dict]) -> Dict:
    """The rounds' predictions of one configuration as one: every number the median of the
    rounds' (statistics.median, as validate takes the measured step: of an even count the mean
    of the middle two; the lower middle round alone would set the smaller of 2 rounds'
    predictions against the mean of their measurements), the bound the largest median part."""
    row = dict(median_table(list(preds)))
    row["bound"] = max(row["parts"], key=row["parts"].get)
    return row


def validate(model: str, batches: Sequence[int], max_devices: int = 2,
             ranks: Sequence[int] = (), repeats: int = 3, steps: int = 8, repeat: int = 3,
             quick: bool = False, log=lambda s: None) -> Tuple[List[Dict], List[Dict]]:
    """Predicted against measured step time: 1..max_devices devices in this process and, through
    mpirun, each count in `ranks` of processes with one device each, for every batch size.

    On a shared machine both drift with the load, so they are measured interleaved: each of
    `repeats` rounds measures the model's inputs (the measurement table, and with each mpirun
    the MPI all-reduce fit) and then the real runs (each the median of `repeat` timings of
    `steps` steps). A row's predicted and measured step are the medians over the rounds (the
    same statistic on both sides: of an even count, the mean of the middle two), each round's
    figures kept beside them; the row's parts are the medians of the rounds' parts (with 1 or 2
    rounds they add up as each round's do) and its bound the largest of them. Returns (rows, the
    rounds' measurement tables; their median_table is the one to predict other cases from)."""
    configs = [(k, 1) for k in range(1, max_devices + 1)] + [(1, r) for r in ranks if r > 1]
    rounds = []
    for i in range(repeats):
        log(f"advise: validation round {i + 1} of {repeats}: measuring the model's inputs ...")
        meas = measure(model, max(2, max_devices), quick, log, batches, ranks)
        meas["mpi"] = dict(meas.get("mpi") or {})
        measured: Dict[Tuple[int, int, int], float] = {}
        for k in range(1, max_devices + 1):
            for b in batches:
                log(f"advise: round {i + 1}: real run, {k} device(s), batch {b} ...")
                measured[(k, 1, b)] = statistics.median(measure_step(model, k, b, steps, repeat))
        for r in ranks:
            if r <= 1:
                continue
            log(f"advise: round {i + 1}: mpirun -np {r}: MPI all-reduce and real runs ...")
            res = measure_mpi(model, r, batches, steps, repeat, quick)
            meas["mpi"][str(r)] = {key: res[key] for key in
                                   ("latency", "bus_bandwidth", "points", "threads", "cores",
                                    "calibration") if key in res}
            for b in batches:
                measured[(1, r, b)] = statistics.median(res["steps"][str(b)])
        rounds.append((meas, measured))
    rows = []
    for b in batches:
        for k, r in configs:
            preds = [predict(m, k, b, r) for m, _ in rounds]
            row = dict(median_prediction(preds), predicted_steps=[p["step"] for p in preds],
                       measured_steps=[ms[(k, r, b)] for _, ms in rounds])
            row["measured_step"] = statistics.median(row["measured_steps"])
            row["error"] = row["step"] / row["measured_step"] - 1
            rows.append(row)
    for row in rows:
        base = next(x for x in rows if x["batch"] == row["batch"] and x["devices"] == 1 and
                    x["ranks"] == 1)
        row["speedup"] = base["step"] / row["step"]
        row["measured_speedup"] = base["measured_step"] / row["measured_step"]
        row["epoch"] = row["step"] * math.ceil(60000 / row["batch"])
    return rows, [m for m, _ in rounds]


def main(args) -> int:
    from . import distributed
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=sys.stderr, flush=True)
    machine = _load_machine(args.machine) if args.machine else None
    if any(b < 1 for b in args.batch_size):
        raise ValueError(f"advise: batch sizes must be >= 1, got {args.batch_size}")
    n = args.devices or (machine["devices"] if machine else 2)
    if n < 1:
        raise ValueError(f"advise: --devices must be >= 1, got {n}")
    ranks = sorted(set(args.ranks or []))
    if any(r < 2 for r in ranks):
        raise ValueError(f"advise: --ranks counts processes and must be >= 2, got {args.ranks}")
    if args.rounds < 1 or (args.limit_batches is not None and args.limit_batches < 1):
        raise ValueError("advise: --rounds and --limit-batches must be >= 1")
    if ranks and (machine or not args.validate):
        raise ValueError("advise: --ranks goes with --validate (it times real mpirun runs)")
    batches = sorted(set(args.batch_size))
    validating = args.validate and machine is None
    rounds: List[Dict] = []
    if args.from_json:
        with open(args.from_json) as f:
            meas = json.load(f)["measurements"]
    elif not validating:
        meas = measure(args.model, max(2, n) if machine is None else 2, args.quick, log,
                       batches if machine is None else ())
    world = distributed.world_size()
    summary = ""
    if validating:
        steps = args.limit_batches or (3 if args.quick else 8)
        rows, rounds = validate(args.model, batches, n, ranks, args.rounds, steps, 2,
                                args.quick, log)
        meas = median_table(rounds)
        errs = [abs(r["error"]) for r in rows]
        summary = (f"prediction error: median {statistics.median(errs) * 100:.1f} %, worst "
                   f"{max(errs) * 100:.1f} % over {len(rows)} configurations; medians of "
                   f"{args.rounds} interleaved round(s), load average now "
                   f"{os.getloadavg()[0]:.1f}")
    elif machine is None:
        rows = predict_table(meas, n, batches)
    else:
        rows = predict_table(meas, n, batches, machine=machine, epoch_examples=args.epoch_examples)
    out: Dict = {"measurements": meas}
    if rounds:
        out["rounds"] = rounds
    if machine is None:
        title = f"{args.model}: this machine ({meas['measured_on']}, {meas['cores']} cores)"
        if world > 1 and (meas.get("mpi") or {}).get(str(world)):
            extra = [predict(meas, 1, b, ranks=world) for b in batches]
            summary += f"\n{world} MPI ranks, 1 device each: " + ", ".join(
                f"batch {r['batch']}: {r['step'] * 1e3:.2f} ms/step ({r['bound']})" for r in extra)
            out["mpi_predictions"] = extra
    else:
        title = f"{args.model}: {machine['name']}"
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


if __name__ == "__main__":
    # One rank of measure_mpi: python -m mgpu.advisor --mpi-worker JOB_JSON (under mpirun).
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-worker":
        _mpi_worker(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: mpirun ... python -m mgpu.advisor --mpi-worker JOB_JSON "
                 "(what `python -m mgpu advise --validate --ranks` starts)")
