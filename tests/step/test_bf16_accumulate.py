"""bfloat16 with gradient accumulation: the fused step's ``precision="bf16"`` and
``accumulate=K`` together (each micro-batch's conv and linear products in bf16, the sums of the
micro-batches' gradients in float32), and train_concise passing both to either loop."""
import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close
from mgpu import nn, optim
from mgpu.chapter import accumulated_backward
from test_accumulate import batches, plain_net
from test_deterministic import assert_bitwise

CPUS = [mgpu.cpu(i) for i in range(2)]


def fused_params(make_net, devices, accumulate, precision, deterministic=False, steps=3):
    """`steps` fused SGD steps (momentum, weight decay) on batches of 24, the last of 13."""
    net = make_net()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for Xn, yn in batches(steps, last=13):
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer,
                      deterministic=deterministic, accumulate=accumulate, precision=precision)
    return [p.numpy() for p in net.parameters()]


@pytest.mark.parametrize("devices,accumulate", [(1, 2), (2, 4)])
def test_deterministic_bf16_accumulation_gives_the_bits_of_one_bf16_batch(devices, accumulate):
    """bn_net (conv, batch norm, a residual block, linear) in bf16: K micro-batches on 1 or 2
    devices end bitwise where one bf16 batch on one device does, and not where float32 does."""
    one = fused_params(dist_worker.bn_net, CPUS[:1], 1, "bf16", deterministic=8)
    got = fused_params(dist_worker.bn_net, CPUS[:devices], accumulate, "bf16", deterministic=8)
    assert_bitwise(got, one, f"bf16, {devices} devices, accumulate={accumulate}")
    f32 = fused_params(dist_worker.bn_net, CPUS[:devices], accumulate, "float32",
                       deterministic=8)
    assert not np.array_equal(got[0], f32[0]), "accumulate ran the float32 products"


def one_step(fused, accumulate, precision):
    """One SGD step of plain_net on 2 devices over a batch of 23 rows (micro-batches of 8, 8
    and 7), by the fused step or the book's loop (accumulated_backward under autocast)."""
    (Xn, yn), = batches(1, n=23)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    net = plain_net()
    dp = nn.DataParallel(net, device_ids=CPUS)
    trainer = optim.SGD(net.parameters(), lr=0.1)
    if fused:
        dp.train_step(X, y, nn.CrossEntropyLoss(), trainer, accumulate=accumulate,
                      precision=precision)
    else:
        trainer.zero_grad()
        with mgpu.autocast(precision):
            accumulated_backward(dp, nn.CrossEntropyLoss(), X, y, accumulate)
        trainer.step()
    return [p.numpy() for p in net.parameters()]


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_accumulation_changes_only_the_float32_sums(fused):
    """No batch norm: 3 bf16 micro-batches give one bf16 batch's step up to the order of the
    float32 sums, in the fused step and in the book's loop; and bf16 took effect."""
    one, three = one_step(fused, 1, "bf16"), one_step(fused, 3, "bf16")
    f32 = one_step(fused, 3, "float32")
    for i, (got, want) in enumerate(zip(three, one)):
        assert_close(got, want, "sum", f"bf16 accumulate=3 vs 1, parameter {i}")
    assert not np.array_equal(three[0], f32[0]), "accumulate ran the float32 products"


@pytest.mark.parametrize("fused", [False, True])
def test_train_concise_passes_precision_and_accumulate_to_its_loop(monkeypatch, fused):
    """The fused loop's step (DataParallel.run_step, train_step on the checked arguments) gets
    both; the book's loop runs accumulated_backward under autocast(precision)."""
    import ckpt_worker
    # The run's device is a CPU even where gpu(0) exists (an emulated GPU is slower).
    monkeypatch.setattr(mgpu.chapter, "try_gpu", mgpu.cpu)
    seen = []
    if fused:
        step = nn.DataParallel.run_step

        def spy(self, X, y, trainer, shards, accumulate, precision, *rest):
            seen.append((precision, accumulate))
            return step(self, X, y, trainer, shards, accumulate, precision, *rest)
        monkeypatch.setattr(nn.DataParallel, "run_step", spy)
    else:
        backward = mgpu.chapter.accumulated_backward

        def spy(net, loss, X, y, k):
            seen.append((mgpu.amp.get_precision(), k))
            return backward(net, loss, X, y, k)
        monkeypatch.setattr(mgpu.chapter, "accumulated_backward", spy)
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AvgPool2d(4), nn.Flatten(),
                        nn.Linear(2 * 7 * 7, 10))
    mgpu.chapter.train_concise(net, 1, ckpt_worker.BATCH, 0.01, 1, data=ckpt_worker.data(),
                               progress=False, fused=fused, accumulate=2, precision="bf16")
    assert seen and set(seen) == {("bf16", 2)}, seen


def test_conv_algorithms_names_the_bf16_layers():
    """A bf16 Model's conv layers run the bf16 kernels, with the algorithm MGPU_CONV_ALGO said
    as the Model was built."""
    for precision in ("bf16", "float32"):
        net = plain_net()
        dp = nn.DataParallel(net, device_ids=CPUS[:1])
        (Xn, yn), = batches(1, n=4)
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(),
                      optim.SGD(net.parameters(), lr=0.1), precision=precision)
        algos = [a for _, a in dp._fused.model._model.conv_algorithms()]
        assert algos and (all(a == "bf16 auto" for a in algos) if precision == "bf16"
                          else all(not a.startswith("bf16") for a in algos)), (precision, algos)
