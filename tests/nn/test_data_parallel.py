"""BatchNorm2d, nn.DataParallel and nn.SyncBatchNorm (sec. 12.6) against float64 references:
a small residual network's step on one device, shard by shard on 1-3 devices (per-replica batch
statistics) and on the whole batch (synchronised statistics); ResNet-18; bad input."""
import numpy as np
import pytest

import mgpu
import nn_reference as nref
from conftest import assert_close
from mgpu import nn
from mgpu.models import Residual

EPS, MOMENTUM, LR = 1e-5, 0.1, 0.5
# Float32 against float64 through two batch norms over a few values per channel: BN divides by
# small batch standard deviations, which amplifies float32 rounding of the convolution sums.
TOL = dict(rtol=2e-4, atol=2e-5)


def close(got, expected, what):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    err = np.abs(got - expected) - TOL["atol"] - TOL["rtol"] * np.abs(expected)
    assert err.max() <= 0, (f"{what}: max abs err {np.abs(got - expected).max():.3g} at "
                            f"{np.unravel_index(np.argmax(err), err.shape)}")


def tiny_net(seed=0, sync=False):
    """conv-BN-ReLU stem, a Residual block with a 1x1 shortcut at stride 2, pooling, Linear."""
    mgpu.random.seed(seed)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                        Residual(3, 4, use_1x1conv=True, strides=2),
                        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(4, 5))
    # Non-trivial affine parameters and running statistics, so every term of the update shows.
    rng = np.random.default_rng(seed + 100)
    for name, t in net.state_dict().items():
        if name.endswith(("bn1.weight", "bn2.weight", "1.weight")) and t.ndim == 1:
            t[:] = rng.uniform(0.5, 1.5, size=t.shape).astype(np.float32)
        elif name.endswith(("bias", "running_mean")) and t.ndim == 1:
            t[:] = rng.normal(scale=0.3, size=t.shape).astype(np.float32)
        elif name.endswith("running_var"):
            t[:] = rng.uniform(0.5, 2.0, size=t.shape).astype(np.float32)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net) if sync else net


def batch(n=7, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 2, 6, 6)).astype(np.float32),
            rng.integers(0, 5, size=n))


def host_state(net):
    return {k: v.numpy().astype(np.float64) for k, v in net.state_dict().items()}


def shard_rows(n, k):
    k = min(k, n)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def step_and_check(net, model, devices, X, y, shards, sync_label):
    """One step of the book's loop through ``model``; checks loss, gradients, parameters and
    running statistics against the float64 reference computed over ``shards``."""
    P = host_state(net)
    loss_ref, grads_ref, new_ref, running_ref = nref.tiny_step(X, y, P, shards, LR, MOMENTUM, EPS)
    trainer = mgpu.optim.SGD(model.parameters(), lr=LR)
    loss = nn.CrossEntropyLoss()
    model.train()
    trainer.zero_grad()
    Xt, yt = mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0])
    out = loss(model(Xt), yt)
    out.backward()
    close(out.item(), loss_ref, f"loss {sync_label}")
    for name, p in net.named_parameters():
        assert p.grad.device == devices[0]
        close(p.grad.numpy(), grads_ref[name], f"grad {name} {sync_label}")
    trainer.step()
    state = check_updated_state(net, new_ref, running_ref, sync_label)
    for bn in nref.BN_NAMES:
        assert state[bn + ".num_batches_tracked"] == 1


def check_updated_state(net, new_ref, running_ref, label):
    """``net``'s parameters and batch norms' running statistics after a step against the float64
    reference's (nn_reference.tiny_step); returns host_state(net)."""
    state = host_state(net)
    for name in new_ref:
        close(state[name], new_ref[name], f"updated {name} {label}")
    for bn in nref.BN_NAMES:
        close(state[bn + ".running_mean"], running_ref[bn][0], f"{bn}.running_mean {label}")
        close(state[bn + ".running_var"], running_ref[bn][1], f"{bn}.running_var {label}")
    return state


