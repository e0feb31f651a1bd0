"""``python -m mgpu bench {train,ops,batch_norm,allreduce}``: each runs in-process at tiny sizes,
and its JSON holds every field, positive times, and derived numbers that agree with the raw ones
(busbw = algbw * 2(k-1)/k, sec/epoch = median sec/step * batches, ratios = torch / mgpu medians).
"""
import contextlib
import gzip
import io
import json
import os
import sys

import numpy as np
import pytest

import mgpu
import peers
from mgpu import bench, cli
from mgpu.bench import rival_common


def _run(argv, tmp_path, name):
    """Runs the CLI in-process; returns (exit code, stdout, the JSON it wrote)."""
    path = tmp_path / f"{name}.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv + ["--quiet", "--json", str(path)])
    return code, out.getvalue(), json.loads(path.read_text()) if path.exists() else None


def _check_stats(s):
    assert s["n"] == len(s["times"]) >= 1
    assert all(t > 0 for t in s["times"])
    assert s["min"] <= s["median"] <= s["max"]
    assert s["spread"] == pytest.approx((s["max"] - s["min"]) / s["median"])


def _check_machine(r):
    m = r["machine"]
    assert r["schema"] == bench.SCHEMA
    assert m["nproc"] >= 1 and m["cpu_model"] and m["build_info"]["version"] == mgpu.__version__


@pytest.fixture(scope="module")
def train_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    code, text, r = _run(["bench", "train", "--synthetic", "1200", "--limit-batches", "3",
                          "--epochs", "1", "--warmup", "1", "--repeat", "1",
                          "--batch-size", "64", "--gemm-size", "128"], tmp, "train")
    assert code == 0
    return text, r


def test_train_reports_the_cost_of_the_deterministic_step(train_result):
    text, r = train_result
    assert [d["num_devices"] for d in r["deterministic"]] == [1, 2]
    for d in r["deterministic"]:
        assert d["shards"] == 8 and d["steps_per_epoch"] == 3
        for mode in ("default", "deterministic"):
            for clock in ("wall", "cpu"):
                _check_stats(d[mode][clock])
                assert len(d[mode][clock]["times"]) == 2  # interleaved epochs, at least two
        a, b = d["default"]["cpu"]["median"], d["deterministic"]["cpu"]["median"]
        assert d["cpu_cost_percent"] == pytest.approx(100 * (b - a) / a)
    assert "deterministic (train_batch deterministic=True, 8 shards) on 2 devices" in text
    assert "% CPU (process CPU time" in text


