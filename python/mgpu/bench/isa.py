"""``bench isa``: LeNet under each CPU kernel path this CPU runs (``MGPU_ISA=avx2``, and ``avx512``
where it has AVX-512), against the targets of "Fast on every x86 CPU".

The kernel path is chosen once when mgpu is imported, so every measurement runs in a process of
its own, with no GPU visible: ``bench ops`` (each LeNet op, forward and backward, and the fused
step at the ops' batch) and ``bench train --parts fused`` (the fused step on cpu(0) at the
training batch), once per path in every round, the paths interleaved round by round so a change
of load hits each alike.
``--builds`` adds other interpreters' mgpu builds (a native one, ``MGPU_NATIVE_ARCH=ON``, against
the portable default) to every round. Optionally the chapter's PyTorch step runs in every round
too, with PyTorch's own choice of kernels and with ``ATEN_CPU_CAPABILITY=avx2``.

The target for avx2 / avx512 follows from the FMA peaks measured here: within 1.25x where the CPU
does as many FMAs per cycle at 256 as at 512 bits (AMD Zen 4), within 2x where 512 bits double
them (Intel with two 512-bit FMA units); the portable build within 5 % of the native one; with
``--compare torch``, mgpu's avx2 step ahead of PyTorch's step with its AVX2 kernels.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from ..data import find_data_dir
from ..engine import core as _core
from .common import Log, header, machine_lines, ms, say, summarize, table
from .layers import cpu_paths
from .rivals import find_torch_python, interpreter_path, package_root, run_rival

ISAS = ("avx2", "avx512")
# avx2 time / avx512 time allowed, by the ratio of the two paths' FMA peaks: a peak ratio below
# this bound means 512-bit FMAs are no faster per cycle than two 256-bit ones.
SAME_WIDTH_PEAK = 1.5
TARGET_SAME_THROUGHPUT = 1.25
TARGET_DOUBLE_THROUGHPUT = 2.0
PORTABLE_TARGET = 1.05  # the portable build's time / the native build's


def isa_target(peak_ratio: float) -> float:
    """The allowed avx2 / avx512 time ratio for a CPU whose avx512 / avx2 FMA peak is
    ``peak_ratio``: 1.25 where the peaks are about equal, 2 where 512 bits double them."""
    return TARGET_SAME_THROUGHPUT if peak_ratio < SAME_WIDTH_PEAK else TARGET_DOUBLE_THROUGHPUT


def _child(python: str, own: bool, argv: List[str], env: Dict[str, str], what: str) -> Dict:
    """Runs ``python -m mgpu`` + argv with ``env`` in an empty directory; returns its JSON. own:
    python is this interpreter, given this package's directory; another build's interpreter
    gets no PYTHONPATH, so it imports its own mgpu."""
    with tempfile.TemporaryDirectory() as cwd:
        path = os.path.join(cwd, "result.json")
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if own:
            env["PYTHONPATH"] = package_root() + os.pathsep + os.environ.get("PYTHONPATH", "")
        r = subprocess.run([python, "-m", "mgpu"] + argv + ["--quiet", "--json", path],
                           capture_output=True, text=True, cwd=cwd, env=env)
        if r.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"bench isa: {what} failed ({r.returncode}):\n"
                               f"{r.stderr.strip()[-2000:]}")
        with open(path) as f:
            return json.load(f)


def _probe_build(python: str) -> Dict:
    """build_info() of the mgpu that ``python`` imports (without PYTHONPATH)."""
    code = "import json; from mgpu import _core; print(json.dumps(dict(_core.build_info())))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        with tempfile.TemporaryDirectory() as cwd:
            r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd,
                               env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"bench isa: --builds {python}: cannot run it ({e})") from None
    if r.returncode != 0:
        raise ValueError(f"bench isa: --builds {python} cannot import mgpu (install a build "
                         f"there, e.g. `pip install . -C cmake.define.MGPU_NATIVE_ARCH=ON`):\n"
                         f"{r.stderr.strip()[-1000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _label(info: Dict, taken: Sequence[str]) -> str:
    """A build's name in the tables: its engine baseline's first word (x86-64-v3 for the
    portable build, native), numbered if another build has it already."""
    base = str(info.get("cpu_baseline", "build")).split(" ")[0] or "build"
    label, i = base, 2
    while label in taken:
        label, i = f"{base}#{i}", i + 1
    return label


def bench_isa(rounds: int = 3, ops_batch: int = 128, batch_size: int = 256,
              limit_batches: int = 60, warmup: int = 3, repeat: int = 10,
              isas: Optional[Sequence[str]] = None, data_dir: Optional[str] = None,
              synthetic: int = 0, compare: Optional[str] = None,
              torch_python: Optional[str] = None, torch_threads: int = 2,
              builds: Sequence[str] = (), log: Log = None) -> Dict:
    """Times LeNet's ops (``bench ops`` at ``ops_batch``, ``repeat`` samples each) and the
    fused step on one device (``bench train --parts fused`` at ``batch_size``, ``warmup``
    batches, then one epoch cut at ``limit_batches``) under each path in ``isas`` (default:
    every path this CPU runs), each in its own process, ``rounds`` rounds interleaved. ``builds``:
    other interpreters whose mgpu build (e.g. a native one, ``MGPU_NATIVE_ARCH=ON``) is timed
    the same way in every round, and compared with this one. A figure is the median over the
    rounds of each round's median. ``compare='torch'`` adds the chapter's PyTorch step in every
    round, with its default kernels and with ``ATEN_CPU_CAPABILITY=avx2``. Returns a dict (JSON)
    with the per-round figures, the FMA peaks, and the ratios (``summarize_isa``)."""
    have = cpu_paths()
    isas = list(have if isas is None else isas)
    for isa in isas:
        if isa not in ISAS:
            raise ValueError(f"bench isa: {isa!r} is not a kernel path; choose from "
                             f"{', '.join(ISAS)}")
        if isa not in have:
            raise ValueError(f"bench isa: this CPU ({_core.build_info()['cpu_model']}) cannot "
                             f"run the {isa} path (it runs {', '.join(have)}); leave --isas "
                             "out to time every path it runs")
    if not isas or len(set(isas)) != len(isas):
        raise ValueError(f"bench isa: --isas must name each path once, got {isas}")
    for name, v in (("rounds", rounds), ("ops_batch", ops_batch), ("batch_size", batch_size),
                    ("limit_batches", limit_batches), ("repeat", repeat)):
        if int(v) < 1:
            raise ValueError(f"bench isa: {name} must be >= 1, got {v}")
    if int(warmup) < 0:
        raise ValueError(f"bench isa: warmup must be >= 0, got {warmup}")
    if compare not in (None, "torch"):
        raise ValueError(f"bench isa: --compare takes 'torch' only, got {compare!r}")
    torch_py = None
    if compare:
        torch_py, info = find_torch_python(torch_python)
        if torch_py is None:
            raise ValueError(f"bench isa: no interpreter with torch found ({info}); give one "
                             "with --torch-python (`bash .ci/peers.sh torch` makes "
                             "build/peers/torch)")
    entries = [{"label": _label(dict(_core.build_info()), []), "python": sys.executable,
                "own": True, "build_info": dict(_core.build_info())}]
    for py in map(interpreter_path, builds):
        info = _probe_build(py)
        entries.append({"label": _label(info, [e["label"] for e in entries]), "python": py,
                        "own": False, "build_info": info})
    if synthetic:
        data_args = ["--synthetic", str(int(synthetic))]
        data = {"source": "synthetic", "train_examples": int(synthetic)}
    else:
        data_dir = find_data_dir(data_dir)
        data_args = ["--data-dir", data_dir]
        data = {"source": "fashion-mnist", "dir": data_dir}
    out = header("isa", dict(rounds=rounds, ops_batch=ops_batch, batch_size=batch_size,
                             limit_batches=limit_batches, warmup=warmup, repeat=repeat,
                             isas=isas, data=data, compare=compare, torch_threads=torch_threads,
                             builds=[e["label"] for e in entries]))
    out["builds"] = [{k: e[k] for k in ("label", "python", "build_info")} for e in entries]
    out["cpu_isas"] = have
    out["peaks"] = {isa: _core.fma_peak(isa, 1)["gflops"] for isa in isas}
    ops_argv = ["bench", "ops", "--batch-sizes", str(ops_batch), "--warmup", "2",
                "--repeat", str(repeat)]
    train_argv = ["bench", "train", "--model", "lenet", "--parts", "fused", "--devices", "1",
                  "--batch-size", str(batch_size), "--epochs", "1", "--limit-batches",
                  str(limit_batches), "--warmup", str(warmup)] + data_args
    # The children see no GPU (real or emulated), so the fused step runs on cpu(0) as the ops do.
    env0 = {k: v for k, v in os.environ.items() if k != "MGPU_ISA"}
    env0.update(MGPU_EMULATED_GPUS="0", CUDA_VISIBLE_DEVICES="")
    raw: Dict[str, Dict[str, List[Dict]]] = {e["label"]: {isa: [] for isa in isas}
                                             for e in entries}
    torch_raw: Dict[str, List[float]] = {"default": [], "avx2": []}
    torch_info: Dict[str, str] = {}
    for r in range(int(rounds)):
        for e in entries:
            for isa in isas:
                what = f"MGPU_ISA={isa}" + ("" if e["own"] else f" with {e['python']}")
                say(log, f"bench isa: round {r + 1} of {rounds}, {e['label']}, {what} ...")
                env = dict(env0, MGPU_ISA=isa)
                ops = _child(e["python"], e["own"], ops_argv, env, f"bench ops, {what}")
                train = _child(e["python"], e["own"], train_argv, env, f"bench train, {what}")
                ran = ops["machine"]["build_info"]["cpu_isa"]
                if ran != isa:  # the child must have run the path it was given
                    raise RuntimeError(f"bench isa: {what} ran the {ran} path")
                step = train["results"][0]
                raw[e["label"]][isa].append({
                    "ops": {x["op"]: {"forward": x["forward"]["median"],
                                      "backward": x["backward"]["median"],
                                      "gflops_forward": x["gflops_forward"],
                                      "gflops_backward": x["gflops_backward"]}
                            for x in ops["ops"]},
                    "ops_step": ops["steps"][0]["fused_step"]["median"],
                    "train_step": step["sec_per_step"]["median"],
                    "full_batches": step["full_batches"]})
        if torch_py:
            for kind in ("default", "avx2"):
                say(log, f"bench isa: round {r + 1}, the chapter's PyTorch step ({kind} "
                          "kernels) ...")
                env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
                if kind == "avx2":
                    env["ATEN_CPU_CAPABILITY"] = "avx2"
                got = run_rival("torch", torch_py, data.get("dir"), data["train_examples"]
                                if synthetic else 0, [1], batch_size, 0.2, 1,
                                int(limit_batches), int(warmup), int(torch_threads), 0,
                                variants="chapter", env=env)
                res = got["results"][0]
                torch_raw[kind].append(statistics.median(
                    t / res["steps_per_epoch"] for t in res["epoch_times"]))
                torch_info[kind] = got.get("cpu_capability", "?")
                torch_info["version"] = got.get("torch_version", "?")
    out["raw"] = raw
    out.update(summarize_isa(raw, out["peaks"]))
    if torch_py:
        first = entries[0]["label"]
        out["torch"] = {"python": torch_py, "version": torch_info.get("version"),
                        "threads": int(torch_threads),
                        "capability": {k: torch_info.get(k) for k in ("default", "avx2")},
                        "step": {k: summarize(v) for k, v in torch_raw.items()}}
        out["torch_ratios"] = {
            f"torch {k} / mgpu {isa}": out["torch"]["step"][k]["median"]
            / out["paths"][first][isa]["train_step"]["median"]
            for k in ("default", "avx2") for isa in isas}
        if "avx2" in isas:
            out["torch_target"] = torch_target(out["torch_ratios"]["torch avx2 / mgpu avx2"])
    return out


def torch_target(ratio: float) -> Dict:
    """The target against PyTorch: mgpu's avx2 step ahead of the chapter's PyTorch step
    with PyTorch's AVX2 kernels (``ratio`` = PyTorch ms / mgpu ms, so above 1)."""
    return {"what": "torch avx2 / mgpu avx2", "ratio": float(ratio), "ahead": ratio > 1.0}


