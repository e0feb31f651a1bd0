"""The scaling advisor: its model gives the hand-computed prediction of a synthetic
measurement table, its fits recover known latency and bandwidth, and `python -m mgpu advise`
runs end to end in --quick mode."""
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import mgpu
from mgpu import advisor, data

# A synthetic machine with 2 cores: a forward of 1 ms/example and a backward of 2 ms/example with
# both threads (twice that with one), one 1M-float bucket after the backward, a 1 ms update.
TABLE = {
    "model": "synthetic", "cores": 2, "device_kind": "cpu",
    "compute": {
        "2": {"steps": [
            {"name": "f", "phase": "forward", "fixed": 0.0, "per_example": 1e-3, "ops": 1},
            {"name": "b", "phase": "backward", "fixed": 0.0, "per_example": 2e-3, "ops": 2},
            {"name": "bucket 0", "phase": "bucket", "floats": 1_000_000},
            {"name": "sgd update", "phase": "update", "fixed": 1e-3, "per_example": 0.0,
             "ops": 1}]},
        "1": {"steps": [
            {"name": "f", "phase": "forward", "fixed": 0.0, "per_example": 2e-3, "ops": 1},
            {"name": "b", "phase": "backward", "fixed": 0.0, "per_example": 4e-3, "ops": 2},
            {"name": "bucket 0", "phase": "bucket", "floats": 1_000_000},
            {"name": "sgd update", "phase": "update", "fixed": 1e-3, "per_example": 0.0,
             "ops": 1}]},
    },
    "gemm_flops": {"2": 1e11, "1": 5e10},
    "allreduce": {"latency": 1e-4, "bus_bandwidth": 1e9},
    "host": {"fixed": 1e-3, "per_device": 5e-4},
    "input": None, "param_floats": 1_000_000,
}


def test_one_device_prediction_by_hand():
    r = advisor.predict(TABLE, 1, 100)
    # device: 100 * 1 ms + 100 * 2 ms + 1 ms = 0.301 s, no all-reduce with one device;
    # host: 1 ms + 0.5 ms; cores: (host + 0.301 s * 2 threads) / 2 cores = 0.30175 s.
    assert r["device"] == pytest.approx(0.301)
    assert r["parts"]["overhead"] == pytest.approx(0.0015)
    assert r["parts"]["communication"] == pytest.approx(0.0)
    assert r["step"] == pytest.approx(0.30175)
    assert r["bound"] == "compute"
    assert r["epoch"] == pytest.approx(0.30175 * 600)  # 60000 examples / 100


def test_two_device_prediction_by_hand():
    r = advisor.predict(TABLE, 2, 100)
    # shard 50 at 1 thread: 50 * 2 ms + 50 * 4 ms + 1 ms = 0.301 s of compute; the bucket's
    # all-reduce on the same threads: 2 * 1 * 100 us + 2 * 1/2 * 4 MB / 1 GB/s = 4.2 ms.
    # Both device threads are busy through compute and all-reduce (2 x 0.3052 core-seconds) and
    # the host's 2 ms need a core too: the 2 cores bound the step at (0.002 + 0.6104) / 2.
    assert r["shard"] == 50
    assert r["parts"]["compute"] == pytest.approx(0.301)
    assert r["parts"]["communication"] == pytest.approx(0.0042)
    assert r["device"] == pytest.approx(0.3052)
    assert r["step"] == pytest.approx(0.3062)
    rows = advisor.predict_table(TABLE, 2, [100])
    assert rows[1]["speedup"] == pytest.approx(0.30175 / 0.3062)


def test_fewer_effective_cores_slow_concurrent_devices_by_hand():
    """Where other jobs leave this process one core's worth of the 2 (effective_cores 1), two
    1-thread devices run at half their measured speed; one 2-thread device is unchanged (its
    layer times were measured under the same share)."""
    table = dict(TABLE, effective_cores=1.0)
    assert advisor.core_share(table, 2) == (1, 2.0, 1.0, 1.0)
    assert advisor.core_share(table, 1) == (2, 1.0, 1.0, 1.0)
    one, two = advisor.predict(table, 1, 100), advisor.predict(table, 2, 100)
    # 1 device: 0.301 s of layers; its core-seconds 0.0015 + 0.301 x min(2, 1) on 1 core.
    assert one["step"] == pytest.approx(0.3025)
    # 2 devices: (0.301 s + 4.2 ms all-reduce) x 2 = 0.6104 s; core-seconds 0.002 + 2 x 0.3052.
    assert two["parts"]["compute"] == pytest.approx(0.602)
    assert two["device"] == pytest.approx(0.6104)
    assert two["step"] == pytest.approx(0.6124)


# Under mpirun (Open MPI 4 on 2 cores): 2 ranks are bound to a core each (1 thread), 3 ranks are
# left unbound with 2 threads each; each count has its own MPI all-reduce fit.
MPI = {"2": {"latency": 1e-4, "bus_bandwidth": 1e9, "threads": 1, "cores": 1},
       "3": {"latency": 2e-4, "bus_bandwidth": 5e8, "threads": 2, "cores": 2}}


def test_mpi_ranks_prediction_by_hand():
    table = dict(TABLE, mpi=MPI)
    r = advisor.predict(table, 1, 100, ranks=2)
    # 2 ranks, one core each: shard 50 at 1 thread, 0.301 s; the MPI all-reduce of 4 MB over
    # 2 ranks: 2 * 100 us + 4 MB / 1 GB/s = 4.2 ms after it.
    assert r["shard"] == 50
    assert r["parts"]["compute"] == pytest.approx(0.301)
    assert r["parts"]["communication"] == pytest.approx(0.0042)
    assert r["step"] == pytest.approx(0.3052)
    r = advisor.predict(table, 1, 300, ranks=3)
    # 3 ranks of 2 threads on 2 cores: 6 threads want 2 cores, each runs 3x slower than alone:
    # shard 100 at 2 threads, (0.1 + 0.2 + 0.001) s x 3 = 0.903 s; the all-reduce over 3 ranks:
    # 4 * 200 us + 4/3 * 4 MB / 0.5 GB/s = 11.4667 ms.
    assert advisor.core_share(table, 1, 3) == (2, 3.0, 2.0, 2.0)
    assert r["parts"]["compute"] == pytest.approx(0.903)
    assert r["parts"]["communication"] == pytest.approx(0.0008 + 4 / 3 * 4e6 / 5e8)
    assert r["step"] == pytest.approx(0.903 + 0.0008 + 4 / 3 * 4e6 / 5e8)
    assert r["cores"] == pytest.approx(3 * (0.0015 + 2 * 0.301) / 2)  # below the device's
    with pytest.raises(ValueError, match="4 ranks"):
        advisor.predict(table, 1, 100, ranks=4)


