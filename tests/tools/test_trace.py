"""The timeline: mgpu.profile writes a Chrome trace with a track per device and per
communication stream, each layer's forward and backward wrapping its ops, all-reduce buckets,
waits; one device's spans never overlap; tracing changes no result; ranks' files merge."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mgpu
from mgpu import _core

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _problem(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return (mgpu.array(rng.random((n, 1, 28, 28), dtype=np.float32)),
            mgpu.array(rng.integers(0, 10, n).astype(np.int64)))


def _lenet_step(devices, steps, X, y, seed=0):
    params = mgpu.lenet_params(seed=seed)
    dp = [mgpu.get_params(params, d) for d in devices]
    losses = []
    for _ in range(steps):
        losses.append([v.item() for v in mgpu.train_batch(X, y, dp, devices, 0.1)])
    return [p.numpy() for p in dp[0]] + [p.numpy() for p in dp[-1]], losses


def _load(path):
    with open(path) as f:
        doc = json.load(f)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            spans.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return doc, names, spans


def _check_chrome_format(doc):
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int)
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["dur"] >= 0 and e["ts"] > 0
    metas = {e["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"process_name", "thread_name"} <= metas


def _trace_step(tmp_path, devices, n=48):
    X, y = _problem(n)
    _lenet_step(devices, 1, X, y)  # warm up outside the trace
    path = str(tmp_path / "step.json")
    with mgpu.profile(path) as p:
        _lenet_step(devices, 1, X, y)
    assert p.written == [path]
    return _load(path)


def _inside(inner, outer):
    end = outer["ts"] + outer["dur"] + 1e-3
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= end


def _check_step_tracks(spans, devs, shared=False):
    """shared: CPU devices' shared update (one collective after backward, on the comm track);
    else the bucketed all-reduce and each device's own update."""
    for d in devs:
        dev, comm = spans[d], spans[d + " comm"]
        layers = [e for e in dev if e["cat"] == "layer"]
        names = {e["name"] for e in layers}
        for want in ("layer 0 (conv2d_relu_pool) forward", "layer 0 (conv2d_relu_pool) backward",
                     "layer 5 (linear) forward", "layer 5 (linear) backward",
                     "loss forward and backward") + (() if shared else ("sgd update",)):
            assert want in names, (d, sorted(names))
        # Every labelled task lies inside the layer span of its label (nesting).
        for t in (e for e in dev if e["cat"] == "task" and "args" in e):
            assert any(g["name"] == t["args"]["label"] and _inside(t, g) for g in layers), t
        # Forward before backward, as the step runs.
        first = {g["name"]: g["ts"] for g in reversed(layers)}
        assert first["layer 0 (conv2d_relu_pool) forward"] < first["layer 5 (linear) backward"] \
            < first["layer 0 (conv2d_relu_pool) backward"]
        buckets = [e for e in comm if e["cat"] == "layer"]
        if shared:
            assert [b["name"] for b in buckets] == ["sgd update"]
            assert any(e["name"] == "allreduce and sgd" and _inside(e, buckets[0]) for e in comm)
        else:
            assert [b["name"].split(" (")[0] for b in buckets] == ["allreduce bucket 0",
                                                                    "allreduce bucket 1"]
        assert any(e["name"] == "wait for peers" and _inside(e, buckets[0]) for e in comm)


