"""``python -m mgpu advise``: the command (measure or load a table, predict, validate against
measured steps, print the table and plot the speed-up)."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .measure import measure, measure_mpi, measure_step
from .model import EXAMPLE_MACHINES, MACHINE_KEYS, crossover, predict, predict_table

# ---- the command ---------------------------------------------------------------------------------

def load_machine(path: str) -> Dict:
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
    from .. import distributed
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=sys.stderr, flush=True)
    machine = load_machine(args.machine) if args.machine else None
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