def test_reference_batch_norm_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2, 2, 2))
    gamma, beta, w = rng.uniform(0.5, 1.5, 2), rng.normal(size=2), rng.normal(size=x.shape)
    y, cache = nref.bn_forward(x, gamma, beta, EPS)
    dx, dgamma, dbeta = nref.bn_backward(w, cache, EPS)
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = 1e-6
        num[i] = ((nref.bn_forward(x + e, gamma, beta, EPS)[0] * w).sum()
                  - (nref.bn_forward(x - e, gamma, beta, EPS)[0] * w).sum()) / 2e-6
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dgamma, (w * cache[0]).sum(axis=(0, 2, 3)))
    np.testing.assert_allclose(dbeta, w.sum(axis=(0, 2, 3)))


# --- BatchNorm2d ------------------------------------------------------------------------------

def test_batchnorm2d_train_and_eval(device):
    rng = np.random.default_rng(1)
    bn = nn.BatchNorm2d(3, momentum=0.2).to(device)
    bn.weight[:] = np.array([0.5, 1.0, 2.0], np.float32)
    bn.bias[:] = np.array([0.1, -0.2, 0.3], np.float32)
    x = (rng.normal(size=(4, 3, 2, 5)) * 3 + 1).astype(np.float32)
    xt = mgpu.array(x, device=device).requires_grad_()
    gamma, beta = bn.weight.numpy().astype(np.float64), bn.bias.numpy().astype(np.float64)
    y = bn(xt)
    y_ref, cache = nref.bn_forward(x, gamma, beta, EPS)
    close(y.numpy(), y_ref, "BatchNorm2d train forward")
    dy = rng.normal(size=x.shape).astype(np.float32)
    y.backward(mgpu.array(dy, device=device))
    dx, dgamma, dbeta = nref.bn_backward(dy.astype(np.float64), cache, EPS)
    close(xt.grad.numpy(), dx, "BatchNorm2d dx")
    close(bn.weight.grad.numpy(), dgamma, "BatchNorm2d dgamma")
    close(bn.bias.grad.numpy(), dbeta, "BatchNorm2d dbeta")
    rm, rv = nref.running_update(np.zeros(3), np.ones(3), cache, 40, 0.2)
    close(bn.running_mean.numpy(), rm, "running_mean")
    close(bn.running_var.numpy(), rv, "running_var (unbiased)")
    assert bn.num_batches_tracked.item() == 1
    # Evaluation normalises with the running statistics and leaves them alone.
    bn.eval()
    out = bn(mgpu.array(x, device=device))
    close(out.numpy(), nref.bn_eval(x, gamma, beta, rm, rv, EPS), "BatchNorm2d eval")
    close(bn.running_mean.numpy(), rm, "running_mean after eval")
    assert bn.num_batches_tracked.item() == 1
    bn.train()
    assert not np.allclose(bn(mgpu.array(x, device=device)).numpy(), out.numpy())


def test_batchnorm_momentum_none_is_a_cumulative_average_and_state_reloads():
    rng = np.random.default_rng(2)
    bn = nn.BatchNorm2d(2, momentum=None)
    xs = [rng.normal(size=(3, 2, 2, 2)).astype(np.float32) + i for i in range(3)]
    for x in xs:
        bn(mgpu.array(x))
    close(bn.running_mean.numpy(), np.mean([x.mean(axis=(0, 2, 3)) for x in xs], axis=0),
          "cumulative running mean")
    other = nn.BatchNorm2d(2, momentum=None)
    other.load_state_dict(bn.state_dict())
    assert other.num_batches_tracked.item() == 3
    other(mgpu.array(xs[0]))
    assert other.num_batches_tracked.item() == 4