def _check_no_overlap(spans, devs):
    for d in devs:
        # One worker thread runs a device's compute and its collectives: its tasks are disjoint,
        # and so are its layer spans.
        for cat in ("task", "layer"):
            evs = sorted((e for e in spans[d] + spans[d + " comm"] if e["cat"] == cat),
                         key=lambda e: e["ts"])
            for a, b in zip(evs, evs[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (d, cat, a, b)


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared_update", "bucketed"])
def test_two_device_step_trace_is_chrome_format_with_nested_spans(tmp_path, shared, monkeypatch):
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", shared)
    doc, names, spans = _trace_step(tmp_path, [mgpu.cpu(0), mgpu.cpu(1)])
    _check_chrome_format(doc)
    assert {"host", "cpu(0)", "cpu(0) comm", "cpu(1)", "cpu(1) comm"} <= set(spans)
    _check_step_tracks(spans, ["cpu(0)", "cpu(1)"], shared == "1")
    host = spans["host"]
    step = [e for e in host if e["name"] == "train_batch"]
    assert len(step) == 1
    inner = [e for e in host if e["name"] == "train_step"]
    assert len(inner) == 1 and _inside(inner[0], step[0])
    assert any(e["name"] == "allreduce bucket 0 (25250 floats)" or
               e["name"].startswith("allreduce bucket") for e in host)


def test_spans_of_one_device_do_not_overlap(tmp_path):
    _, _, spans = _trace_step(tmp_path, [mgpu.cpu(0), mgpu.cpu(1)], n=64)
    _check_no_overlap(spans, ["cpu(0)", "cpu(1)"])


def test_deterministic_step_runs_both_cpu_devices_at_once(tmp_path):
    """deterministic=True on cpu(0), cpu(1): each device's shards start as the step starts (all
    shards' rows are copied before any shard's work is queued), not once the other device has
    done its own (a copy between devices waits for the source device's earlier work)."""
    devices = [mgpu.cpu(0), mgpu.cpu(1)]
    X, y = _problem(256)
    dp = [mgpu.get_params(mgpu.lenet_params(seed=0), d) for d in devices]
    mgpu.train_batch(X, y, dp, devices, 0.1, deterministic=True)  # warm up outside the trace
    path = str(tmp_path / "deterministic.json")
    with mgpu.profile(path):
        [v.item() for v in mgpu.train_batch(X, y, dp, devices, 0.1, deterministic=True)]
    _, _, spans = _load(path)

    def layer(d, name):
        return sorted((e for e in spans[d] if e["cat"] == "layer" and e["name"] == name),
                      key=lambda e: e["ts"])

    first_forward = layer("cpu(1)", "layer 0 (conv2d_relu_pool) forward")
    last_backward = layer("cpu(0)", "layer 0 (conv2d_relu_pool) backward")
    assert len(first_forward) == len(last_backward) == 4  # 8 shards, 4 per device
    assert first_forward[0]["ts"] < last_backward[-1]["ts"] + last_backward[-1]["dur"], (
        "cpu(1) started its shards only after cpu(0) had finished its own")


@pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 (emulated) GPUs")
def test_gpu_two_device_step_trace(tmp_path):
    doc, _, spans = _trace_step(tmp_path, [mgpu.gpu(0), mgpu.gpu(1)], n=16)
    _check_chrome_format(doc)
    assert {"gpu(0)", "gpu(1)"} <= set(spans)
    _check_no_overlap({k: v for k, v in spans.items()},
                      [d for d in ("gpu(0)", "gpu(1)") if d + " comm" in spans])


def test_tracing_changes_no_result(tmp_path):
    X, y = _problem(40, seed=3)
    devs = [mgpu.cpu(0), mgpu.cpu(1)]
    plain, plain_losses = _lenet_step(devs, 3, X, y)
    with mgpu.profile(str(tmp_path / "t.json")):
        traced, traced_losses = _lenet_step(devs, 3, X, y)
    assert plain_losses == traced_losses
    for a, b in zip(plain, traced):
        np.testing.assert_array_equal(a, b)  # bitwise


def test_python_op_by_op_calls_and_their_backward_are_host_spans(tmp_path):
    from mgpu import chapter
    X, y = _problem(16)
    params = mgpu.lenet_params(seed=0)
    for p in params:
        p.requires_grad_()
    path = str(tmp_path / "ops.json")
    with mgpu.profile(path):
        chapter.train_batch(X, y, [params], [mgpu.cpu(0)], 0.1)
    _, _, spans = _load(path)
    names = [e["name"] for e in spans["host"]]
    for want in ("conv2d", "relu", "avg_pool2d", "conv2d backward", "relu backward"):
        assert want in names, sorted(set(names))


def test_profile_errors_and_off_state(tmp_path):
    with pytest.raises(TypeError, match="path must be a str"):
        mgpu.profile(3)
    with pytest.raises(ValueError, match="does not exist"):
        mgpu.profile(str(tmp_path / "no" / "such" / "t.json"))
    with mgpu.profile(str(tmp_path / "a.json")):
        with pytest.raises(ValueError, match="already being recorded"):
            with mgpu.profile(str(tmp_path / "b.json")):
                pass
    assert not _core.trace_running()
    assert not os.path.exists(tmp_path / "b.json")
    # Off: a step records nothing (the next session starts empty and sees only its own work).
    X, y = _problem(8)
    _lenet_step([mgpu.cpu(0)], 1, X, y)
    with mgpu.profile(str(tmp_path / "empty.json")):
        pass
    doc, _, spans = _load(str(tmp_path / "empty.json"))
    assert not any(e["ph"] == "X" for e in doc["traceEvents"]), spans


def test_merge_joins_ranks_and_rejects_repeats(tmp_path):
    doc, _, _ = _trace_step(tmp_path, [mgpu.cpu(0)], n=8)
    other = json.loads(json.dumps(doc))
    for e in other["traceEvents"]:
        e["pid"] = 1
    a, b = tmp_path / "t.rank0.json", tmp_path / "t.rank1.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(other))
    out = str(tmp_path / "merged.json")
    r = subprocess.run([sys.executable, "-m", "mgpu", "trace-merge", out, str(a), str(b)],
                       capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    merged, names, _ = _load(out)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert len(merged["traceEvents"]) == 2 * len(doc["traceEvents"])
    with pytest.raises(ValueError, match="repeats process ids"):
        mgpu.trace.merge([str(a), str(a)], out)


def test_timeline_plot_draws_one_row_per_track(tmp_path):
    pytest.importorskip("matplotlib")
    _trace_step(tmp_path, [mgpu.cpu(0), mgpu.cpu(1)])
    png = str(tmp_path / "t.png")
    fig = mgpu.plot.timeline(str(tmp_path / "step.json"), png)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0] == "host" and {"cpu(0)", "cpu(0) comm", "cpu(1)", "cpu(1) comm"} <= set(labels)
    assert os.path.getsize(png) > 10000
    with pytest.raises(ValueError, match="no spans"):
        mgpu.plot.timeline({"traceEvents": []})


def test_mgpu_trace_env_and_cli_flag_write_a_trace(tmp_path):
    path = str(tmp_path / "env.json")
    code = ("import mgpu, numpy as np\n"
            "x = mgpu.array(np.ones((4, 4), np.float32))\n"
            "mgpu.relu(x).numpy()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, MGPU_TRACE=path))
    assert r.returncode == 0, r.stderr
    _, _, spans = _load(path)
    assert any(e["name"] == "relu" for e in spans["host"])
    assert any(e["name"] == "relu_forward" for e in spans["cpu(0)"])


HAVE_MPI = shutil.which("mpirun") is not None and mgpu.build_info()["mpi"] == "built"

_RANK_SCRIPT = """
import sys, numpy as np, mgpu
from mgpu import distributed as dist
dist.init()
rng = np.random.default_rng(0)
X = mgpu.array(rng.random((16, 1, 28, 28), dtype=np.float32))
y = mgpu.array(rng.integers(0, 10, 16).astype(np.int64))
params = mgpu.lenet_params(seed=0)
dev = [dist.device()]
dp = [mgpu.get_params(params, dev[0])]
mgpu.train_batch(X, y, dp, dev, 0.1)
with mgpu.profile(sys.argv[1]):
    mgpu.train_batch(X, y, dp, dev, 0.1)
"""


@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and an mgpu built with MPI")
def test_two_mpi_ranks_write_one_file_each_that_merge(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MGPU_EMULATED_GPUS="0")
    env.pop("MGPU_NUM_THREADS", None)
    r = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", sys.executable, str(script),
                        str(tmp_path / "t.json")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = [str(tmp_path / f"t.rank{i}.json") for i in range(2)]
    out = mgpu.trace.merge(files, str(tmp_path / "merged.json"))
    doc, names, _ = _load(out)
    _check_chrome_format(doc)
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs) == [0, 1] and all(v.startswith(f"rank {k}") for k, v in procs.items())
    for rank in (0, 1):
        tracks = {n for (pid, _), n in names.items() if pid == rank}
        assert {"host", "cpu(0)", "cpu(0) comm"} <= tracks, tracks
        comm = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == rank and
                names[(rank, e["tid"])] == "cpu(0) comm"]
        assert any(e["name"] == "distributed.allreduce" for e in comm)