def test_communication_bound_and_crossover():
    slow_link = dict(TABLE, allreduce={"latency": 1e-4, "bus_bandwidth": 1e7})
    r = advisor.predict(slow_link, 2, 10)
    # 2 * 100 us + 4 MB / 10 MB/s = 0.4002 s of all-reduce against 31 ms of compute.
    assert r["parts"]["communication"] == pytest.approx(0.4002)
    assert r["bound"] == "communication"
    # Per example, 2 devices at one thread each (6 ms / 2 shards) equal 1 device at two threads
    # (3 ms): the all-reduce is never hidden, 2 devices never win.
    assert advisor.crossover(TABLE) is None
    fast = json.loads(json.dumps(TABLE))
    fast["allreduce"] = {"latency": 1e-4, "bus_bandwidth": 1e8}
    for e in fast["compute"]["1"]["steps"]:
        if "per_example" in e:
            e["per_example"] = e["per_example"] / 2 * 0.8  # one thread does 80 % of two's work
    # k=1: cores bound 0.003 B + 0.00175 s; k=2: cores bound, 0.0012 B + 0.001 s compute +
    # 0.0402 s all-reduce + half the host's 2 ms. 2 devices win once 0.0018 B > 0.04245:
    # B > 23.6, so at 32 (not at 16).
    assert advisor.crossover(fast) == 32
    assert advisor.predict(fast, 2, 32)["step"] < advisor.predict(fast, 1, 32)["step"]
    assert advisor.predict(fast, 2, 16)["step"] > advisor.predict(fast, 1, 16)["step"]


def test_described_machine_overlaps_buckets_with_backward():
    m = {"name": "toy", "devices": 4, "device_flops": 1e12, "memory_bandwidth": 1e12,
         "link_bandwidth": 1e10, "link_latency": 1e-5, "launch_overhead": 1e-6}
    r = advisor.predict(TABLE, 4, 400, machine=m)
    # shard 100; FLOPs per example = s/example * this machine's 1e11 FLOP/s; at 1e12 FLOP/s:
    # f: 1 op * 1 us + 100 * 1e-3 * 1e11 / 1e12 = 0.010001 s; b: 2 us + 0.02 s.
    # all-reduce over 4: 6 * 10 us + 1.5 * 4 MB / 10 GB/s = 0.00066 s (starts after b);
    # update waits for it: 1 us + 12 B * 1M / 1e12 = 1.3 us.
    f, b = 1e-6 + 0.01, 2e-6 + 0.02
    ar = 6 * 1e-5 + 1.5 * 4e6 / 1e10
    assert r["parts"]["compute"] == pytest.approx(f + b + 1e-6 + 12e6 / 1e12)
    assert r["device"] == pytest.approx(f + b + ar + 1e-6 + 12e6 / 1e12)
    assert r["measured"] is False
    text = advisor.format_table(advisor.predict_table(TABLE, 4, [400], machine=m), False, "toy")
    assert "NOT MEASURED" in text


def test_allreduce_fit_recovers_known_latency_and_bandwidth():
    lat, bw = 3e-5, 2e9
    pts = [(k, n, advisor.allreduce_time(n, k, lat, bw)) for k in (2, 3) for n in
           (4096, 65536, 1 << 20, 1 << 23)]
    fit = advisor.fit_allreduce(pts)
    assert fit["latency"] == pytest.approx(lat, rel=1e-6)
    assert fit["bus_bandwidth"] == pytest.approx(bw, rel=1e-6)
    assert advisor.allreduce_time(1e6, 1, lat, bw) == 0.0


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=">= 1"):
        advisor.predict(TABLE, 0, 10)
    with pytest.raises(ValueError, match="mpirun"):
        advisor.predict(TABLE, 1, 10, ranks=2)
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"devices": 8}))
    with pytest.raises(ValueError, match="lacks device_flops"):
        advisor.load_machine(str(bad))
    with pytest.raises(FileNotFoundError, match="8gpu-nvlink"):
        advisor.load_machine(str(tmp_path / "none.json"))