def test_train_reports_every_configuration(train_result):
    text, r = train_result
    _check_machine(r)
    assert "ms/step" in text and "sgemm" in text and "extrapolated" in text
    names = [(x["impl"], x["num_devices"]) for x in r["results"]]
    assert names == [("mgpu fused", 1), ("mgpu fused", 2), ("mgpu op-by-op", 1),
                     ("mgpu op-by-op", 2)]
    for x in r["results"] + r["scaling"]["runs"]:
        _check_stats(x["sec_per_step"])
        full = -(-1200 // x["global_batch"])  # batches in a whole epoch: 19 at 64, 10 at 128
        assert x["steps_per_epoch"] == 3 and x["full_batches"] == full
        assert x["extrapolated"]
        assert len(x["epoch_times"]) == 1
        assert x["sec_per_step"]["times"][0] == pytest.approx(x["epoch_times"][0] / 3)
        assert x["sec_per_epoch"] == pytest.approx(x["sec_per_step"]["median"] * full)
        assert x["images_per_sec"] == pytest.approx(x["global_batch"] / x["sec_per_step"]["median"])
        step_flops = bench.lenet_step_flops(x["global_batch"])
        assert x["gflops"] == pytest.approx(step_flops / x["sec_per_step"]["median"] / 1e9)
    fused = r["results"][0]
    assert len(fused["train_loss"]) == 1 and 0 < fused["train_loss"][0] < 10


def test_train_scaling_pipeline_eval_and_flops_agree_with_the_raw_times(train_result):
    _, r = train_result
    two, one = r["scaling"]["runs"]
    assert (two["num_devices"], two["global_batch"]) == (2, 128)
    assert (one["num_devices"], one["global_batch"], one["threads"]) == (1, 64, 1)
    assert r["scaling"]["efficiency"] == pytest.approx(
        one["sec_per_step"]["median"] / two["sec_per_step"]["median"])
    assert mgpu.num_threads() == r["machine"]["mgpu_threads"], "the thread count is restored"

    fused = {x["num_devices"]: x for x in r["results"] if x["impl"] == "mgpu fused"}
    p = r["pipeline"]
    _check_stats(p["pass_time"])
    assert p["sec_per_epoch"] == pytest.approx(p["pass_time"]["median"] / 3 * 19)
    for k, pct in p["percent_of_epoch"].items():
        assert pct == pytest.approx(100 * p["sec_per_epoch"] / fused[int(k)]["sec_per_epoch"])

    assert [e["num_devices"] for e in r["evaluation"]] == [1, 2]
    for e in r["evaluation"]:
        _check_stats(e["pass_time"])
        assert e["full_batches"] == 4  # 1200 // 6 = 200 test images in batches of 64
        assert e["sec_per_eval"] == pytest.approx(e["pass_time"]["median"] / 3 * 4)
        assert e["percent_of_epoch"] == pytest.approx(
            100 * e["sec_per_eval"] / fused[e["num_devices"]]["sec_per_epoch"])

    f = r["flops"]
    _check_stats(f["sgemm"]["time"])
    assert f["sgemm"]["gflops"] == pytest.approx(2 * 128 ** 3 / f["sgemm"]["time"]["median"] / 1e9)
    assert f["per_step"] == bench.lenet_step_flops(64)
    assert f["per_epoch"] == f["per_image"] * 1200
    for a in f["achieved"]:
        assert a["percent_of_sgemm"] == pytest.approx(100 * a["gflops"] / f["sgemm"]["gflops"])


def test_lenet_flops_come_from_the_layer_shapes():
    # Written out by hand: conv1 20x26x26 outputs of 1x3x3, conv2 50x9x9 of 20x5x5, fc 800->128->10.
    conv1, conv2 = 2 * 20 * 26 * 26 * 9, 2 * 50 * 9 * 9 * 20 * 25
    fc1, fc2 = 2 * 800 * 128, 2 * 128 * 10
    forward = conv1 + conv2 + fc1 + fc2
    backward = conv1 + 2 * (conv2 + fc1 + fc2)  # X needs no gradient: conv1 computes dw only
    assert bench.lenet_step_flops(1) == forward + backward
    assert bench.lenet_step_flops(256) == 256 * (forward + backward)
    assert 60000 * bench.lenet_step_flops(1) / 1e12 == pytest.approx(0.80, abs=0.01)


def test_ops_times_every_lenet_op(tmp_path):
    code, text, r = _run(["bench", "ops", "--batch-sizes", "2,5", "--warmup", "1",
                          "--repeat", "2"], tmp_path, "ops")
    assert code == 0
    _check_machine(r)
    assert "conv2" in text and "fused train_batch" in text
    ops = [x["op"].split(" (")[0] for x in r["ops"] if x["batch"] == 5]
    assert ops == ["conv1", "relu1", "avg_pool1", "conv2", "relu2", "avg_pool2", "fc1 mm",
                   "fc1 bias", "relu3", "fc2 mm", "fc2 bias", "softmax_ce"]
    flops_at = {n: {x["layer"]: x for x in bench.lenet_layer_flops(n)} for n in (2, 5)}
    for x in r["ops"]:
        label = x["op"].split(" (")[0]
        for phase in ("forward", "backward"):
            _check_stats(x[phase])
            assert len(x[phase]["times"]) == 2
            if label in ("conv1", "conv2", "fc1 mm", "fc2 mm"):
                layer = flops_at[x["batch"]][label.split()[0]]
                assert x["gflops_" + phase] == pytest.approx(
                    layer[phase] / x[phase]["median"] / 1e9)
            else:
                assert x["gflops_" + phase] is None
    for s in r["steps"]:
        _check_stats(s["fused_step"])
        assert s["sum_of_ops"] == pytest.approx(sum(
            x["forward"]["median"] + x["backward"]["median"] for x in r["ops"]
            if x["batch"] == s["batch"]))


def test_allreduce_reports_algbw_and_busbw(tmp_path):
    code, text, r = _run(["bench", "allreduce", "--devices", "2,3", "--sizes", "1K,64K",
                          "--warmup", "1", "--repeat", "2"], tmp_path, "allreduce")
    assert code == 0
    _check_machine(r)
    assert "busbw" in text and "k = 3 devices" in text
    assert [(x["devices"], x["bytes"]) for x in r["results"]] == [
        (2, 1024), (2, 65536), (3, 1024), (3, 65536)]
    for x in r["results"]:
        k = x["devices"]
        _check_stats(x["time"])
        assert x["algbw"] == x["bytes"] / x["time"]["median"]
        assert x["busbw"] == x["algbw"] * (2 * (k - 1) / k)
    names = [b["name"] for b in r["baselines"]]
    assert names == ["copy cpu(0) -> cpu(1)", "numpy copyto (host memcpy)"]
    for b in r["baselines"]:
        assert b["bytes"] == 65536 and b["bandwidth"] == b["bytes"] / b["time"]["median"]


def test_batch_norm_reports_gbps_against_a_copy(tmp_path):
    code, text, r = _run(["bench", "batch_norm", "--shape", "4,3,5,5", "--warmup", "1",
                          "--repeat", "2"], tmp_path, "batch_norm")
    assert code == 0
    _check_machine(r)
    assert "of copy" in text
    n = 4 * 3 * 5 * 5
    assert [(x["op"], x["bytes"]) for x in r["ops"]] == [
        ("copy x -> y (memcpy)", 8 * n), ("stats (mean, var)", 4 * n), ("forward y", 8 * n),
        ("backward_reduce", 8 * n), ("backward dx (training)", 12 * n)]
    for x in r["ops"]:
        _check_stats(x["time"])
        assert x["gbps"] == x["bytes"] / x["time"]["median"] / 1e9
    assert r["totals"]["copy"] == r["ops"][0]["time"]["median"]
    code, _, _ = _run(["bench", "batch_norm", "--shape", "4,3,5"], tmp_path, "bad")
    assert code == 2


def test_plots_every_result_kind(tmp_path):
    pytest.importorskip("matplotlib")
    for name, argv in (("ops", ["ops", "--batch-sizes", "2", "--warmup", "0", "--repeat", "1"]),
                       ("allreduce", ["allreduce", "--sizes", "1K,4K", "--warmup", "0",
                                      "--repeat", "1"]),
                ("batch_norm", ["batch_norm", "--shape", "2,2,3,3", "--warmup", "0",
                                "--repeat", "1"]),
                ("conv", ["conv", "--batch", "1", "--rounds", "1", "--repeat", "1", "--warmup",
                          "0", "--algos", "direct"]),
                ("isa", ["isa", "--rounds", "1", "--synthetic", "300", "--limit-batches", "2",
                         "--warmup", "0", "--repeat", "1", "--ops-batch", "4", "--batch-size",
                         "32"])):
        png = tmp_path / f"{name}.png"
        code, _, r = _run(["bench"] + argv + ["--plot", str(png)], tmp_path, name)
        assert code == 0 and png.stat().st_size > 1000
        assert bench.load(str(tmp_path / f"{name}.json")) == r


def test_plot_train_result(train_result, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "train.png"
    fig = bench.plot(train_result[1], str(png))
    assert png.stat().st_size > 1000 and fig.axes


def test_summarize_and_sizes():
    s = bench.summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["spread"]) == (2.0, 1.0, 3.0, 1.0)
    assert [bench.parse_size(t) for t in ("1K", "4KiB", "16M", "1G", "4096")] == [
        1024, 4096, 16 << 20, 1 << 30, 4096]
    assert bench.format_size(64 << 20) == "64 MiB"
    assert bench.bus_factor(2) == 1.0 and bench.bus_factor(4) == 1.5
    with pytest.raises(ValueError, match="cannot read the size"):
        bench.parse_size("lots")


def test_bad_arguments_fail_with_a_message(capsys):
    assert cli.main(["bench", "allreduce", "--devices", "1", "--sizes", "1K"]) == 2
    assert "every device count must be >= 2" in capsys.readouterr().err
    assert cli.main(["bench", "train", "--synthetic", "100", "--parts", "fused,magic"]) == 2
    assert "unknown parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "allreduce", "--sizes", "huge"])
    assert cli.main(["bench", "train", "--synthetic", "100", "--parts", "fused", "--compare",
                     "torch", "--torch-python", "/nonexistent/python"]) == 2
    assert "cannot import torch" in capsys.readouterr().err


@pytest.mark.parametrize("rival,framework", [("torch", "PyTorch"), ("jax", "JAX")])
def test_a_rival_comparison_is_skipped_without_its_framework(tmp_path, monkeypatch, rival,
                                                             framework):
    monkeypatch.setattr(bench.rivals, f"find_{rival}_python",
                        lambda explicit=None: (None, f"no {rival} here"))
    code, text, r = _run(["bench", "train", "--synthetic", "300", "--batch-size", "64",
                          "--limit-batches", "1", "--epochs", "1", "--warmup", "0",
                          "--parts", "fused", "--devices", "1", "--compare", rival],
                         tmp_path, "skip")
    assert code == 0
    assert r[rival] == {"skipped": f"no {rival} here"} and r["comparisons"] == []
    assert [x["impl"] for x in r["results"]] == ["mgpu fused"]
    assert f"{framework} comparison skipped: no {rival} here" in text


def test_rivals_read_idx_like_mgpu(tmp_path):
    """The rivals parse IDX themselves (they cannot import mgpu); both must see the same bytes."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    header = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in images.shape)
    for name, opener in (("x-idx3-ubyte.gz", gzip.open), ("x-idx3-ubyte", open)):
        with opener(tmp_path / name, "wb") as f:
            f.write(header + images.tobytes())
        np.testing.assert_array_equal(rival_common.read_idx(str(tmp_path / name)), images)
        np.testing.assert_array_equal(mgpu._core.read_idx(str(tmp_path / name)), images)


def test_train_compare_torch(tmp_path):
    py = peers.torch_python()
    code, text, r = _run(["bench", "train", "--synthetic", "600", "--batch-size", "64",
                          "--limit-batches", "2", "--epochs", "1", "--warmup", "0",
                          "--parts", "fused,op-by-op", "--compare", "torch"], tmp_path, "torch")
    assert code == 0
    assert r["torch"]["python"] == py and r["torch"]["threads"] == 2
    impls = [(x["impl"], x["num_devices"]) for x in r["results"]]
    assert ("torch chapter", 1) in impls and ("torch chapter", 2) in impls
    assert ("torch idiomatic", 1) in impls and ("torch chapter + loader", 1) in impls
    by = {(x["impl"], x["num_devices"]): x for x in r["results"]}
    for x in r["results"]:
        _check_stats(x["sec_per_step"])
    pairs = {(c["mgpu"], c["torch"]) for c in r["comparisons"]}
    assert len(r["comparisons"]) == 6
    for c in r["comparisons"]:
        assert c["ratio"] == c["torch_sec_per_step"] / c["mgpu_sec_per_step"]
    for mine, theirs, k in (("mgpu fused", "torch chapter", 1), ("mgpu fused", "torch chapter", 2),
                            ("mgpu op-by-op", "torch chapter", 2),
                            ("mgpu fused", "torch idiomatic", 1),
                            ("mgpu fused", "torch chapter + loader", 1)):
        a, b = by[(mine, k)], by[(theirs, k)]
        assert (a["name"], b["name"]) in pairs
        c = [c for c in r["comparisons"] if (c["mgpu"], c["torch"]) == (a["name"], b["name"])][0]
        assert c["mgpu_sec_per_step"] == a["sec_per_step"]["median"]
        assert c["torch_sec_per_step"] == b["sec_per_step"]["median"]
    for x in r["results"]:
        if x["impl"].startswith("torch"):
            assert 0 < x["train_loss"][0] < 10, "the PyTorch code trains on the same data"
    assert "ratio" in text


def _resnet18_forward_flops_per_image():
    """d2l's resnet18(10, 1) on 28x28, counted by hand: (out ch, in ch, kernel, output side)."""
    convs = [(64, 1, 3, 28)] + [(64, 64, 3, 28)] * 4
    for c_in, c, side in ((64, 128, 14), (128, 256, 7), (256, 512, 4)):
        convs += [(c, c_in, 3, side), (c, c, 3, side), (c, c_in, 1, side)] + [(c, c, 3, side)] * 2
    return [2 * k * c * r * r * side * side for k, c, r, side in convs] + [2 * 512 * 10]


def test_resnet18_flops_come_from_the_layer_shapes():
    per_layer = _resnet18_forward_flops_per_image()
    forward = sum(per_layer)
    # Backward: dw and dx for every layer but the stem, whose input needs no gradient.
    expected = 3 * forward - per_layer[0]
    assert bench.resnet18_step_flops(1) == expected
    assert bench.resnet18_step_flops(256) == 256 * expected
    assert 600e9 < bench.resnet18_step_flops(256) < 800e9  # the "about 700 GFLOP"


def _check_resnet_result(r, sides):
    assert r["settings"]["model"] == "resnet18"
    impls = sorted((x["impl"], x["num_devices"]) for x in r["results"])
    assert impls == sorted(sides)
    flops = r["flops"]["per_step"]
    assert flops == bench.resnet18_step_flops(r["settings"]["batch_size"])
    for x in r["results"]:
        _check_stats(x["sec_per_step"])
        assert x["gflops"] == pytest.approx(flops / x["sec_per_step"]["median"] / 1e9)
        assert x["peak_rss_bytes"] > 50 << 20  # each side's own process: interpreter + net
        assert x["steps_per_epoch"] == r["settings"]["limit_batches"]
    for x in r["results"]:
        if x["impl"].startswith("mgpu"):
            assert x["allocator_peak_bytes"] > 4 * 11_175_818  # at least the parameters
            # Every block handed out came from memory the allocator took from the system.
            assert x["allocator_held_bytes"] >= x["allocator_peak_bytes"]
            assert x["devices"] == [f"cpu({i})" for i in range(x["num_devices"])]


def test_train_resnet18_times_each_side_in_its_own_process(tmp_path, monkeypatch):
    # The sides' processes see CPU devices only, as on a machine without GPUs.
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    monkeypatch.setattr(bench.rivals, "find_torch_python",
                        lambda explicit=None: (None, "no torch here"))
    code, text, r = _run(["bench", "train", "--model", "resnet18", "--synthetic", "12",
                          "--batch-size", "4", "--limit-batches", "1", "--epochs", "1",
                          "--warmup", "2", "--compare", "torch"], tmp_path, "resnet")
    assert code == 0
    _check_resnet_result(r, [("mgpu fused", 1), ("mgpu fused", 2), ("mgpu op-by-op", 1),
                             ("mgpu op-by-op", 2)])
    # After two warm-up steps (the first fills the allocator's cache, the second its reserve) the
    # fused step's timed batches take nothing from the system; the count starts after warm-up.
    assert [x["system_mallocs_timed"] for x in r["results"] if x["impl"] == "mgpu fused"] == [0, 0]
    assert r["torch"] == {"skipped": "no torch here"} and r["comparisons"] == []
    assert "ResNet-18" in text and "peak RSS MiB" in text and "skipped: no torch here" in text
    # The same batches on every side: fused and the book's loop train alike on k devices.
    for k in (1, 2):
        a, b = (x["train_loss"][0] for x in r["results"] if x["num_devices"] == k)
        assert abs(a - b) < 1e-3 * abs(a)


def test_train_resnet18_weak_scaling_gives_k_devices_k_times_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    code, text, r = _run(["bench", "train", "--model", "resnet18", "--synthetic", "12",
                          "--batch-size", "3", "--limit-batches", "1", "--epochs", "1",
                          "--warmup", "1", "--parts", "fused", "--devices", "1,2",
                          "--weak-scaling"], tmp_path, "weak")
    assert code == 0 and r["settings"]["weak_scaling"] is True
    one, two = sorted(r["results"], key=lambda x: x["num_devices"])
    assert (one["global_batch"], two["global_batch"]) == (3, 6)
    per_image = bench.resnet18_step_flops(1)
    for x in (one, two):
        assert x["sec_per_image"] == x["sec_per_step"]["median"] / x["global_batch"]
        assert x["gflops"] == pytest.approx(per_image * x["global_batch"]
                                            / x["sec_per_step"]["median"] / 1e9)
    (w,) = r["weak_scaling"]
    assert (w["num_devices"], w["batch"], w["one_device_batch"]) == (2, 6, 3)
    assert w["ratio"] == two["sec_per_image"] / one["sec_per_image"]
    assert "weak scaling" in text and f"ratio {w['ratio']:.3f}" in text
    with pytest.raises(ValueError, match="weak-scaling is for --model resnet18"):
        bench.bench_train(devices=[1], batch_size=4, synthetic=8, weak_scaling=True)
    with pytest.raises(ValueError, match="fewer than one batch of 12"):
        bench.bench_train_resnet18(devices=[1, 2], batch_size=6, synthetic=8, weak_scaling=True)


def test_train_resnet18_against_torch_eager(monkeypatch):
    peers.torch_python()  # the bench finds the same interpreter; skips without a supported one
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = bench.bench_train_resnet18(devices=[1], batch_size=4, epochs=1, limit_batches=1,
                                   warmup=1, synthetic=12, compare="torch", parts=["fused"],
                                   torch_variants=("resnet18",))
    _check_resnet_result(r, [("mgpu fused", 1), ("torch eager", 1)])
    (c,) = r["comparisons"]
    mine, theirs = r["results"]
    assert c["time_ratio"] == theirs["sec_per_step"]["median"] / mine["sec_per_step"]["median"]
    assert c["memory_ratio"] == mine["peak_rss_bytes"] / theirs["peak_rss_bytes"]
    # The same init (normal_(std=0.01), other draws) and the same batches: both near ln(10).
    assert abs(mine["train_loss"][0] - theirs["train_loss"][0]) < 0.2


def test_conv_times_each_algorithm_at_resnet18_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_CONV_ALGO", "im2col")
    code, text, r = _run(["bench", "conv", "--batch", "1", "--rounds", "2", "--repeat", "1",
                          "--warmup", "0", "--algos", "direct,winograd"], tmp_path, "conv")
    assert code == 0
    _check_machine(r)
    assert [(x["C"], x["H"], x["algo"]) for x in r["layers"]] == [
        (c, h, a) for c, h in ((64, 28), (128, 14), (256, 7), (512, 4))
        for a in ("direct", "winograd")]
    for x in r["layers"]:
        for phase in ("forward", "backward"):
            _check_stats(x[phase])
            assert x[phase]["n"] == 2
        flops = 2 * x["C"] * x["C"] * 9 * x["H"] * x["H"]
        assert x["gflops_forward"] == pytest.approx(flops / x["forward"]["median"] / 1e9)
    assert "512ch 4x4" in text
    assert os.environ["MGPU_CONV_ALGO"] == "im2col"  # the bench puts the caller's value back


def _isas():
    return ["avx2"] + (["avx512"] if mgpu.build_info().get("cpu_isa") == "avx512" else [])


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_fma_loop_does_the_flops_it_counts(isa):
    """Every lane starts at 0 and takes `iters` FMAs acc = acc * a + b: with a = b = 1 each lane
    ends at iters, so the lanes' sum counts the FMAs that ran (12 accumulators of 8 or 16
    lanes); with a = 1/2 each lane ends at 2 (1 - 2^-iters)."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    lanes = 12 * (16 if isa == "avx512" else 8)
    for iters in (0, 1, 1000, 4097):
        total, flops = mgpu._core.fma_loop(isa, iters, 1.0, 1.0)
        assert total == lanes * iters
        assert flops == 2 * lanes * iters
    total, _ = mgpu._core.fma_loop(isa, 3, 0.5, 1.0)
    assert total == pytest.approx(lanes * 2 * (1 - 0.5 ** 3))
    p = mgpu._core.fma_peak(isa, 2, 0.01, 2)
    assert p["isa"] == isa and p["threads"] == 2 and p["iters"] >= 1
    assert p["flops"] == 2 * lanes * p["iters"] * 2
    assert p["gflops"] == pytest.approx(p["flops"] / p["seconds"] / 1e9)
    # Plausible for a CPU core: above 1 GFLOP/s, below 1000 GFLOP/s per thread.
    assert 1 < p["gflops"] < 2000


def test_fma_peak_rejects_bad_arguments():
    with pytest.raises(ValueError, match="isa"):
        mgpu._core.fma_peak("sse", 1, 0.01, 1)
    with pytest.raises(ValueError, match="threads"):
        mgpu._core.fma_peak("avx2", 0, 0.01, 1)
    with pytest.raises(ValueError, match="iters"):
        mgpu._core.fma_loop("avx2", -1)
    if "avx512" not in _isas():
        with pytest.raises(ValueError, match="AVX-512"):
            mgpu._core.fma_loop("avx512", 1)


def _check_layers(r, forward_per_image, n, first_backward_is_dw_only=True):
    rows = r["layers"]
    total = rows[-1]
    assert total["layer"] == "total"
    mult = [x for x in rows[:-1] if "forward_flops" in x]
    assert [x["forward_flops"] for x in mult] == [n * f for f in forward_per_image]
    back = [2 * n * f for f in forward_per_image]
    if first_backward_is_dw_only:
        back[0] //= 2
    assert [x["backward_flops"] for x in mult] == back
    peak = r["peak"]["gflops"]
    assert peak > 0 and any(p["gflops"] == peak for p in r["peaks"])
    for x in rows:
        assert x["forward_s"] > 0 and x["backward_s"] >= 0
        for d in ("forward", "backward"):
            if d + "_gflops" in x:
                assert x[d + "_gflops"] == pytest.approx(x[d + "_flops"] / x[d + "_s"] / 1e9)
                assert x[d + "_percent_of_peak"] == pytest.approx(100 * x[d + "_gflops"] / peak)
    assert total["forward_flops"] == n * sum(forward_per_image)
    assert total["forward_s"] == pytest.approx(sum(x["forward_s"] for x in rows[:-1]))


def test_train_layers_resnet18_counts_each_layer_s_flops(tmp_path, monkeypatch):
    """--parts layers: each conv and linear layer's GFLOP from an independent count
    (2 N K C R S P Q forward, the stride-2 layers at half the side), its time from the step's
    timeline, GFLOP/s and % of the measured FMA peak derived from them."""
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    code, text, r = _run(["bench", "train", "--model", "resnet18", "--parts", "layers",
                          "--batch-size", "2", "--limit-batches", "1", "--warmup", "1"],
                         tmp_path, "layers")
    assert code == 0
    per_image = _resnet18_forward_flops_per_image()
    assert len([x for x in r["layers"] if "forward_flops" in x]) - 1 == len(per_image) == 21
    _check_layers(r, per_image, 2)
    assert "FMA peak measured here" in text and "Winograd" in text and "fwd %peak" in text
    assert "resnet_block2.0.conv3" in text


def test_train_layers_lenet(tmp_path):
    code, text, r = _run(["bench", "train", "--model", "lenet", "--parts", "layers",
                          "--batch-size", "8", "--limit-batches", "2"], tmp_path, "layers")
    assert code == 0
    # The chapter's LeNet: conv 20x1x3x3 to 26x26, pool to 13x13, conv 50x20x5x5 to 9x9, pool
    # to 4x4, 800 -> 128 -> 10.
    per_image = [2 * 20 * 1 * 9 * 26 * 26, 2 * 50 * 20 * 25 * 9 * 9, 2 * 800 * 128, 2 * 128 * 10]
    _check_layers(r, per_image, 8)


def test_conv_runs_the_onednn_peer_in_every_round(tmp_path):
    # A stand-in for onednn_conv_bench: records its arguments and OpenMP threads, answers times
    # that depend on the layer so the rows can be checked.
    calls = tmp_path / "calls.txt"
    peer = tmp_path / "fake_onednn"
    peer.write_text("#!/bin/sh\n"
                    f"echo \"$* $OMP_NUM_THREADS\" >> {calls}\n"
                    "echo '{\"forward_ms\": ['$2'.0], \"backward_ms\": ['$2'.0, '$3'.0], "
                    "\"impl\": \"fake:impl\", \"version\": \"9.9.9\"}'\n")
    peer.chmod(0o755)
    code, text, r = _run(["bench", "conv", "--batch", "1", "--rounds", "2", "--repeat", "1",
                          "--warmup", "0", "--algos", "direct", "--onednn", str(peer)],
                         tmp_path, "conv")
    assert code == 0
    rows = [x for x in r["layers"] if x["algo"] == "onednn"]
    assert [(x["C"], x["H"]) for x in rows] == [(64, 28), (128, 14), (256, 7), (512, 4)]
    for x in rows:
        assert x["forward"]["n"] == 2 and x["backward"]["n"] == 4
        assert x["forward"]["median"] == pytest.approx(x["C"] / 1e3)
        assert x["backward"]["median"] == pytest.approx((x["C"] + x["H"]) / 2e3)
    threads = str(mgpu._core.num_threads())
    assert calls.read_text().split("\n")[:3] == ["1 64 28 1 1 " + threads] * 2 + [
        "1 128 14 1 1 " + threads]
    assert "fake:impl" in text and "onednn" in text
    with pytest.raises(ValueError, match="peers.sh onednn"):
        bench.bench_conv(batch=1, onednn=str(tmp_path / "nope"))


def test_conv_times_resnet18_stride2_layers(tmp_path):
    """--layers stride2: ResNet-18's stride-2 3x3 and 1x1 convs, each with its own K, kernel,
    stride and padding, and GFLOP/s from that shape's 2 N K C R S P Q."""
    code, text, r = _run(["bench", "conv", "--batch", "1", "--rounds", "1", "--repeat", "1",
                          "--warmup", "0", "--algos", "direct", "--layers", "stride2"],
                         tmp_path, "conv")
    assert code == 0
    assert [(x["C"], x["H"], x["K"], x["R"], x["stride"], x["pad"]) for x in r["layers"]] == [
        (64, 28, 128, 3, 2, 1), (128, 14, 256, 3, 2, 1), (256, 7, 512, 3, 2, 1),
        (64, 28, 128, 1, 2, 0), (128, 14, 256, 1, 2, 0), (256, 7, 512, 1, 2, 0)]
    for x in r["layers"]:
        P = (x["H"] + 2 * x["pad"] - x["R"]) // 2 + 1
        flops = 2 * x["K"] * x["C"] * x["R"] ** 2 * P * P
        assert x["gflops_forward"] == pytest.approx(flops / x["forward"]["median"] / 1e9)
        assert x["gflops_backward"] == pytest.approx(2 * flops / x["backward"]["median"] / 1e9)
    assert "256->512 1x1 s2 7x7" in text
    with pytest.raises(ValueError, match="stride2"):
        bench.bench_conv(batch=1, layers="stride4")


def test_conv_times_lenet_layers_under_the_rule_in_both_precisions(tmp_path):
    """--layers lenet with --algos auto,bf16-auto: LeNet's two convs (pad 0, stride 1) under the
    per-shape rule in float32 and bf16, GFLOP/s from each shape's 2 N K C R S P Q."""
    before = os.environ.get("MGPU_CONV_ALGO")
    code, text, r = _run(["bench", "conv", "--batch", "2", "--rounds", "1", "--repeat", "1",
                          "--warmup", "0", "--algos", "auto,bf16-auto", "--layers", "lenet"],
                         tmp_path, "conv")
    assert code == 0
    assert [(x["C"], x["H"], x["K"], x["R"], x["stride"], x["pad"], x["algo"])
            for x in r["layers"]] == [
        (c, h, k, rr, 1, 0, a) for c, h, k, rr in ((1, 28, 20, 3), (20, 13, 50, 5))
        for a in ("auto", "bf16-auto")]
    for x in r["layers"]:
        P = x["H"] - x["R"] + 1
        flops = 2 * 2 * x["K"] * x["C"] * x["R"] ** 2 * P * P
        assert x["gflops_forward"] == pytest.approx(flops / x["forward"]["median"] / 1e9)
    assert "20->50 5x5 s1 13x13" in text
    assert os.environ.get("MGPU_CONV_ALGO") == before  # the caller's value is put back


def _isa_round(scale, step):
    """One round of one path for bench isa's summary: conv2 and relu1 at ``scale`` times the
    base times (seconds), the fused steps at ``step``."""
    ops = {"conv2 (50, 20, 5, 5)": {"forward": 2e-3 * scale, "backward": 4e-3 * scale,
                                    "gflops_forward": 100.0 / scale,
                                    "gflops_backward": 100.0 / scale},
           "relu1": {"forward": 1e-4 * scale, "backward": 2e-4 * scale,
                     "gflops_forward": None, "gflops_backward": None}}
    return {"ops": ops, "ops_step": step / 2, "train_step": step, "full_batches": 234}


def test_isa_summary_takes_ratios_of_round_medians_against_the_peaks_target():
    v3 = {"avx2": [_isa_round(1.1, 0.030), _isa_round(1.5, 0.050), _isa_round(1.3, 0.040)],
          "avx512": [_isa_round(1.0, 0.020), _isa_round(0.8, 0.024), _isa_round(2.0, 0.060)]}
    same = bench.isa.summarize_isa({"x86-64-v3": v3}, {"avx2": 90.0, "avx512": 93.0})
    assert same["target"] == 1.25 and same["peak_ratio"] == pytest.approx(93 / 90)
    a, b = same["paths"]["x86-64-v3"]["avx2"], same["paths"]["x86-64-v3"]["avx512"]
    conv2 = "conv2 (50, 20, 5, 5)"
    assert a["ops"][conv2]["forward"]["median"] == pytest.approx(2.6e-3)
    assert b["ops"][conv2]["forward"]["median"] == pytest.approx(2.0e-3)
    assert a["ops"][conv2]["forward"]["times"] == pytest.approx([2.2e-3, 3.0e-3, 2.6e-3])
    assert a["ops"][conv2]["gflops_forward"] == pytest.approx(100 / 1.3)
    assert a["ops"]["relu1"]["gflops_backward"] is None
    assert a["train_step"]["median"] == 0.040 and b["train_step"]["median"] == 0.024
    assert a["sec_per_epoch"] == pytest.approx(0.040 * 234)
    by = {x["what"]: x for x in same["ratios"]["x86-64-v3"]}
    assert len(by) == 2 * 2 + 2
    assert by["conv2 forward"]["ratio"] == pytest.approx(1.3)
    assert by["relu1 backward"]["ratio"] == pytest.approx(1.3)
    assert by["fused step (training batch)"]["ratio"] == pytest.approx(0.040 / 0.024)
    assert by["fused step (ops' batch)"]["ratio"] == pytest.approx(0.040 / 0.024)
    assert [x["within_target"] for x in same["ratios"]["x86-64-v3"]] == [False] * 6
    assert "build_ratios" not in same and "portable_native" not in same
    double = bench.isa.summarize_isa({"x86-64-v3": v3}, {"avx2": 90.0, "avx512": 180.0})
    assert double["target"] == 2.0
    assert all(x["within_target"] for x in double["ratios"]["x86-64-v3"])
    assert bench.isa_target(1.49) == 1.25 and bench.isa_target(1.5) == 2.0
    assert "ratios" not in bench.isa.summarize_isa({"x86-64-v3": {"avx2": v3["avx2"]}},
                                                   {"avx2": 90.0})

    # A native build beside the portable one: its time / the first build's, and portable /
    # native against 5 %.
    native = {"avx2": [_isa_round(1.0, 0.030), _isa_round(1.2, 0.036), _isa_round(1.25, 0.050)],
              "avx512": [_isa_round(1.0, 0.020), _isa_round(0.99, 0.024), _isa_round(2, 0.06)]}
    two = bench.isa.summarize_isa({"x86-64-v3": v3, "native": native},
                                  {"avx2": 90.0, "avx512": 93.0})
    nb = {x["what"]: x["ratio"] for x in two["build_ratios"]["native"]["avx2"]}
    assert nb["conv2 forward"] == pytest.approx(1.2 / 1.3)
    assert nb["fused step (training batch)"] == pytest.approx(0.036 / 0.040)
    pn = two["portable_native"]
    assert (pn["portable"], pn["native"], pn["target"]) == ("x86-64-v3", "native", 1.05)
    p2 = {x["what"]: x for x in pn["ratios"]["avx2"]}
    assert p2["conv2 forward"]["ratio"] == pytest.approx(1.3 / 1.2)
    assert not p2["conv2 forward"]["within_target"]
    p5 = {x["what"]: x for x in pn["ratios"]["avx512"]}
    assert p5["conv2 forward"]["ratio"] == pytest.approx(1.0)
    assert p5["conv2 forward"]["within_target"]

    r = bench.common.header("isa", dict(isas=["avx2", "avx512"], rounds=3, ops_batch=128,
                                        batch_size=256, builds=["x86-64-v3"]))
    r.update(same, peaks={"avx2": 90.0, "avx512": 93.0})
    text = bench.format_result(r)
    assert "within 1.25x" in text and "conv2 forward 1.30x" in text
    assert "6 over it" in text and "fused step 1.67x" in text
    r.update(double)
    assert "every one within the target" in bench.format_result(r)
    r["settings"]["builds"] = ["x86-64-v3", "native"]
    r.update(two)
    text = bench.format_result(r)
    assert "native / x86-64-v3, avx2: conv2 forward 0.92x" in text
    assert "portable (x86-64-v3) / native (native) (target: within 1.05x)" in text


def _run_isa(tmp_path, name, *extra):
    return _run(["bench", "isa", "--rounds", "1", "--synthetic", "300", "--limit-batches", "2",
                 "--warmup", "0", "--repeat", "1", "--ops-batch", "4", "--batch-size", "32",
                 *extra], tmp_path, name)


def test_isa_times_every_path_this_cpu_runs(tmp_path):
    code, text, r = _run_isa(tmp_path, "isa")
    assert code == 0
    _check_machine(r)
    paths = bench.layers.cpu_paths()
    label = mgpu._core.build_info()["cpu_baseline"].split(" ")[0]
    assert list(r["paths"]) == [label] == r["settings"]["builds"]
    assert list(r["paths"][label]) == paths == list(r["raw"][label]) == list(r["peaks"])
    for isa in paths:
        p, (raw,) = r["paths"][label][isa], r["raw"][label][isa]
        assert [k.split(" (")[0] for k in p["ops"]] == [
            "conv1", "relu1", "avg_pool1", "conv2", "relu2", "avg_pool2", "fc1 mm", "fc1 bias",
            "relu3", "fc2 mm", "fc2 bias", "softmax_ce"]
        for name, op in p["ops"].items():
            for phase in ("forward", "backward"):
                assert op[phase]["median"] == raw["ops"][name][phase] > 0
        assert p["train_step"]["median"] == raw["train_step"] > 0
        assert raw["full_batches"] == -(-300 // 32)  # the last, partial batch counts
        assert p["sec_per_epoch"] == pytest.approx(raw["train_step"] * 10)
        assert r["peaks"][isa] > 0
    if len(paths) == 2:
        a, b = r["paths"][label]["avx2"], r["paths"][label]["avx512"]
        by = {x["what"]: x["ratio"] for x in r["ratios"][label]}
        assert by["fused step (training batch)"] == (a["train_step"]["median"]
                                                     / b["train_step"]["median"])
        assert "avx2 / avx512 (target" in text
    else:
        assert "avx2 / avx512: not measured" in text


def test_isa_times_another_build_round_by_round(tmp_path, capsys, monkeypatch):
    """--builds: an interpreter that imports this same build (a wrapper that sets its path) is
    timed as a second build, and its ratios are its medians over the first build's. It is given
    relative to the working directory, which the children (run elsewhere) do not share."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__)))
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "other-python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH='{root}' exec '{sys.executable}' \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    code, text, r = _run_isa(tmp_path, "builds", "--isas", "avx2", "--builds",
                             os.path.join("bin", "other-python"))
    assert code == 0
    first, second = r["settings"]["builds"]
    assert second == first + "#2" and r["builds"][1]["python"] == str(wrapper)
    a, b = r["paths"][second]["avx2"], r["paths"][first]["avx2"]
    by = {x["what"]: x["ratio"] for x in r["build_ratios"][second]["avx2"]}
    assert by["fused step (training batch)"] == (a["train_step"]["median"]
                                                 / b["train_step"]["median"])
    assert f"{second} / {first}, avx2: conv2 forward" in text

    broken = tmp_path / "no-mgpu-python"
    broken.write_text("#!/bin/sh\necho 'No module named mgpu' >&2\nexit 1\n")
    broken.chmod(0o755)
    capsys.readouterr()
    assert cli.main(["bench", "isa", "--synthetic", "300", "--builds", str(broken)]) == 2
    assert f"--builds {broken} cannot import mgpu" in capsys.readouterr().err
    assert cli.main(["bench", "isa", "--synthetic", "300", "--builds",
                     str(tmp_path / "missing")]) == 2
    assert "cannot run it" in capsys.readouterr().err


def test_a_rival_interpreter_given_relative_to_the_working_directory_is_found(tmp_path,
                                                                                 monkeypatch):
    """--torch-python bin/python names a file in the working directory; the probe runs in
    another one, so the path is made absolute first (stand-ins that print a version). The same
    relative path from another directory names another file, and is probed again."""
    for name, version in (("a", "2.15.0"), ("b", "2.16.0")):
        (tmp_path / name / "bin").mkdir(parents=True)
        fake = tmp_path / name / "bin" / "torch-python"
        fake.write_text(f"#!/bin/sh\necho {version}\n")
        fake.chmod(0o755)
        monkeypatch.chdir(tmp_path / name)
        assert bench.rivals.find_torch_python(os.path.join("bin", "torch-python")) == (
            str(fake), version)


def test_isa_refuses_paths_the_cpu_cannot_run(capsys):
    assert cli.main(["bench", "isa", "--isas", "sse4", "--synthetic", "300"]) == 2
    assert "'sse4' is not a kernel path" in capsys.readouterr().err
    assert cli.main(["bench", "isa", "--rounds", "0", "--synthetic", "300"]) == 2
    assert "rounds must be >= 1" in capsys.readouterr().err
    if "avx512" not in bench.layers.cpu_paths():
        assert cli.main(["bench", "isa", "--isas", "avx512", "--synthetic", "300"]) == 2
        assert "cannot run the avx512 path" in capsys.readouterr().err


def test_isa_compare_torch_runs_its_default_and_avx2_kernels(tmp_path, monkeypatch):
    py = peers.torch_python()
    # A capability set outside is dropped for PyTorch's own choice and replaced for the AVX2 run.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    code, text, r = _run_isa(tmp_path, "isa_torch", "--isas", "avx2", "--compare", "torch")
    assert code == 0
    t = r["torch"]
    assert t["python"] == py and t["capability"]["avx2"] == "AVX2"
    assert t["capability"]["default"] != "DEFAULT"
    for kind in ("default", "avx2"):
        assert t["step"][kind]["median"] > 0
        assert r["torch_ratios"][f"torch {kind} / mgpu avx2"] == (
            t["step"][kind]["median"] / r["paths"][r["settings"]["builds"][0]]["avx2"]
            ["train_step"]["median"])
    assert "ATEN_CPU_CAPABILITY=avx2 (AVX2)" in text
    ratio = r["torch_ratios"]["torch avx2 / mgpu avx2"]
    assert r["torch_target"] == {"what": "torch avx2 / mgpu avx2", "ratio": ratio,
                                 "ahead": ratio > 1}
    assert f"ahead of PyTorch's with its AVX2 kernels: {ratio:.2f}x, " in text


def test_isa_torch_target_is_mgpu_ahead_of_pytorch_avx2():
    """PyTorch ms / mgpu ms above 1 meets the target; 1 itself (a tie) and below do not."""
    assert bench.isa.torch_target(1.86) == {"what": "torch avx2 / mgpu avx2", "ratio": 1.86,
                                            "ahead": True}
    assert not bench.isa.torch_target(1.0)["ahead"]
    assert not bench.isa.torch_target(0.8)["ahead"]