def test_batchnorm_bad_inputs():
    bn = nn.BatchNorm2d(3)
    with pytest.raises(ValueError, match="3 channels"):
        bn(mgpu.ones((2, 4, 3, 3)))
    with pytest.raises(ValueError, match="more than one value per channel"):
        bn(mgpu.ones((1, 3, 1, 1)))
    assert bn.num_batches_tracked.item() == 0


# --- the small residual net, one device and DataParallel ------------------------------------------

def test_tiny_residual_net_one_step_on_one_device():
    net = tiny_net()
    X, y = batch()
    step_and_check(net, net, [mgpu.cpu(0)], X, y, [len(y)], "one device")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_data_parallel_per_replica_batch_norm(k):
    net = tiny_net()
    devices = [mgpu.cpu(i) for i in range(k)]
    model = nn.DataParallel(net, device_ids=devices)
    X, y = batch()
    step_and_check(net, model, devices, X, y, shard_rows(len(y), k), f"DataParallel k={k}")


@pytest.mark.parametrize("k", [2, 3])
def test_data_parallel_sync_batch_norm_equals_one_device_on_the_whole_batch(k):
    net = tiny_net(sync=True)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in net.modules()) == 3
    devices = [mgpu.cpu(i) for i in range(k)]
    model = nn.DataParallel(net, device_ids=devices)
    X, y = batch()
    step_and_check(net, model, devices, X, y, [len(y)], f"SyncBatchNorm k={k}")


def test_data_parallel_eval_and_repeated_steps_keep_replicas_in_sync():
    """Three steps on 2 devices equal three steps on one device computed shard by shard."""
    net, ref_net = tiny_net(), tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    X, y = batch(8)
    trainer = mgpu.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_trainer = mgpu.optim.SGD(ref_net.parameters(), lr=LR, momentum=0.9)
    loss = nn.CrossEntropyLoss(reduction="sum")
    for _ in range(3):
        trainer.zero_grad()
        ref_trainer.zero_grad()
        loss(model(mgpu.array(X)), mgpu.array(y)).backward()
        for lo, hi in ((0, 4), (4, 8)):
            loss(ref_net(mgpu.array(X[lo:hi])), mgpu.array(y[lo:hi])).backward()
            if lo == 0:
                kept = {k: v.numpy() for k, v in ref_net.named_buffers()}
        for name, b in ref_net.named_buffers():  # DataParallel keeps replica 0's statistics
            b[:] = kept[name]
        trainer.step()
        ref_trainer.step()
    for (name, a), b in zip(net.state_dict().items(), ref_net.state_dict().values()):
        close(a.numpy(), b.numpy(), f"after 3 steps: {name}")
    assert net[1].num_batches_tracked.item() == 3
    model.eval()
    close(model(mgpu.array(X)).numpy(), net(mgpu.array(X)).numpy(), "eval forward")


def test_data_parallel_batch_smaller_than_device_count():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(3)])
    X, y = batch(2)
    step_and_check(net, model, [mgpu.cpu(0)], X, y, [1, 1], "batch 2 on 3 devices")


def test_data_parallel_lenet_gradients_equal_one_device():
    mgpu.random.seed(0)
    net = mgpu.models.LeNet()
    X = mgpu.randn(5, 1, 28, 28)
    y = mgpu.array(np.arange(5) % 10)
    loss = nn.CrossEntropyLoss()
    loss(net(X), y).backward()
    one = {k: p.grad.numpy() for k, p in net.named_parameters()}
    net.zero_grad()
    loss(nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])(X), y).backward()
    for k, p in net.named_parameters():
        assert_close(p.grad.numpy(), one[k], "sum", f"LeNet grad {k}")


# --- emulated GPUs (tiny shapes: the emulator runs every CUDA thread as a fiber) ------------------

def _gpus(k):
    if mgpu.num_gpus() < k:
        pytest.skip(f"needs {k} GPUs (emulated build), this build has {mgpu.num_gpus()}")
    return [mgpu.gpu(i) for i in range(k)]


