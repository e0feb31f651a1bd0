"""notebooks/benchmarks.ipynb draws the JSON that `mgpu bench ... --json` and `mgpu advise
--validate --json` write. Executed like the chapters' notebooks (test_notebooks.py) on a folder
made here (MGPU_NB_BENCH): tiny real runs of bench train (synthetic data, one batch), bench
allreduce, bench isa and bench accuracy for their JSON's shape, plus two rows made here whose
expected printouts are known: a peer at 2.5x mgpu's fused step, and advisor predictions with
known errors. The timings are not checked, only that the notebook reads and draws what the files
hold."""
import copy
import pathlib

import pytest

from mgpu import bench, cli
from test_notebooks import _cell, _stdout, run_notebook

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent.parent / "notebooks" / "benchmarks.ipynb"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    train = bench.bench_train(devices=[1, 2], batch_size=16, epochs=1, limit_batches=1, warmup=0,
                              synthetic=64, parts=["fused"], repeat=1)
    peer = copy.deepcopy(next(x for x in train["results"]
                              if x["impl"] == "mgpu fused" and x["num_devices"] == 1))
    peer["impl"] = "torch chapter"
    peer["sec_per_step"]["median"] *= 2.5
    train["results"].append(peer)
    bench.save(train, str(d / "lenet.json"))
    bench.save(bench.bench_allreduce(devices=[2], sizes=[1024, 4096], warmup=0, repeat=1),
               str(d / "allreduce.json"))
    assert cli.main(["bench", "isa", "--rounds", "1", "--synthetic", "300", "--limit-batches",
                     "2", "--warmup", "0", "--repeat", "1", "--ops-batch", "4", "--batch-size",
                     "32", "--isas", "avx2", "--quiet", "--json", str(d / "isa.json")]) == 0
    assert cli.main(["bench", "accuracy", "--model", "lenet", "--synthetic", "128",
                     "--batch-size", "64", "--epochs", "2", "--seeds", "0,1", "--quiet",
                     "--json", str(d / "accuracy.json")]) == 0
    rows = [{"batch": 64, "devices": 1, "ranks": 1, "step": 0.010, "measured_step": 0.0125,
             "error": 0.010 / 0.0125 - 1},
            {"batch": 64, "devices": 2, "ranks": 1, "step": 0.006, "measured_step": 0.005,
             "error": 0.006 / 0.005 - 1}]
    bench.save({"measurements": {"measured_on": "this test"}, "predictions": rows},
               str(d / "advise.json"))
    return d


@pytest.fixture(scope="module")
def executed(folder, tmp_path_factory):
    return run_notebook(NOTEBOOK, {"MGPU_NB_BENCH": str(folder)}, tmp_path_factory)


def _images(cell):
    return sum(1 for o in cell["outputs"]
               if o.get("output_type") == "display_data" and "image/png" in o.get("data", {}))


def test_every_file_is_read_and_named_with_its_machine(executed):
    out = _stdout(_cell(executed, "load"))
    assert "5 result file(s)" in out, out
    for name, kind in (("accuracy.json", "accuracy"), ("advise.json", "advise"),
                       ("allreduce.json", "allreduce"),
                       ("isa.json", "isa"), ("lenet.json", "train lenet")):
        assert f"  {name:<28} {kind:<16} " in out, out


def test_step_time_by_peer_with_the_ratio_to_mgpu(folder, executed):
    r = bench.load(str(folder / "lenet.json"))
    cell = _cell(executed, "by-peer")
    out = _stdout(cell)
    for x in r["results"]:
        assert f"{x['impl']:<24} {1e3 * x['sec_per_step']['median']:10.1f} ms/step" in out, out
    assert "torch chapter" in out and " 2.50x mgpu fused" in out, out
    assert _images(cell) == 1


def test_step_time_by_device_count_and_the_allreduce(folder, executed):
    r = bench.load(str(folder / "lenet.json"))
    cell = _cell(executed, "by-devices")
    out = _stdout(cell)
    ms = {x["num_devices"]: 1e3 * x["sec_per_step"]["median"] for x in r["results"]
          if x["impl"] == "mgpu fused"}
    assert f"mgpu fused: 1 device(s) {ms[1]:.1f} ms, 2 device(s) {ms[2]:.1f} ms" in out, out
    a = bench.load(str(folder / "allreduce.json"))
    best = max(x["busbw"] for x in a["results"]) / 1e9
    assert f"all-reduce over 2 devices: busbw up to {best:.2f} GB/s" in out, out
    assert _images(cell) == 2


def test_the_kernel_paths(folder, executed):
    r = bench.load(str(folder / "isa.json"))
    cell = _cell(executed, "by-isa")
    out = _stdout(cell)
    (build,) = r["paths"]
    t = 1e3 * r["paths"][build]["avx2"]["train_step"]["median"]
    assert f"{'mgpu ' + build.split()[0] + ' avx2':<36} {t:8.2f} ms" in out, out
    assert _images(cell) == 1


def test_the_advisors_predictions_against_measurement(executed):
    cell = _cell(executed, "advisor")
    out = _stdout(cell)
    assert "batch 64, 1 device(s) x 1 rank(s): predicted 10.00 ms, measured 12.50 ms, error " \
           "-20.0 %" in out, out
    assert "2 device(s) x 1 rank(s): predicted 6.00 ms, measured 5.00 ms, error +20.0 %" in out
    assert _images(cell) == 1


def test_accuracy_by_precision(folder, executed):
    r = bench.load(str(folder / "accuracy.json"))
    cell = _cell(executed, "accuracy")
    out = _stdout(cell)
    assert "accuracy.json: lenet, 2 epoch(s), seeds [0, 1]" in out, out
    for p in ("float32", "bf16"):
        m = r["summary"][p]["test_acc"]
        assert (f"  {p:<8} test acc {100 * m['mean']:.2f} % ({100 * m['min']:.2f} to "
                f"{100 * m['max']:.2f})") in out, out
        # The mean curve over the seeds, epoch by epoch.
        rows = [x["epoch_acc"] for x in r["results"] if x["precision"] == p]
        curve = [100 * (a + b) / 2 for a, b in zip(*rows)]
        assert len(curve) == 2
        assert (f"  {p:<8} mean test acc by epoch: {curve[0]:.2f} {curve[1]:.2f}\n") in out, out
    d = r["summary"]["bf16_minus_float32_points"]["test_acc"]
    assert f"  bf16 - float32: {d:+.2f} points (test acc)" in out, out
    assert "recomputed BN" not in out  # LeNet has no batch norm
    assert _images(cell) == 1