def test_advise_command_runs_end_to_end_quick(tmp_path):
    out, png = str(tmp_path / "a.json"), str(tmp_path / "a.png")
    env = dict(os.environ, MGPU_EMULATED_GPUS="0")
    r = subprocess.run([sys.executable, "-m", "mgpu", "advise", "--model", "lenet",
                        "--batch-size", "32,128", "--quick", "--json", out, "--plot", png],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "predicted from measurements on this machine" in r.stdout
    with open(out) as f:
        doc = json.load(f)
    rows = doc["predictions"]
    assert [(x["batch"], x["devices"]) for x in rows] == [(32, 1), (32, 2), (128, 1), (128, 2)]
    for x in rows:
        assert x["step"] > 0 and x["bound"] in ("compute", "communication", "overhead", "input")
        assert math.isclose(x["speedup"] * x["step"],
                            next(y["step"] for y in rows if y["batch"] == x["batch"] and
                                 y["devices"] == 1), rel_tol=1e-9)
    meas = doc["measurements"]
    phases = [e["phase"] for e in meas["compute"]["1"]["steps"]]
    assert phases.count("bucket") == 2 and phases[-1] == "update"
    assert phases.index("bucket") > phases.index("backward")
    assert meas["allreduce"]["bus_bandwidth"] > 0
    # Each thread count's layers were traced at the small batches (16, 64) and at the shards of
    # the batches asked for: 32 and 128 on 1 device of 2 threads, 16 and 64 on 2 devices of 1.
    assert meas["compute"]["2"]["shards"] == [16, 32, 64, 128]
    assert meas["compute"]["1"]["shards"] == [16, 64]
    for t in ("1", "2"):
        for e in meas["compute"][t]["steps"]:
            if e["phase"] in ("forward", "backward"):
                assert [p[0] for p in e["points"]] == meas["compute"][t]["shards"]
    # 2 devices at once and 1 alone, 1 thread each, at the shards of the batches asked for on 2
    # devices (16 and 64); the single-shard keys of older tables hold the one nearest 3/4 of
    # the largest small batch (48).
    cont = meas["contention"]["2"]
    assert [p["shard"] for p in cont["by_shard"]] == [16, 64]
    for p in cont["by_shard"]:
        assert len(p["devices"]) == 2 and p["busy"] == max(p["devices"]) and p["alone"] > 0
        assert p["idle"] >= 0 and p["idle_alone"] >= 0
    assert cont["shard"] == 64 and cont["threads"] == 1
    assert cont["busy"] == cont["by_shard"][1]["busy"]
    assert cont["alone"] == cont["by_shard"][1]["alone"]
    assert os.path.getsize(png) > 5000
    # The described machine, from the saved measurements: labelled as not measured.
    r = subprocess.run([sys.executable, "-m", "mgpu", "advise", "--from-json", out, "--machine",
                        "8gpu-nvlink", "--batch-size", "64,1024"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "NOT MEASURED" in r.stdout and "8 GPUs on NVLink" in r.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None or
                    mgpu.build_info()["mpi"] != "built",
                    reason="needs mpirun and an mgpu built with MPI")
def test_validate_times_real_runs_in_process_and_under_mpirun(tmp_path):
    """--validate --quick: one round of the model's inputs and real runs, 1 and 2 devices and 2
    MPI ranks through mpirun; every row carries a measured step and its error."""
    out = str(tmp_path / "v.json")
    env = dict(os.environ, MGPU_EMULATED_GPUS="0")
    r = subprocess.run([sys.executable, "-m", "mgpu", "advise", "--model", "lenet",
                        "--batch-size", "64", "--quick", "--validate", "--rounds", "1",
                        "--ranks", "2", "--limit-batches", "2", "--json", out],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "prediction error" in r.stdout and "2 ranks" in r.stdout, r.stdout
    with open(out) as f:
        doc = json.load(f)
    rows = doc["predictions"]
    assert [(x["devices"], x["ranks"]) for x in rows] == [(1, 1), (2, 1), (1, 2)]
    for x in rows:
        assert x["measured_step"] > 0 and len(x["measured_steps"]) == 1
        assert x["error"] == pytest.approx(x["step"] / x["measured_step"] - 1)
    mpi = doc["measurements"]["mpi"]["2"]
    assert mpi["threads"] >= 1 and mpi["cores"] >= 1 and mpi["bus_bandwidth"] > 0
    # The ranks' calibration step is given the global batch (each rank trains on its slice,
    # `shard` rows), not a batch of `shard` rows that the ranks would split again.
    cal = mpi["calibration"]
    assert cal["rows"] == cal["batch"] == 96 and cal["shard"] == 48
    # Calibrated at 3/4 of each small batch (16, 64): 12 and 48 examples per rank, the largest
    # also in the single keys of older tables.
    assert [c["shard"] for c in cal["by_shard"]] == [12, 48]
    assert [c["rows"] for c in cal["by_shard"]] == [24, 96]
    assert cal["by_shard"][-1]["step"] == cal["step"]
    # Each wall time is the median of CALIBRATION_GROUPS groups' steps (quick: 3 steps, 1 each).
    for c in cal["by_shard"]:
        assert len(c["steps"]) == advisor.CALIBRATION_GROUPS == 3
        assert c["step"] == sorted(c["steps"])[1]


def _span(tid, name, cat, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_step_trace_parts_by_hand():
    """parse_step_trace on a hand-made trace of 2 steps: a layer's time is its tasks' busy time
    (its mean over steps; of 2 steps the median too), tasks outside every layer are the device's
    other work, and the host's overhead is its step call less the time it sat blocked on a full
    queue."""
    meta = [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
            for t, n in ((1, "host"), (2, "cpu(0)"))]
    ev = []
    for i, (fwd, bwd) in enumerate(((100, 300), (200, 500))):
        t0 = i * 10_000
        ev += [_span(1, "train_batch", "span", t0, 2000),
               _span(1, "queue full", "span", t0 + 500, 1200),          # host blocked 1.2 ms
               _span(2, "copy in", "task", t0 + 100, 50),                # in no layer span
               _span(2, "layer 1 (linear) forward", "layer", t0 + 200, 1000),
               _span(2, "gemm", "task", t0 + 300, fwd),
               _span(2, "layer 1 (linear) backward", "layer", t0 + 2000, 1000),
               _span(2, "gemm", "task", t0 + 2100, bwd / 2),
               _span(2, "gemm", "task", t0 + 2500, bwd / 2),
               _span(2, "sgd update", "layer", t0 + 4000, 100),
               _span(2, "axpy", "task", t0 + 4010, 20)]
    p = advisor.parse_step_trace({"traceEvents": meta + ev}, 2, "cpu(0)")
    by = {e["name"]: e for e in p["entries"]}
    assert [e["phase"] for e in p["entries"]] == ["split", "forward", "backward", "update"]
    assert by["other device work"]["seconds"] == pytest.approx(50e-6)
    assert by["layer 1 (linear) forward"]["seconds"] == pytest.approx(150e-6)
    assert by["layer 1 (linear) backward"]["seconds"] == pytest.approx(400e-6)
    assert by["layer 1 (linear) backward"]["ops"] == 2
    assert p["host"] == pytest.approx(800e-6)
    # The device's idle time per step: from the first task (100 us) to the last's end (14030 us)
    # less the tasks' 1240 us, over 2 steps.
    assert p["idle"] == pytest.approx((14030 - 100 - 1240) / 2 * 1e-6)


def test_median_table_takes_each_number_s_median():
    a = json.loads(json.dumps(TABLE))
    b = json.loads(json.dumps(TABLE))
    c = json.loads(json.dumps(TABLE))
    for t, bw in ((a, 1e9), (b, 3e9), (c, 2e9)):
        t["allreduce"]["bus_bandwidth"] = bw
    c["compute"]["1"]["steps"][0]["per_example"] = 9.0
    m = advisor.median_table([a, b, c])
    assert m["allreduce"]["bus_bandwidth"] == 2e9
    assert m["compute"]["1"]["steps"][0]["per_example"] == 2e-3
    assert m["compute"]["1"]["steps"][0]["name"] == "f" and m["input"] is None
    # The all-reduce at 2 GB/s: 2 x 100 us + 4 MB / 2 GB/s = 2.2 ms; the cores bound
    # (0.002 + 2 x 0.3032) / 2.
    assert advisor.predict(m, 2, 100)["step"] == pytest.approx(0.3042)


def test_oversubscribed_ranks_use_the_calibrated_contention_and_wait_by_hand():
    """3 ranks of 2 threads on 2 cores, calibrated under mpirun at a 50-example shard: the
    layers' busy time there was 0.604 s against this table's 0.151 s at 2 threads (50 x 1 ms +
    50 x 2 ms + 1 ms): contention 4; the step took 0.7 s, of which the all-reduce of the
    1M-float bucket over 3 ranks is 4 x 200 us + 4/3 x 4 MB / 0.5 GB/s = 11.4667 ms, so the
    collectives waited 0.7 - 0.604 - 0.0114667 s per step for descheduled ranks."""
    cal = {"batch": 150, "shard": 50, "threads": 2, "compute": 0.604, "step": 0.7}
    mpi = json.loads(json.dumps(MPI))
    mpi["3"]["calibration"] = cal
    table = dict(TABLE, mpi=mpi)
    ar = 0.0008 + 4 / 3 * 4e6 / 5e8
    over = advisor.oversubscription(table, 3)
    assert over["contention"] == pytest.approx(4.0)
    assert over["wait"] == pytest.approx(0.7 - 0.604 - ar)
    r = advisor.predict(table, 1, 300, ranks=3)
    # shard 100: (100 x 1 ms + 100 x 2 ms + 1 ms) x 4 = 1.204 s of layers, then the all-reduce
    # and the wait, once per step: 1.204 + 0.096 s (the fair share alone said 0.903 + 0.0115).
    assert r["parts"]["compute"] == pytest.approx(1.204)
    assert r["parts"]["communication"] == pytest.approx(0.7 - 0.604)
    assert r["step"] == pytest.approx(1.3)
    assert r["oversubscription"]["shard"] == 50
    # 600 examples (shard 200): (200 x 3 ms + 1 ms) x 4 + the same all-reduce and wait.
    assert advisor.predict(table, 1, 600, ranks=3)["step"] == pytest.approx(0.601 * 4 + 0.096)
    # 2 ranks bound to a core each (1 thread): the threads fit the cores, so no wait applies;
    # the calibration's busy time still gives the measured slowdown (concurrency): 0.3612 s at
    # shard 50 against 0.301 s alone at 1 thread, 1.2. Shard 50 of 100: 0.301 x 1.2 of layers
    # and the MPI all-reduce's 4.2 ms; the cores (a rank's 1 / 1.2, the machine's 2 / 1.2) hold
    # (1.5 ms of host + 0.301 s) x 1.2 = 0.363 s, below it. Without a calibration, the fair
    # share, as before.
    mpi["2"]["calibration"] = dict(cal, shard=50, compute=0.3612, step=0.4)
    assert advisor.oversubscription(dict(TABLE, mpi=mpi), 2) is None
    assert advisor.oversubscription(dict(TABLE, mpi=MPI), 3) is None
    assert advisor.concurrency(dict(TABLE, mpi=mpi), 1, 2) == pytest.approx(1.2)
    r = advisor.predict(dict(TABLE, mpi=mpi), 1, 100, ranks=2)
    assert r["step"] == pytest.approx(0.3612 + 0.0042)
    assert r["cores"] == pytest.approx(0.3025 * 1.2)
    assert advisor.predict(dict(TABLE, mpi=MPI), 1, 100, ranks=2)["step"] == pytest.approx(0.3052)


def test_device_idle_between_tasks_by_hand():
    """The device's hand-offs between tasks (measured idle: fixed + per example) sit on its
    chain but hold no core: 1 device of 2 threads at 100 examples idles 2 ms + 100 x 10 us =
    3 ms, so its 0.301 s of layers end at 0.304 s, above the cores' bound (0.30175 s); 2
    devices of 1 thread idle 4 ms each after 0.301 s of layers and 4.2 ms of all-reduce."""
    table = json.loads(json.dumps(TABLE))
    table["compute"]["2"]["idle"] = {"fixed": 2e-3, "per_example": 1e-5}
    table["compute"]["1"]["idle"] = {"fixed": 4e-3, "per_example": 0.0}
    one = advisor.predict(table, 1, 100)
    assert one["idle"] == pytest.approx(0.003)
    assert one["device"] == pytest.approx(0.304)
    assert one["step"] == pytest.approx(0.304)
    assert one["parts"]["overhead"] == pytest.approx(0.0015 + 0.003)
    assert one["parts"]["communication"] == pytest.approx(0.0)
    assert one["cores"] == pytest.approx(0.30175)
    two = advisor.predict(table, 2, 100)
    assert two["device"] == pytest.approx(0.301 + 0.0042 + 0.004)
    assert two["step"] == pytest.approx(0.3092)
    assert two["parts"]["communication"] == pytest.approx(0.0042)
    # Ranks calibrated as oversubscribed carry their measured wait instead (no idle added).
    mpi = json.loads(json.dumps(MPI))
    mpi["3"]["calibration"] = {"batch": 150, "shard": 50, "threads": 2, "compute": 0.604,
                               "step": 0.7}
    assert advisor.predict(dict(table, mpi=mpi), 1, 300, ranks=3)["idle"] == 0.0


def test_interpolate_between_measured_points_by_hand():
    pts = [[8, 1.0], [32, 2.0], [256, 10.0]]
    assert advisor.interpolate(pts, 32) == pytest.approx(2.0)
    assert advisor.interpolate(pts, 16) == pytest.approx(1.0 + 8 / 24)
    assert advisor.interpolate(pts, 128) == pytest.approx(2.0 + 96 * 8 / 224)
    # Beyond the ends, the end segment's line: above 256 at 8 / 224 s per example, below 8 at
    # 1 / 24.
    assert advisor.interpolate(pts, 512) == pytest.approx(10.0 + 256 * 8 / 224)
    assert advisor.interpolate(pts, 4) == pytest.approx(1.0 - 4 / 24)
    # A time that fell between the last two points does not keep falling beyond them; one point
    # scales in proportion; never below 0.
    assert advisor.interpolate([[8, 1.0], [32, 0.5]], 64) == pytest.approx(0.5)
    assert advisor.interpolate([[10, 2.0]], 5) == pytest.approx(1.0)
    assert advisor.interpolate([[8, 0.1], [32, 2.5]], 1) == 0.0


def test_measured_points_replace_the_line_by_hand():
    """Where the table holds an entry's measured points, the prediction goes through them, not
    through its line: the 2-thread forward measured 0.05 s at 50 examples and 0.3 s at 200
    (the line said 1 ms per example) is 0.05 + 50 x 0.25 / 150 s at 100."""
    table = json.loads(json.dumps(TABLE))
    table["compute"]["2"]["steps"][0]["points"] = [[50, 0.05], [200, 0.3]]
    f = 0.05 + 50 * 0.25 / 150
    r = advisor.predict(table, 1, 100)
    assert r["parts"]["compute"] == pytest.approx(f + 0.2 + 0.001)
    assert r["device"] == pytest.approx(f + 0.2 + 0.001)
    # The idle time's points too: 3 ms at 50, 5 ms at 200 -> 3 ms + 50 x 2 ms / 150 at 100.
    table["compute"]["2"]["idle"] = {"fixed": 0.0, "per_example": 0.0,
                                     "points": [[50, 0.003], [200, 0.005]]}
    assert advisor.device_idle(table, 2, 100) == pytest.approx(0.003 + 50 * 0.002 / 150)


def test_measured_concurrency_replaces_the_fair_share_by_hand():
    """2 devices at once, traced at 50 examples each with 1 thread: the slower device's layers
    took 0.3612 s against 0.301 s alone (50 x 2 ms + 50 x 4 ms + 1 ms): they run 1.2x slower
    together, whatever the fair share of `effective_cores` says (here 1 core: 2x)."""
    table = dict(TABLE, effective_cores=1.0,
                 contention={"2": {"shard": 50, "threads": 1, "busy": 0.3612,
                                   "devices": [0.35, 0.3612]}})
    assert advisor.concurrency(table, 2) == pytest.approx(1.2)
    assert advisor.concurrency(table, 1) is None and advisor.concurrency(table, 3) is None
    r = advisor.predict(table, 2, 100)
    # shard 50: 0.301 s x 1.2 of layers, the in-process all-reduce's 4.2 ms x 1.2 on the same
    # threads; the cores: 2 threads at 1 / 1.2 of a core each hold the host's 2 ms and
    # 2 x 0.3052 s of work: (0.002 + 0.6104) x 1.2 / 2.
    assert r["slowdown"] == pytest.approx(1.2)
    assert r["parts"]["compute"] == pytest.approx(0.301 * 1.2)
    assert r["device"] == pytest.approx(0.3052 * 1.2)
    assert r["step"] == pytest.approx(0.6124 * 1.2 / 2)
    # Without the measurement, the fair share of one effective core: twice as slow.
    assert advisor.predict(dict(TABLE, effective_cores=1.0), 2, 100)["step"] == \
        pytest.approx(0.6124)
    # Faster together than alone (on a loaded machine the scheduler gives 2 threads more of the
    # cores than 1): as measured.
    table["contention"]["2"]["busy"] = 0.2408
    assert advisor.concurrency(table, 2) == pytest.approx(0.8)
    # Where one device alone was traced beside them (under the same load), the ratio is to it.
    table["contention"]["2"].update(busy=0.45, alone=0.25)
    assert advisor.concurrency(table, 2) == pytest.approx(1.8)
    # An old table's one ratio holds at every shard, with no idle beyond the alone device's.
    assert advisor.concurrency(table, 2, shard=10) == pytest.approx(1.8)
    assert advisor.concurrency(table, 2, shard=5000) == pytest.approx(1.8)
    assert advisor.concurrent_idle(table, 2, 50) == 0.0
    r = advisor.predict(table, 2, 400)
    assert r["slowdown"] == pytest.approx(1.8) and r["idle"] == 0.0


# Contention traced at two shards: at 25 examples per device 2 devices' layers ran 1.5x slower
# than one alone (0.3 s against 0.2 s) and idled 3 ms more per step (4 ms against 1 ms); at 100,
# 1.2x (0.6 / 0.5) and 6 ms more (9 ms against 3 ms). The single-shard keys say 2x: a table with
# shard points must not use them.
BY_SHARD = {"2": {"shard": 100, "threads": 1, "busy": 0.5, "alone": 0.25,
                  "devices": [0.5, 0.5],
                  "by_shard": [
                      {"shard": 100, "busy": 0.6, "alone": 0.5, "devices": [0.59, 0.6],
                       "idle": 0.009, "idle_alone": 0.003},
                      {"shard": 25, "busy": 0.3, "alone": 0.2, "devices": [0.3, 0.29],
                       "idle": 0.004, "idle_alone": 0.001}]}}


def test_contention_by_shard_interpolates_between_shards_by_hand():
    """At 50 examples per device, a third of the way from 25 to 100: ratio 1.5 - 0.3 / 3 = 1.4
    and extra idle 3 ms + 3 ms / 3 = 4 ms, in the prediction of 2 devices at global batch 100."""
    table = dict(TABLE, effective_cores=1.0, contention=BY_SHARD)
    assert advisor.concurrency(table, 2, shard=50) == pytest.approx(1.4)
    assert advisor.concurrent_idle(table, 2, 50) == pytest.approx(0.004)
    assert advisor.concurrency(table, 2, shard=62.5) == pytest.approx(1.35)  # halfway
    # Without a shard, the single-shard keys (what older callers read).
    assert advisor.concurrency(table, 2) == pytest.approx(2.0)
    r = advisor.predict(table, 2, 100)
    # shard 50: 0.301 s of layers and the 4.2 ms all-reduce x 1.4, then 4 ms idle (the table
    # has no idle of its own): device 0.3052 x 1.4 + 0.004 = 0.43128 s. The cores: 2 threads at
    # 1 / 1.4 of a core each hold (0.002 + 0.6104) core-seconds: 0.6124 x 1.4 / 2 = 0.42868 s.
    assert r["shard"] == 50 and r["slowdown"] == pytest.approx(1.4)
    assert r["parts"]["compute"] == pytest.approx(0.301 * 1.4)
    assert r["idle"] == pytest.approx(0.004)
    assert r["device"] == pytest.approx(0.3052 * 1.4 + 0.004)
    assert r["cores"] == pytest.approx(0.6124 * 1.4 / 2)
    assert r["step"] == pytest.approx(0.43128)
    assert r["parts"]["overhead"] == pytest.approx(0.002 + 0.004)


def test_contention_by_shard_holds_the_end_points_by_hand():
    """Below 25 and above 100 examples per device, the nearest measured shard's ratio and idle:
    1.5 and 3 ms at 10 (batch 20), 1.2 and 6 ms at 200 (batch 400); exactly the points at 25
    and 100 (batches 50 and 200)."""
    table = dict(TABLE, effective_cores=1.0, contention=BY_SHARD)
    for batch, ratio, extra in ((20, 1.5, 0.003), (50, 1.5, 0.003), (200, 1.2, 0.006),
                                (400, 1.2, 0.006)):
        r = advisor.predict(table, 2, batch)
        assert r["slowdown"] == pytest.approx(ratio)
        assert r["idle"] == pytest.approx(extra)
        shard = batch // 2
        # device: (shard x 6 ms + 1 ms + 4.2 ms all-reduce) x ratio + the extra idle.
        assert r["device"] == pytest.approx((shard * 0.006 + 0.0052) * ratio + extra)
    # One device and MPI ranks do not use it.
    assert advisor.predict(table, 1, 100)["idle"] == 0.0


def test_held_interpolate():
    pts = [(10, 1.0), (30, 3.0), (20, 4.0)]
    assert advisor.held_interpolate(pts, 15) == pytest.approx(2.5)
    assert advisor.held_interpolate(pts, 25) == pytest.approx(3.5)
    assert advisor.held_interpolate(pts, 5) == 1.0 and advisor.held_interpolate(pts, 99) == 3.0
    assert advisor.held_interpolate([(7, 2.0)], 1) == 2.0
    with pytest.raises(ValueError):
        advisor.held_interpolate([], 1)


def test_contention_shards():
    """k devices are traced at once at ceil(b / k) of each batch asked for, capped per model;
    at the calibration shard where none was asked for."""
    assert advisor.contention_shards("lenet", [64, 256, 1024], 2) == [32, 128, 512]
    assert advisor.contention_shards("lenet", [4096, 3], 2) == [2, 512]
    assert advisor.contention_shards("resnet18", [64, 256], 2, True) == [32, 64]
    assert advisor.contention_shards("lenet", [], 2) == [384]
    assert advisor.contention_shards("resnet18", [], 2, True) == [24]


def test_needed_shards():
    """The shards measure() times for batches 64 and 256 on 1..2 devices and 2 ranks with 2
    threads: 64 and 256 at 2 threads, 32 and 128 at 1 (2 ranks are bound to a core each);
    capped at MAX_MEASURED_SHARD."""
    assert advisor.needed_shards("resnet18", [64, 256], 2, 2, [2]) == {2: [64, 256],
                                                                       1: [32, 128]}
    assert advisor.needed_shards("resnet18", [1000], 1, 2) == {2: [256]}
    # 3 ranks on 2 cores: 1 thread each (at least 1), shard 22 of 64.
    assert advisor.needed_shards("lenet", [64], 2, 2, [3]) == {2: [64], 1: [22, 32]}


def test_calibration_shard_and_batch():
    """k devices and r ranks are calibrated on the same examples per device: 3/4 of the largest
    small batch (ResNet-18 quick: 24 of 32; LeNet: 48 of 64, 384 of 512), r times that in all."""
    assert advisor.small_batches("resnet18", True) == [8, 32]
    assert advisor.calibration_shard("resnet18", True) == 24
    assert advisor.calibration_batch("resnet18", True, 2) == 48
    assert advisor.calibration_batch("lenet", True, 3) == 144
    assert advisor.calibration_batch("lenet", False, 2) == 768


def test_step_trace_counts_a_stalled_step_in_full_by_hand():
    """A real run's step time is its total over its steps, so the layer's time is its mean step:
    3 steps of 100, 100 and 400 us (a kernel held up by a descheduled thread) give 200 us, where
    the median step (what bench --parts layers asks for) gives 100 us."""
    meta = [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
            for t, n in ((1, "host"), (2, "cpu(0)"))]
    ev = []
    for i, fwd in enumerate((100, 400, 100)):
        t0 = i * 10_000
        ev += [_span(1, "train_batch", "span", t0, 500),
               _span(2, "layer 1 (linear) forward", "layer", t0 + 200, 1000),
               _span(2, "gemm", "task", t0 + 300, fwd)]
    doc = {"traceEvents": meta + ev}
    p = advisor.parse_step_trace(doc, 3, "cpu(0)")
    assert p["entries"][0]["seconds"] == pytest.approx(200e-6)
    q = advisor.parse_step_trace(doc, 3, "cpu(0)", statistic="median")
    assert q["entries"][0]["seconds"] == pytest.approx(100e-6)
    with pytest.raises(ValueError, match="statistic"):
        advisor.parse_step_trace(doc, 3, "cpu(0)", statistic="min")


def test_slowest_device_keeps_its_own_idle():
    """Device 1 is busy 0.6 s and idle 0.1 s, device 0 busy 0.5 s and idle 0.2 s (waiting for
    device 1 at the all-reduce): the step is 0.6 + 0.1, not 0.6 + 0.2."""
    assert advisor.slowest_device([0.5, 0.6], [0.2, 0.1]) == (0.6, 0.1)
    assert advisor.slowest_device([0.7, 0.6], [0.0, 0.1]) == (0.7, 0.0)


def test_median_prediction_of_two_rounds_is_their_mean_by_hand():
    """Of 2 rounds' predictions the validated row takes the mean, as statistics.median takes the
    measured steps': steps 0.2 and 0.3 s give 0.25 s (not the smaller 0.2), parts likewise, the
    bound the largest median part; 3 rounds give the middle one."""
    def pred(step, compute, comm):
        return {"devices": 2, "ranks": 1, "batch": 64, "step": step, "bound": "compute",
                "parts": {"compute": compute, "communication": comm, "overhead": 0.01,
                          "input": 0.0}, "oversubscription": None, "measured": True}
    row = advisor.median_prediction([pred(0.3, 0.1, 0.19), pred(0.2, 0.15, 0.04)])
    assert row["step"] == pytest.approx(0.25)
    assert row["parts"]["compute"] == pytest.approx(0.125)
    assert row["parts"]["communication"] == pytest.approx(0.115)
    assert row["bound"] == "compute" and row["devices"] == 2
    row = advisor.median_prediction([pred(0.3, 0.1, 0.19), pred(0.2, 0.15, 0.04),
                                     pred(0.4, 0.1, 0.29)])
    assert row["step"] == pytest.approx(0.3) and row["bound"] == "communication"


def test_calibration_shards():
    """The ranks are calibrated at 3/4 of each small batch, none of them a batch validated."""
    assert advisor.calibration_shards("lenet") == [24, 96, 384]
    assert advisor.calibration_shards("lenet", True) == [12, 48]
    assert advisor.calibration_shards("resnet18") == [6, 24, 48]
    assert advisor.calibration_shards("resnet18", True) == [6, 24]
    assert advisor.calibration_shards("lenet")[-1] == advisor.calibration_shard("lenet")


# 3 ranks of 2 threads on 2 cores calibrated at 25 and 100 examples per rank. At 25 the layers
# were busy 0.304 s against this table's 0.076 s (25 x 3 ms + 1 ms) at 2 threads: contention 4;
# the step took 0.4 s. At 100, 1.505 s against 0.301 s: 5; the step 1.7 s. The all-reduce of the
# 1M-float bucket over 3 ranks is 4 x 200 us + 4/3 x 4 MB / 0.5 GB/s = 11.4667 ms, so the waits
# are 0.4 - 0.304 - 0.0114667 and 1.7 - 1.505 - 0.0114667 s.
AR3 = 0.0008 + 4 / 3 * 4e6 / 5e8
CAL3 = [{"batch": 75, "shard": 25, "threads": 2, "compute": 0.304, "step": 0.4},
        {"batch": 300, "shard": 100, "threads": 2, "compute": 1.505, "step": 1.7}]


def test_oversubscribed_ranks_calibrated_by_shard_by_hand():
    """At 50 examples per rank, a third of the way from 25 to 100: contention 4 + 1/3 and wait
    w25 + (w100 - w25) / 3; below 25 and above 100 the nearest shard's."""
    mpi = json.loads(json.dumps(MPI))
    mpi["3"]["calibration"] = dict(CAL3[-1], by_shard=CAL3)
    table = dict(TABLE, mpi=mpi)
    w25, w100 = 0.4 - 0.304 - AR3, 1.7 - 1.505 - AR3
    over = advisor.oversubscription(table, 3, 50)
    assert over["contention"] == pytest.approx(4 + 1 / 3)
    assert over["wait"] == pytest.approx(w25 + (w100 - w25) / 3)
    assert over["shard"] == 50
    r = advisor.predict(table, 1, 150, ranks=3)
    # shard 50: (50 x 3 ms + 1 ms) x 13/3 = 0.654333 s of layers, the all-reduce and the wait:
    # 0.654333 + 0.0114667 + 0.1175333 = 0.783333 s (the cores: 3 x (1.5 ms + 2 x 0.151) / 2
    # = 0.45525 s, below it).
    assert r["parts"]["compute"] == pytest.approx(0.151 * 13 / 3)
    assert r["step"] == pytest.approx(0.151 * 13 / 3 + AR3 + w25 + (w100 - w25) / 3)
    assert r["step"] == pytest.approx(0.7833333, rel=1e-6)
    # Held at the ends: shard 10, (31 ms x 4) + 0.096 s; shard 200, (0.601 s x 5) + 0.195 s.
    assert advisor.predict(table, 1, 30, ranks=3)["step"] == pytest.approx(0.124 + 0.096)
    assert advisor.predict(table, 1, 600, ranks=3)["step"] == pytest.approx(3.005 + 0.195)
    # A table with one calibration (older tables) predicts as before at every shard: its one
    # contention (5) and wait.
    mpi["3"]["calibration"] = CAL3[-1]
    for batch in (30, 150, 600):
        shard = batch // 3
        r = advisor.predict(dict(TABLE, mpi=mpi), 1, batch, ranks=3)
        assert r["step"] == pytest.approx((shard * 0.003 + 0.001) * 5 + 0.195)
        assert r["oversubscription"]["shard"] == 100


def test_ranks_within_the_cores_calibrated_by_shard_by_hand():
    """2 ranks bound to a core each (1 thread), calibrated at 25 (0.1812 s against 0.151 s
    alone: 1.2) and 100 (0.9015 s against 0.601 s: 1.5): at shard 50, 1.3; 0.301 x 1.3 of layers
    and the MPI all-reduce's 4.2 ms (the cores hold (1.5 ms + 0.301 s) x 1.3 = 0.39325 s,
    below it)."""
    mpi = json.loads(json.dumps(MPI))
    cal = [{"batch": 50, "shard": 25, "threads": 1, "compute": 0.1812, "step": 0.2},
           {"batch": 200, "shard": 100, "threads": 1, "compute": 0.9015, "step": 1.0}]
    mpi["2"]["calibration"] = dict(cal[-1], by_shard=cal)
    table = dict(TABLE, mpi=mpi)
    assert advisor.concurrency(table, 1, 2, 50) == pytest.approx(1.3)
    assert advisor.concurrency(table, 1, 2, 10) == pytest.approx(1.2)
    assert advisor.concurrency(table, 1, 2, 400) == pytest.approx(1.5)
    assert advisor.oversubscription(table, 2, 50) is None
    r = advisor.predict(table, 1, 100, ranks=2)
    assert r["slowdown"] == pytest.approx(1.3)
    assert r["step"] == pytest.approx(0.301 * 1.3 + 0.0042)
    assert r["cores"] == pytest.approx(0.3025 * 1.3)


def test_oversubscribed_ranks_by_shard_run_at_their_calibrated_busy_time_by_hand():
    """Calibrated by shard, the ranks' busy time is what they ran at even below this table's (the
    table measured under heavier load: here half of it, at 25 0.038 s against 0.076 s, at 100
    0.1505 s against 0.301 s), and their wall time holds the cores' share: with this process
    seeing one core's worth (effective_cores 1) the cores bound no step. At shard 50: layers
    0.151 x 0.5, the all-reduce, and the wait w25 + (w100 - w25) / 3 (steps 0.1 and 0.3 s)."""
    mpi = json.loads(json.dumps(MPI))
    cal = [{"batch": 75, "shard": 25, "threads": 2, "compute": 0.038, "step": 0.1},
           {"batch": 300, "shard": 100, "threads": 2, "compute": 0.1505, "step": 0.3}]
    mpi["3"]["calibration"] = dict(cal[-1], by_shard=cal)
    table = dict(TABLE, mpi=mpi, effective_cores=1.0)
    w25, w100 = 0.1 - 0.038 - AR3, 0.3 - 0.1505 - AR3
    over = advisor.oversubscription(table, 3, 50)
    assert over["contention"] == pytest.approx(0.5) and over["by_shard"]
    r = advisor.predict(table, 1, 150, ranks=3)
    assert r["parts"]["compute"] == pytest.approx(0.0755)
    assert r["cores"] == 0.0
    assert r["step"] == pytest.approx(0.0755 + AR3 + w25 + (w100 - w25) / 3)
    assert r["step"] == pytest.approx(0.1666667, rel=1e-6)
    # At one shard (an older table): the floor of 1 and the cores' bound, 3 ranks x (1.5 ms
    # of host + 0.151 s on min(2 threads, 1 core)) over 1 core.
    mpi["3"]["calibration"] = cal[0]
    r = advisor.predict(table, 1, 150, ranks=3)
    assert r["slowdown"] == 1.0 and r["parts"]["compute"] == pytest.approx(0.151)
    assert r["step"] == pytest.approx(3 * (0.0015 + 0.151))


def test_traced_steps_fill_the_minimum_window_by_hand():
    """A step of 3 ms is traced for ceil(0.2 / 0.003) = 67 steps (a mean over 6 steps, 18 ms, is
    one scheduler time slice from another figure); a 50 ms step keeps the 6 asked for; a tiny
    step stops at MAX_TRACED_STEPS."""
    assert advisor.traced_steps(0.003, 6, 0.2) == 67
    assert advisor.traced_steps(0.003, 3, 0.1) == 34
    assert advisor.traced_steps(0.05, 6, 0.2) == 6
    assert advisor.traced_steps(1e-6, 6, 0.2) == advisor.MAX_TRACED_STEPS == 100


def test_seconds_per_step_times_n_steps_on_the_next_batches_by_hand(monkeypatch):
    """Four steps of 2^-5 s each on a fake clock, each fed the next batch: 2^-5 s per step
    (binary fractions: exact), and the fifth batch is never drawn."""
    now = [1.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    seen = []

    def step(X, y):
        seen.append((X, y))
        now[0] += 0.03125
    batches = iter([(i, -i) for i in range(5)])
    assert advisor.seconds_per_step(step, lambda: next(batches), 4) == 0.03125
    assert seen == [(i, -i) for i in range(4)]


def test_warm_up_times_its_last_step_by_hand(monkeypatch):
    """Two warm-up steps on the fed batches: the first (allocations, a cold cache) takes 0.25 s
    on a fake clock, the second 2^-7 s = 7.8 ms (binary fractions: the quotient is exact). The
    second, timed alone, asks for 0.5 / 2^-7 = 64 traced steps (both together would give 6)."""
    now = [2.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    seen = []

    def step(X, y):
        seen.append((X, y))
        now[0] += 0.25 if len(seen) == 1 else 0.0078125
    batches = iter([("X0", "y0"), ("X1", "y1"), ("X2", "y2")])
    n = advisor.warm_up(step, lambda: next(batches), 2, 6, 0.5)
    assert n == 64
    assert seen == [("X0", "y0"), ("X1", "y1")]


def test_feed_draws_whole_shuffled_batches_across_epochs():
    """The advisor's steps are fed as training is, from the loader: 10 images in batches of 4
    give 2 whole batches an epoch (the partial batch of 2 is skipped, a step of another size
    would be another measurement), and the feed goes on into the next epoch; every image of an
    epoch's whole batches is a distinct image of the set."""
    images = np.arange(10, dtype=np.uint8).reshape(10, 1, 1) * np.ones((1, 28, 28), np.uint8)
    labels = np.arange(10, dtype=np.uint8)
    nxt = advisor.feed(4, split=mgpu._core.make_split(images, labels))
    got = [nxt() for _ in range(5)]
    assert [X.shape[0] for X, _ in got] == [4] * 5
    for X, y in got:
        assert X.shape == (4, 1, 28, 28)
    ys = [[int(v) for v in y.numpy()] for _, y in got]
    for epoch in (ys[0] + ys[1], ys[2] + ys[3]):
        assert len(set(epoch)) == 8 and set(epoch) <= set(range(10))


def test_feed_without_the_data_set_reuses_one_synthetic_batch(monkeypatch):
    def missing(data_dir=None):
        raise FileNotFoundError("no Fashion-MNIST here")
    monkeypatch.setattr(data, "find_data_dir", missing)
    assert advisor.train_split() is None
    nxt = advisor.feed(6)
    X, y = nxt()
    assert X.shape == (6, 1, 28, 28) and y.shape == (6,)
    assert nxt()[0] is X


def test_step_trace_host_from_the_calls_that_never_blocked_by_hand():
    """Of 3 step calls, two ran without blocking (200 and 300 us) and one blocked on a full
    queue (2000 us with 1200 us of waits, 800 us left: on shared cores the wake-ups' cost): the
    host's work is the unblocked calls' median, 250 us. Where every call blocked, the median of
    the calls less their waits (test_step_trace_parts_by_hand)."""
    meta = [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
            for t, n in ((1, "host"), (2, "cpu(0)"))]
    ev = []
    for i, (call, waits) in enumerate(((200, []), (2000, [700, 500]), (300, []))):
        t0 = i * 10_000
        ev += [_span(1, "train_batch", "span", t0, call),
               _span(2, "layer 1 (linear) forward", "layer", t0 + 200, 1000),
               _span(2, "gemm", "task", t0 + 300, 100)]
        at = t0 + 50
        for w in waits:
            ev.append(_span(1, "queue full", "span", at, w))
            at += w + 10
    p = advisor.parse_step_trace({"traceEvents": meta + ev}, 3, "cpu(0)")
    assert p["host"] == pytest.approx(250e-6)
