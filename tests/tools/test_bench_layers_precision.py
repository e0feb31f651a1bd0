"""bench train --parts layers with --precision: the traced step's precision reaches the runner,
and what it cannot run is refused before anything is timed."""
import pytest

from mgpu.advisor.steps import random_batch, runner
from mgpu.bench.train import bench_train
from mgpu.device import cpu


def test_layers_take_one_precision():
    with pytest.raises(ValueError, match="--parts layers takes one --precision"):
        bench_train(parts=["layers"], model="resnet18", precisions=["float32", "bf16"])


def test_layers_check_the_precision_name():
    with pytest.raises(ValueError, match="must be 'float32' or 'bf16'"):
        bench_train(parts=["layers"], model="resnet18", precisions=["half"])


def test_lenet_runner_takes_the_precision(monkeypatch):
    import mgpu.parallel
    seen = []
    real = mgpu.parallel.train_batch

    def recording(*args, **kw):
        seen.append(kw.get("precision"))
        return real(*args, **kw)
    monkeypatch.setattr(mgpu.parallel, "train_batch", recording)
    X, y = random_batch(4)
    runner("lenet", [cpu(0)], precision="bf16")(X, y)
    assert seen == ["bf16"]
    with pytest.raises(ValueError, match="precision must be 'float32' or 'bf16'"):
        runner("lenet", [cpu(0)], precision="half")(X, y)