@pytest.mark.gpu
@pytest.mark.parametrize("sync", [False, True])
def test_data_parallel_on_gpu(sync):
    devices = _gpus(2)
    net = tiny_net(sync=sync)
    model = nn.DataParallel(net, device_ids=devices)
    X, y = batch(5)
    shards = [5] if sync else shard_rows(5, 2)
    step_and_check(net, model, devices, X, y, shards, f"gpu sync={sync}")


# --- ResNet-18 ------------------------------------------------------------------------------------

def test_resnet18_shapes_and_one_step_lowers_the_loss():
    mgpu.random.seed(0)
    net = mgpu.models.resnet18(10, 1)
    assert sum(p.size for p in net.parameters()) == 11_175_818
    X = mgpu.array(np.random.default_rng(0).uniform(size=(4, 1, 28, 28)).astype(np.float32))
    y = mgpu.array(np.array([0, 1, 2, 3]))
    out = net(X)
    assert out.shape == (4, 10)
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.05)
    loss = nn.CrossEntropyLoss()
    first = loss(out, y)
    first.backward()
    trainer.step()
    assert all(p.grad is not None for p in net.parameters())
    assert loss(net(X), y).item() < first.item()


def test_resnet18_rejects_inputs_it_cannot_take():
    net = mgpu.models.resnet18(10, 1)
    with pytest.raises(ValueError, match="expected input \\(N, 1, H, W\\)"):
        net(mgpu.ones((2, 3, 28, 28)))
    # 3x3 images pass the stem and the first stages, then reach 1x1 with one image: the
    # stem's running statistics, updated before the failure, are restored.
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="more than one value per channel"):
        net(mgpu.array(np.random.default_rng(0).normal(size=(1, 1, 3, 3))))
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


# --- bad input ------------------------------------------------------------------------------------

def test_data_parallel_bad_device_ids():
    net = tiny_net()
    with pytest.raises(ValueError, match="repeats a device"):
        nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(0)])
    with pytest.raises(ValueError, match="empty"):
        nn.DataParallel(net, device_ids=[])
    with pytest.raises(TypeError, match="device_ids holds"):
        nn.DataParallel(net, device_ids=[object()])
    with pytest.raises(TypeError, match="expected an mgpu.nn.Module"):
        nn.DataParallel(lambda x: x, device_ids=[mgpu.cpu(0)])
    if mgpu.num_gpus() > 0:
        with pytest.raises(ValueError, match="mixes CPU and GPU"):
            nn.DataParallel(net, device_ids=[mgpu.gpu(0), mgpu.cpu(1)])
    assert all(p.device == mgpu.cpu(0) for p in net.parameters())


def test_data_parallel_bad_inputs_change_nothing():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="expected input \\(N, 2, H, W\\)"):
        model(mgpu.ones((4, 3, 6, 6)))
    # Two 1x1 images on two devices: one value per channel in each replica's BatchNorm.
    with pytest.raises(ValueError, match="more than one value per channel"):
        model(mgpu.ones((2, 2, 1, 1)))
    with pytest.raises(TypeError, match="NumPy array"):
        model(np.ones((4, 2, 6, 6), np.float32))
    net[0].to(mgpu.cpu(1))
    with pytest.raises(ValueError, match="must stay on device_ids\\[0\\]"):
        model(mgpu.ones((4, 2, 6, 6)))
    net[0].to(mgpu.cpu(0))
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


def test_optimizer_of_another_network_is_detected():
    net, other = tiny_net(), tiny_net(seed=1)
    trainer = mgpu.optim.SGD(other.parameters(), lr=0.1)
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    X, y = batch()
    nn.CrossEntropyLoss()(model(mgpu.array(X)), mgpu.array(y)).backward()
    with pytest.raises(ValueError, match="another network's parameters"):
        trainer.step()


