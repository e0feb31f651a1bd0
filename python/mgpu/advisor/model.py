"""The advisor's model: a measurement table in, predictions out (step time, epoch time,
speed-up and the part that bounds each case, for 1..N devices and several batches). No measuring
here; a described machine (EXAMPLE_MACHINES) is scaled from the same table."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

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

def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
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
