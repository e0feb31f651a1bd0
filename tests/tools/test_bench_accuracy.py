"""``mgpu bench accuracy`` (mgpu.bench.accuracy): test accuracy per seed and precision, and its
summary. Tiny runs on the bench's synthetic task (which of 10 bands is bright), where the
numbers are checked for what they must be: the summary from the rows, the run order, resumed
runs equal to uninterrupted ones, ResNet-18's recomputed batch-norm statistics learning the task
where its running statistics (momentum 0.1, a few steps) do not yet."""
import json
import statistics

import pytest

from mgpu import bench, cli
from mgpu.bench.accuracy import summarize_accuracy


def _lenet(**kw):
    args = dict(model="lenet", synthetic=128, batch_size=64, epochs=1, seeds=[0, 1],
                precisions=["float32", "bf16"])
    args.update(kw)
    return bench.bench_accuracy(**args)


def test_rows_in_order_and_the_summary_from_them(monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = _lenet()
    assert r["benchmark"] == "accuracy"
    assert [(x["seed"], x["precision"]) for x in r["results"]] == [
        (0, "float32"), (0, "bf16"), (1, "float32"), (1, "bf16")]
    for x in r["results"]:
        assert 0.0 <= x["test_acc"] <= 1.0 and x["test_acc_recomputed"] is None
        assert x["epoch_acc"] == [x["test_acc"]]  # one epoch: its accuracy is the last
        assert x["seconds"] > 0
    s = r["summary"]
    for p in ("float32", "bf16"):
        vals = [x["test_acc"] for x in r["results"] if x["precision"] == p]
        assert s[p]["test_acc"] == dict(mean=statistics.fmean(vals), min=min(vals),
                                        max=max(vals), seeds=2)
        assert "test_acc_recomputed" not in s[p]
    assert s["bf16_minus_float32_points"] == {
        "test_acc": pytest.approx(100 * (s["bf16"]["test_acc"]["mean"]
                                         - s["float32"]["test_acc"]["mean"]), abs=0)}
    table = bench.format_result(r)
    assert "mean bf16" in table and "bf16 - float32 (points): test acc" in table
    assert table.count("\n   1  ") == 2, table


def test_the_summary_of_known_rows():
    rows = [dict(seed=0, precision="float32", test_acc=0.80, test_acc_recomputed=0.85),
            dict(seed=0, precision="bf16", test_acc=0.83, test_acc_recomputed=0.84),
            dict(seed=1, precision="float32", test_acc=0.84, test_acc_recomputed=0.87),
            dict(seed=1, precision="bf16", test_acc=0.79, test_acc_recomputed=0.86)]
    s = summarize_accuracy(rows, ["float32", "bf16"])
    assert s["float32"]["test_acc"] == dict(mean=pytest.approx(0.82), min=0.80, max=0.84,
                                            seeds=2)
    assert s["bf16"]["test_acc_recomputed"] == dict(mean=pytest.approx(0.85), min=0.84, max=0.86,
                                                    seeds=2)
    assert s["bf16_minus_float32_points"] == {"test_acc": pytest.approx(-1.0),
                                              "test_acc_recomputed": pytest.approx(-1.0)}
    assert "bf16_minus_float32_points" not in summarize_accuracy(rows[:1], ["float32"])


def test_a_resumed_sweep_reports_the_uninterrupted_one(monkeypatch, tmp_path):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    first = _lenet(epochs=2, seeds=[3], checkpoint=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-bf16-3", "ckpt-float32-3"]
    written = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*")}
    assert len(written) == 4  # each run's two epoch ends
    again = _lenet(epochs=2, seeds=[3], checkpoint=str(tmp_path))
    # The runs resumed at their ends: nothing trained, nothing rewritten.
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*")} == written
    plain = _lenet(epochs=2, seeds=[3])
    for a, b, c in zip(first["results"], again["results"], plain["results"]):
        assert a["test_acc"] == b["test_acc"] == c["test_acc"]
        assert len(a["epoch_acc"]) == 2 and a["epoch_acc"][-1] == a["test_acc"]
        assert a["epoch_acc"] == b["epoch_acc"] == c["epoch_acc"]  # kept by the checkpoints


def test_resnet18_recomputed_statistics_learn_the_task(monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = bench.bench_accuracy(model="resnet18", synthetic=256, batch_size=32, epochs=2, seeds=[0],
                             precisions=["bf16"], recompute_batches=4)
    (x,) = r["results"]
    # Chance is 0.1. Sixteen steps learn the bands (seeds 0 and 1 gave 1.0 and 0.88); the running
    # statistics, 16 momentum-0.1 steps from (0, 1), are still far from the batches', which the
    # recomputed ones are (0.09 and 0.05 against them).
    assert x["test_acc_recomputed"] > 0.5, x
    assert x["test_acc_recomputed"] > x["test_acc"] + 0.2, x
    assert r["summary"]["bf16"]["test_acc_recomputed"]["mean"] == x["test_acc_recomputed"]
    assert "bf16_minus_float32_points" not in r["summary"]


def test_limit_batches_shortens_the_recomputed_evaluation_too(monkeypatch):
    """Fashion-MNIST's loader, replaced by one that records how it is asked: the training's
    and the recomputed statistics' evaluation both take --limit-batches."""
    import numpy as np

    import mgpu.chapter
    import mgpu.data
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    asked = []

    def loader(batch_size, **kw):
        asked.append(kw.get("limit_batches"))
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (128, 28, 28), dtype=np.uint8)
        data = mgpu.data.array_loader(images, rng.integers(0, 10, 128, dtype=np.uint8),
                                      batch_size)
        return data, data
    monkeypatch.setattr(mgpu.data, "load_data_fashion_mnist", loader)
    monkeypatch.setattr(mgpu.chapter, "load_data_fashion_mnist", loader)
    r = bench.bench_accuracy(model="resnet18", batch_size=32, epochs=1, seeds=[0],
                             precisions=["float32"], recompute_batches=1, limit_batches=2)
    assert asked == [2, 2]
    assert r["results"][0]["test_acc_recomputed"] is not None


def test_the_command_line_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    path = tmp_path / "acc.json"
    assert cli.main(["bench", "accuracy", "--model", "lenet", "--synthetic", "128",
                     "--batch-size", "64", "--epochs", "1", "--seeds", "5", "--precision",
                     "float32", "--quiet", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "mgpu bench accuracy: lenet, 1 epoch(s), batch 64" in out
    assert "test acc:" not in out  # the training's own lines are not the table's
    r = json.loads(path.read_text())
    assert r["settings"]["seeds"] == [5] and r["settings"]["lr"] == 0.2
    assert [x["precision"] for x in r["results"]] == ["float32"]


@pytest.mark.parametrize("kw,match", [
    (dict(model="vgg"), "model must be one of resnet18, lenet"),
    (dict(precisions=["fp16"]), "precision must be 'float32' or 'bf16'"),
    (dict(precisions=["bf16", "bf16"]), "float32 and/or bf16 once each"),
    (dict(seeds=[1, 1]), "seeds must be distinct"),
    (dict(seeds=[]), "seeds must be distinct"),
    (dict(epochs=0), "epochs must be >= 1"),
    (dict(synthetic=10), "less than one batch of 64"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _lenet(**kw)