def _path_summary(rs: List[Dict]) -> Dict:
    """One build's one path: each figure over its rounds (summarize: the rounds' medians are
    its times)."""
    ops = {}
    for name in rs[0]["ops"]:
        ops[name] = {p: summarize([x["ops"][name][p] for x in rs]) for p in ("forward", "backward")}
        for p in ("forward", "backward"):
            g = rs[0]["ops"][name]["gflops_" + p]
            # GFLOP/s at the median time: the FLOPs are the same in every round.
            ops[name]["gflops_" + p] = (g * rs[0]["ops"][name][p] / ops[name][p]["median"]
                                        if g else None)
    step = summarize([x["train_step"] for x in rs])
    return {"ops": ops, "ops_step": summarize([x["ops_step"] for x in rs]), "train_step": step,
            "sec_per_epoch": step["median"] * rs[0]["full_batches"]}


def _ratios(a: Dict, b: Dict, target: Optional[float] = None) -> List[Dict]:
    """a's median time / b's for every op, forward and backward, and both fused steps; with a
    target, whether each ratio is within it."""
    out = [{"what": f"{name.split(' (')[0]} {p}",
            "ratio": a["ops"][name][p]["median"] / b["ops"][name][p]["median"]}
           for name in a["ops"] for p in ("forward", "backward")]
    out.append({"what": "fused step (ops' batch)",
                "ratio": a["ops_step"]["median"] / b["ops_step"]["median"]})
    out.append({"what": "fused step (training batch)",
                "ratio": a["train_step"]["median"] / b["train_step"]["median"]})
    if target is not None:
        for x in out:
            x["within_target"] = x["ratio"] <= target
    return out


