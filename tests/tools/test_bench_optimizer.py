"""The optimizer in the ResNet-18 benchmarks: ``bench train --model resnet18 --optimizer adamw
--clip-grad-norm X`` trains mgpu's sides with that optimizer (and refuses it for LeNet), and
``mgpu.bench.optimizer_cost`` reads the update phase from a trace and compares configurations."""
import contextlib
import io
import json

import pytest

from mgpu import cli
from mgpu.bench import optimizer_cost


def _run(argv, tmp_path):
    path = tmp_path / "r.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv + ["--quiet", "--json", str(path)])
    return code, out.getvalue(), json.loads(path.read_text()) if path.exists() else None


def test_train_resnet18_with_adamw_and_clipping(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    code, text, r = _run(["bench", "train", "--model", "resnet18", "--synthetic", "8",
                          "--batch-size", "4", "--limit-batches", "2", "--epochs", "1",
                          "--warmup", "1", "--devices", "1", "--lr", "0.001",
                          "--optimizer", "adamw", "--weight-decay", "0.05",
                          "--clip-grad-norm", "0.5"], tmp_path)
    assert code == 0
    s = r["settings"]
    assert (s["optimizer"], s["weight_decay"], s["clip_grad_norm"]) == ("adamw", 0.05, 0.5)
    assert [x["name"].split(", ")[-1] for x in r["results"]] == ["adamw + clip 0.5"] * 2
    assert "mgpu's optimizer: adamw, weight decay 0.05, gradients clipped" in text
    # The same optimizer on both sides: the fused step and the book's loop train alike.
    fused, book = (x["train_loss"] for x in r["results"])
    assert fused == pytest.approx(book, rel=1e-3)


def test_the_optimizer_flags_are_for_resnet18(tmp_path):
    code = cli.main(["bench", "train", "--synthetic", "8", "--optimizer", "adamw", "--quiet"])
    assert code == 2
    with pytest.raises(ValueError, match="need --model resnet18"):
        from mgpu import bench
        bench.bench_train(devices=[1], batch_size=4, synthetic=8, clip_grad_norm=1.0)


def _span(tid, name, ts, dur, cat="task"):
    return {"ph": "X", "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_update_seconds_reads_the_slowest_devices_update_less_its_waits():
    names = [{"ph": "M", "name": "thread_name", "tid": t, "args": {"name": n}}
             for t, n in ((1, "cpu(0)"), (2, "cpu(0) comm"), (3, "cpu(1)"), (4, "cpu(1) comm"))]
    events = names + [
        _span(1, "sgd update", 100, 50, "layer"),            # cpu(0): 50 us on its queue
        _span(2, "sgd update", 200, 400, "layer"),           # and 400 on its comm track,
        _span(2, "wait for peers", 210, 300),                # 300 of them waiting
        _span(2, "wait for peers", 700, 30),                 # (outside the span: not counted)
        _span(3, "sgd update", 100, 120, "layer"),           # cpu(1): 120 us
        _span(3, "layer 0 (conv2d) forward", 0, 999, "layer"),
    ]
    assert optimizer_cost.update_seconds(events) == pytest.approx(150e-6)
    with pytest.raises(RuntimeError, match="no 'sgd update'"):
        optimizer_cost.update_seconds(names)


def test_optimizer_cost_compares_each_configuration_with_the_first(monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = optimizer_cost.bench_optimizer_cost(devices=[2], batch_size=2, rounds=2, steps=1,
                                            warmup=1, configs=["sgd", "adamw+clip"])
    assert [(e["config"], e["num_devices"]) for e in r["results"]] == [("sgd", 2),
                                                                       ("adamw+clip", 2)]
    for e in r["results"]:
        for key in ("wall", "cpu", "update"):
            assert e[key]["n"] == 2 and all(t > 0 for t in e[key]["times"])
        assert e["update"]["median"] < e["wall"]["median"]
    assert r["results"][0]["wall_ratio"] == r["results"][0]["wall_ratio_paired"] == 1.0
    text = optimizer_cost.format_optimizer_cost(r)
    assert "adamw+clip" in text and "update ms" in text
    with pytest.raises(ValueError, match="configs must be some of"):
        optimizer_cost.bench_optimizer_cost(devices=[1], configs=["rmsprop"])