def test_fused_train_step_rejects_what_it_cannot_compute():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    X, y = mgpu.array(batch()[0]), mgpu.array(batch()[1])
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mean"):
        model.train_step(X, y, nn.CrossEntropyLoss(reduction="sum"), trainer)
    with pytest.raises(ValueError, match="exactly this network's parameters"):
        model.train_step(X, y, nn.CrossEntropyLoss(), mgpu.optim.SGD(tiny_net().parameters(), 0.1))
    odd = nn.DataParallel(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=None),
                                        nn.Flatten(), nn.Linear(48, 5)),
                          device_ids=[mgpu.cpu(0)])
    with pytest.raises(NotImplementedError, match="no layer for BatchNorm2d"):
        odd.train_step(X, y, nn.CrossEntropyLoss(), mgpu.optim.SGD(odd.module.parameters(), 0.1))


# --- the chapter's train (sec. 12.6) and the CLI --------------------------------------------------

def _synthetic(n=24, size=8, seed=0):
    """Images (n, size, size) whose class is visible in their mean brightness."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=n)
    images = (rng.uniform(0, 100, size=(n, size, size)) + 120 * labels[:, None, None])
    return images.astype(np.uint8), labels


def small_net():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         Residual(4, 4), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),
                         nn.Linear(4, 10))


@pytest.mark.parametrize("num_gpus,fused", [(1, False), (2, False), (2, True)])
def test_train_concise_runs_the_books_loop_and_prints_its_line(capsys, num_gpus, fused):
    from mgpu.data import array_loader
    images, labels = _synthetic()
    data = (array_loader(images, labels, 8, shuffle=True), array_loader(images, labels, 8))
    net = small_net()
    result = mgpu.chapter.train_concise(net, num_gpus, 8, 0.1, num_epochs=3, data=data,
                                        progress=False, fused=fused)
    devices = [mgpu.try_gpu(i) for i in range(num_gpus)]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("test acc: ") and line.endswith(f"sec/epoch on {devices}")
    assert len(result.test_acc) == 3 and 0.0 <= result.test_acc[-1] <= 1.0
    assert result.train_loss[-1] < result.train_loss[0]
    assert net[0].weight.device == devices[0]


def test_cli_resnet18_options_are_checked(capsys):
    from mgpu import cli
    assert cli.main(["train", "--model", "lenet", "--sync-bn"]) == 2
    assert "--sync-bn and --fused need --model resnet18" in capsys.readouterr().err
    assert cli.main(["train", "--model", "resnet18", "--op-by-op"]) == 2
    assert "ResNet-18 always trains" in capsys.readouterr().err


def fused_equals_books_loop(k, sync=False):
    """Two steps with momentum and weight decay on k CPU devices: DataParallel.train_step (one C++
    call) and the book's loop give the same losses, parameters and running statistics."""
    devices = [mgpu.cpu(i) for i in range(k)]
    nets = [tiny_net(sync=sync), tiny_net(sync=sync)]
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
                for m in models]
    loss = nn.CrossEntropyLoss()
    for step in range(2):
        X, y = batch(8, seed=step)
        Xt, yt = mgpu.array(X), mgpu.array(y)
        trainers[0].zero_grad()
        book = loss(models[0](Xt), yt)
        book.backward()
        trainers[0].step()
        fused = models[1].train_step(Xt, yt, loss, trainers[1])
        close(fused.item(), book.item(), f"loss, step {step}")
    book, fused = nets[0].state_dict(), nets[1].state_dict()
    for name in book:
        if not name.endswith("num_batches_tracked"):
            close(fused[name].numpy(), book[name].numpy(), f"fused vs book: {name}")


@pytest.mark.parametrize("k", [1, 2])
def test_fused_train_step_equals_the_books_loop(k):
    """DataParallel.train_step (one C++ call) and the book's loop give the same parameters and
    running statistics after two steps with momentum and weight decay."""
    fused_equals_books_loop(k)