def summarize_isa(raw: Dict[str, Dict[str, List[Dict]]], peaks: Dict[str, float]) -> Dict:
    """From each build's (label's) paths' rounds (``raw[label][isa]``: dicts of ops, ops_step,
    train_step, full_batches): each figure's median over the rounds (``paths[label][isa]``);
    where both paths ran, each build's avx2 / avx512 ratios of medians (``ratios[label]``) with
    the target (``isa_target`` of the measured peaks) and whether each holds; and each other
    build's time / the first build's on every path (``build_ratios[label][isa]``) with, where
    those are the portable and the native build, portable / native against its 5 % target."""
    paths = {label: {isa: _path_summary(rs) for isa, rs in per.items()}
             for label, per in raw.items()}
    out: Dict = {"paths": paths}
    if peaks.get("avx2") and peaks.get("avx512") and all(
            "avx2" in p and "avx512" in p for p in paths.values()):
        peak_ratio = peaks["avx512"] / peaks["avx2"]
        target = isa_target(peak_ratio)
        ratios = {label: _ratios(p["avx2"], p["avx512"], target) for label, p in paths.items()}
        out.update(peak_ratio=peak_ratio, target=target, ratios=ratios)
    labels = list(paths)
    if len(labels) > 1:
        first = labels[0]
        out["build_ratios"] = {label: {isa: _ratios(paths[label][isa], paths[first][isa])
                                       for isa in paths[first]}
                               for label in labels[1:]}
        native = [x for x in labels if x.startswith("native")]
        portable = [x for x in labels if x.startswith("x86-64-v3")]
        if native and portable:
            n, q = native[0], portable[0]
            rows = {isa: _ratios(paths[q][isa], paths[n][isa], PORTABLE_TARGET)
                    for isa in paths[n]}
            out["portable_native"] = {"portable": q, "native": n, "target": PORTABLE_TARGET,
                                      "ratios": rows}
    return out


