"""``bench train --model resnet18 --precision float32,bf16``: each mgpu side once per precision
(the fused step's ``precision``), and with ``--compare torch`` PyTorch's eager step under
``torch.autocast("cpu", torch.bfloat16)`` beside its float32 one. Checks what each row is and
that the sides train alike on the same batches; the times are not checked (nothing is timed)."""
import pytest

import peers
from mgpu import bench
from test_bench import _check_resnet_result


def test_train_resnet18_bf16_sides_and_pytorch_autocast(monkeypatch):
    peers.torch_python()  # the bench finds the same interpreter; skips without a supported one
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = bench.bench_train_resnet18(devices=[1], batch_size=4, epochs=1, limit_batches=1,
                                   warmup=1, synthetic=12, compare="torch", parts=["fused"],
                                   torch_variants=("resnet18",),
                                   precisions=["float32", "bf16"])
    _check_resnet_result(r, [("mgpu fused", 1), ("mgpu fused bf16", 1), ("torch eager", 1),
                             ("torch eager bf16", 1)])
    assert r["settings"]["precisions"] == ["float32", "bf16"]
    loss = {x["impl"]: x["train_loss"][0] for x in r["results"]}
    # The same init and batches (batch norm over 4 images after a warm-up step: the sides drift
    # apart by several percent): bf16's loss near float32's but not equal, PyTorch's finite.
    assert abs(loss["mgpu fused bf16"] - loss["mgpu fused"]) < 0.3
    assert loss["mgpu fused bf16"] != loss["mgpu fused"]
    assert 0 < loss["torch eager bf16"] < 10
    names = {x["impl"]: x["name"] for x in r["results"]}
    assert names["mgpu fused bf16"].endswith(", bf16")
    assert "autocast bf16" in names["torch eager bf16"]


def test_bf16_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be 'float32' or 'bf16'"):
        bench.bench_train_resnet18(devices=[1], batch_size=4, synthetic=8, precisions=["fp16"])
    with pytest.raises(ValueError, match="precision must be 'float32' or 'bf16'"):
        bench.bench_train(devices=[1], batch_size=4, synthetic=8, precisions=["fp16"])
    with pytest.raises(ValueError, match="float32 and/or bf16 once each"):
        bench.bench_train(devices=[1], batch_size=4, synthetic=8, precisions=["bf16", "bf16"])


def test_train_lenet_fused_part_once_per_precision(monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    r = bench.bench_train(devices=[1, 2], batch_size=8, epochs=1, limit_batches=2, warmup=1,
                          synthetic=32, parts=["fused"], precisions=["float32", "bf16"])
    rows = {(x["impl"], x["num_devices"]): x for x in r["results"]}
    assert sorted(rows) == [("mgpu fused", 1), ("mgpu fused", 2), ("mgpu fused bf16", 1),
                            ("mgpu fused bf16", 2)]
    assert r["settings"]["precisions"] == ["float32", "bf16"]
    for k in (1, 2):
        bf, f32 = rows[("mgpu fused bf16", k)], rows[("mgpu fused", k)]
        assert bf["precision"] == "bf16" and bf["name"].startswith("mgpu train_batch (fused, bf16)")
        # The same init and batches: bf16's loss near float32's, not equal.
        assert abs(bf["train_loss"][0] - f32["train_loss"][0]) < 0.05
        assert bf["train_loss"][0] != f32["train_loss"][0]