def op_entry(ops: Dict, name: str) -> Dict:
    """The entry of op ``name`` in a bench ops result (its keys carry the shapes)."""
    return next(v for k, v in ops.items() if k.split(" (")[0] == name)


def _ratio_line(rs: List[Dict], target: Optional[float]) -> str:
    """conv2 forward / backward and the training-batch step's ratios, the worst of all, and
    which miss ``target``."""
    by = {x["what"]: x["ratio"] for x in rs}
    worst = max(rs, key=lambda x: x["ratio"])
    line = (f"conv2 forward {by['conv2 forward']:.2f}x, backward {by['conv2 backward']:.2f}x, "
            f"fused step {by['fused step (training batch)']:.2f}x; worst of {len(rs)}: "
            f"{worst['what']} {worst['ratio']:.2f}x")
    if target is None:
        return line
    misses = [x for x in rs if not x["within_target"]]
    return line + "; " + ("every one within the target" if not misses else
                          f"{len(misses)} over it: " + ", ".join(
                              f"{x['what']} {x['ratio']:.2f}x" for x in misses))


def format_isa(r: Dict) -> str:
    s = r["settings"]
    builds = s.get("builds") or list(r["paths"])
    lines = [f"mgpu bench isa: LeNet on each CPU kernel path ({', '.join(s['isas'])}) of "
             f"{len(builds)} build(s) ({', '.join(builds)}), each in its own process, "
             f"{s['rounds']} round(s) interleaved; median over the rounds of each round's median"]
    lines += machine_lines(r)
    for b in r.get("builds", []):
        lines.append(f"build {b['label']}: {b['python']}, engine {b['build_info']['cpu_baseline']}")
    lines.append("FMA peak, 1 thread (mgpu._core.fma_peak): " + ", ".join(
        f"{isa} {g:.1f} GFLOP/s" for isa, g in r["peaks"].items()))
    rows = []
    for label, per in r["paths"].items():
        for isa, p in per.items():
            c2 = op_entry(p["ops"], "conv2")
            rows.append([label, isa, f"{ms(c2['forward']['median'])} ms, "
                                     f"{c2['gflops_forward']:.0f} GFLOP/s",
                         f"{ms(c2['backward']['median'])} ms",
                         f"{ms(p['ops_step']['median'])} ms",
                         f"{ms(p['train_step']['median'])} ms", f"{p['sec_per_epoch']:.1f}"])
    lines.append("")
    lines += table(["build", "path", f"conv2 fwd (batch {s['ops_batch']})", "conv2 bwd",
                     f"fused step, batch {s['ops_batch']}",
                     f"fused step, batch {s['batch_size']}, 1 device", "sec/epoch"], rows,
                    "llrrrrr")
    lines.append("")
    if "ratios" in r:
        lines.append(f"avx2 / avx512 (target: within {r['target']:.2f}x, as the avx512 / avx2 "
                     f"FMA peak is {r['peak_ratio']:.2f}):")
        for label, rs in r["ratios"].items():
            lines.append(f"  {label}: " + _ratio_line(rs, r["target"]))
    else:
        lines.append("avx2 / avx512: not measured (one path only: " +
                     ("this CPU has no AVX-512" if "avx512" not in r.get("cpu_isas", ISAS)
                      else "--isas named one") + ")")
    for label, per in r.get("build_ratios", {}).items():
        for isa, rs in per.items():
            lines.append(f"{label} / {builds[0]}, {isa}: " + _ratio_line(rs, None))
    if "portable_native" in r:
        pn = r["portable_native"]
        lines.append(f"portable ({pn['portable']}) / native ({pn['native']}) (target: within "
                     f"{pn['target']:.2f}x):")
        for isa, rs in pn["ratios"].items():
            lines.append(f"  {isa}: " + _ratio_line(rs, pn["target"]))
    if "torch" in r:
        t = r["torch"]
        lines.append(f"PyTorch {t['version']} ({t['python']}), {t['threads']} threads, the "
                     "chapter's step on 1 device: default kernels ("
                     f"{t['capability']['default']}) {ms(t['step']['default']['median'])} ms, "
                     f"ATEN_CPU_CAPABILITY=avx2 ({t['capability']['avx2']}) "
                     f"{ms(t['step']['avx2']['median'])} ms")
        lines.append(f"ratio = PyTorch ms / mgpu ({builds[0]}) ms (above 1: mgpu is faster): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in r["torch_ratios"].items()))
        if "torch_target" in r:
            tt = r["torch_target"]
            lines.append(f"target: mgpu's avx2 step ahead of PyTorch's with its AVX2 kernels: "
                         f"{tt['ratio']:.2f}x, " + ("met" if tt["ahead"] else "not met"))
    return "\n".join(lines)
