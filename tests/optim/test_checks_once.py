"""Each hyperparameter is checked once, at the public entry where the user gives it, and the
steps below trust it: a loop checks its clipping norm and LeNet's lr once per run, not at every
step; the C++ step and Adam's kernel check no hyperparameter; and a bad momentum, eps, betas,
max_norm or clip_grad_norm through every public entry (DataParallel.train_step,
FusedModel.train_step, train_concise, mgpu.train and mgpu.train_batch, the CLI) is still a
ValueError naming that entry, with nothing changed."""
import importlib
import os

import numpy as np
import pytest

import mgpu
from mgpu import chapter, data_parallel, nn, nn_utils, parallel
from mgpu.cli import main
from mgpu.data import array_loader
from test_data_parallel import batch, tiny_net

train_module = importlib.import_module("mgpu.train")  # mgpu.train is also the function
C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
STEPS, BATCH = 3, 16


@pytest.fixture(autouse=True)
def _on_cpus(monkeypatch):
    """The loops train on CPU devices even where gpu(0) exists (an emulated GPU is slower)."""
    for m in (chapter, train_module):
        monkeypatch.setattr(m, "try_gpu", mgpu.cpu)


def _loaders():
    """STEPS training batches of BATCH Fashion-MNIST-shaped images, and one test batch."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(STEPS * BATCH, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, size=STEPS * BATCH).astype(np.uint8)
    return (array_loader(images, labels, BATCH),
            array_loader(images[:BATCH], labels[:BATCH], BATCH))


def _small_net():
    mgpu.random.seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AvgPool2d(4),
                         nn.Flatten(), nn.Linear(2 * 7 * 7, 10))


def _count(monkeypatch, function, modules):
    """Replaces ``function`` in every module of ``modules`` (its home and those that imported
    it) by one that records its arguments; returns the list of calls."""
    calls = []

    def spy(*args, **kw):
        calls.append(args)
        return function(*args, **kw)
    for m in modules:
        monkeypatch.setattr(m, function.__name__, spy)
    return calls


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "book"])
def test_train_concise_checks_its_clipping_norm_once_for_the_whole_run(monkeypatch, fused):
    """3 steps, one check of clip_grad_norm (train_concise's); the trainer's groups are read and
    checked at every step (a scheduler may have written them), once per step."""
    checks = _count(monkeypatch, nn_utils.check_max_norm,
                    [nn_utils, chapter, data_parallel, parallel])
    groups = _count(monkeypatch, mgpu.optim.Optimizer.current_groups, [mgpu.optim.Optimizer])
    chapter.train_concise(_small_net(), 1, BATCH, 0.05, 1, data=_loaders(), progress=False,
                          fused=fused, clip_grad_norm=0.5)
    assert [c[1:] for c in checks] == [("train_concise", "clip_grad_norm")]
    assert len(groups) == STEPS


def test_train_checks_lenets_lr_once_for_the_whole_run(monkeypatch):
    """mgpu.train over 3 fused LeNet steps: check_lr runs once, on the lr given, and no
    optimizer check sees that lr (the schedule's holder takes it unchecked)."""
    lr = 0.0371
    checks = _count(monkeypatch, parallel.check_lr, [parallel, train_module])
    seen = []
    check_group = mgpu.optim.SGD._check_group

    def spy(self, group, where):
        seen.append(group["lr"])
        return check_group(self, group, where)
    monkeypatch.setattr(mgpu.optim.SGD, "_check_group", spy)
    result = mgpu.train(1, BATCH, lr, 1, data=_loaders(), progress=False,
                        params=mgpu.lenet_params(scale=0.1, seed=0))
    assert np.isfinite(result.train_loss[0])
    assert checks == [(lr, "train")]
    assert lr not in seen


def _fused_model():
    rng = np.random.default_rng(0)
    spec = [("conv2d", {"padding": 1}), ("relu",), ("global_avg_pool",), ("flatten",),
            ("linear", {"transpose": True})]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(4, 1, 3, 3), (4,), (3, 4),
                                                                   (3,)]]
    replicas = [[mgpu.array(a, device=d) for a in arrays] for d in (C0, C1)]
    X = mgpu.array(rng.random((4, 1, 5, 5), dtype=np.float32))
    y = mgpu.array(np.array([0, 1, 2, 1]))
    return parallel.FusedModel(spec, replicas, [[], []], [C0, C1]), replicas, X, y


GOOD = dict(optimizer="adam", momentum=0.0, betas=(0.9, 0.999), eps=1e-8, step=1,
            max_norm=None, lrs=[], weight_decays=[], amsgrad=False)


@pytest.mark.parametrize("bad", [dict(momentum=-0.5), dict(eps=float("nan")),
                                 dict(betas=(1.0, 0.999)), dict(max_norm=float("inf")),
                                 dict(lr=float("nan"))],
                         ids=["momentum", "eps", "betas", "max_norm", "lr"])
def test_the_cpp_step_trusts_the_values_python_checked(bad):
    """FusedModel.run_step (the checked path below train_step) hands a bad value to C++
    unchecked: the step runs (into NaN or not), no second check refuses it. Only the public
    entry checks (the next test)."""
    model, replicas, X, y = _fused_model()
    args = dict(GOOD, lr=0.1, weight_decay=0.0, shards=0, accumulate=1)
    args.update(bad)
    if "momentum" in bad:
        args["optimizer"] = "sgd"
    model.run_step(X, y, **args)
    mgpu.waitall()


def test_adam_kernel_trusts_the_optimizers_checked_lr():
    p, g = mgpu.array(np.ones(5, np.float32)), mgpu.array(np.ones(5, np.float32))
    m, v = mgpu.zeros((5,)), mgpu.zeros((5,))
    mgpu._core.adam_step(p._t, g._t, m._t, v._t, float("nan"), (0.9, 0.999), 1e-8, 0.0, False,
                         1)
    assert np.isnan(p.numpy()).all()


FUSED_BAD = [
    (dict(momentum=-0.5, optimizer="sgd"), r"train_step: momentum must be a finite number"),
    (dict(eps=float("nan")), r"train_step: eps must be a finite number"),
    (dict(betas=(1.0, 0.999)), r"train_step: betas\[0\] must lie in \[0, 1\)"),
    (dict(betas=(0.9, -0.1)), r"train_step: betas\[1\] must be a finite number"),
    (dict(max_norm=-1.0), r"train_step: max_norm must be a finite number >= 0"),
    (dict(max_norm=float("nan")), r"train_step: max_norm must be a finite number >= 0"),
    (dict(step=0), r"train_step: Adam's step count starts at 1"),
    (dict(weight_decays=[0.0, float("inf"), 0.0, 0.0]), r"train_step: weight_decays\[1\] must"),
    (dict(weight_decays=[0.0, 0.0]), r"train_step: weight_decays must hold one value per "
                                     r"parameter \(4\), got 2"),
    (dict(lrs=[0.1]), r"train_step: lrs must hold one value per parameter \(4\), got 1"),
    (dict(optimizer="rmsprop"), r"train_step: optimizer must be 'sgd', 'adam' or 'adamw'"),
    (dict(optimizer="sgd", amsgrad=True), r"train_step: amsgrad is a variant of 'adam'"),
]


@pytest.mark.parametrize("bad,message", FUSED_BAD, ids=[m.split(": ")[1][:24] for _, m in
                                                         FUSED_BAD])
def test_fused_model_train_step_refuses_each_bad_value_changing_nothing(bad, message):
    model, replicas, X, y = _fused_model()
    before = [p.numpy().copy() for p in replicas[0]]
    with pytest.raises(ValueError, match="^" + message):
        model.train_step(X, y, 0.1, **dict(GOOD, **bad))
    assert all(np.array_equal(p.numpy(), b) for p, b in zip(replicas[0], before))
    model.train_step(X, y, 0.1, **GOOD)  # the good values step
    assert not all(np.array_equal(p.numpy(), b) for p, b in zip(replicas[0], before))


def _sgd(net):
    return mgpu.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _adam(net):
    return mgpu.optim.Adam(net.parameters(), lr=0.01)


@pytest.mark.parametrize("make,key,value,message", [
    (_sgd, "momentum", -0.5, r"momentum must be a finite number >= 0.0, got -0.5"),
    (_adam, "eps", float("nan"), r"eps must be a finite number >= 0.0, got nan"),
    (_adam, "betas", (0.9, 1.0), r"betas\[1\] must lie in \[0, 1\), got 1.0"),
], ids=["momentum", "eps", "betas"])
def test_data_parallel_train_step_refuses_a_bad_group_value_changing_nothing(make, key, value,
                                                                              message):
    """Written into param_groups after a good step (no setter sees it): the next fused step
    refuses it, naming the public entry and the group."""
    net = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    trainer = make(net)
    Xn, yn = batch(8)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    loss = nn.CrossEntropyLoss()
    net.train_step(X, y, loss, trainer)
    trainer.param_groups[0][key] = value
    before = [p.numpy().copy() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"^train_step: param_groups\[0\]: " + message):
        net.train_step(X, y, loss, trainer)
    assert all(np.array_equal(p.numpy(), b) for p, b in zip(net.parameters(), before))


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_clip_grad_norm_is_refused_by_each_entry(monkeypatch, value):
    net = nn.DataParallel(tiny_net(), device_ids=[C0])
    Xn, yn = batch(4)
    with pytest.raises(ValueError, match=r"^train_step: clip_grad_norm must be a finite number "
                                         r">= 0 \(the largest global norm of the gradients\)"):
        net.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), _sgd(net),
                       clip_grad_norm=value)
    with pytest.raises(ValueError, match=r"^clip_grad_norm_: max_norm must be a finite number"):
        nn.utils.clip_grad_norm_(net.parameters(), value)
    for fused in (True, False):
        with pytest.raises(ValueError, match=r"^train_concise: clip_grad_norm must be a finite "
                                             r"number >= 0"):
            chapter.train_concise(_small_net(), 1, BATCH, 0.05, 1, data=_loaders(),
                                  progress=False, fused=fused, clip_grad_norm=value)


@pytest.mark.parametrize("lr", [float("nan"), -0.1, 0.0])
def test_lenets_entries_refuse_a_bad_lr(lr):
    params = mgpu.lenet_params(seed=0)
    before = [p.numpy().copy() for p in params]
    replicas = [mgpu.get_params(params, C0)]
    X = mgpu.array(np.zeros((4, 1, 28, 28), np.float32))
    y = mgpu.array(np.zeros(4, np.int64))
    message = r"the learning rate must be a finite number > 0, got"
    with pytest.raises(ValueError, match=r"^train_batch: " + message):
        mgpu.train_batch(X, y, replicas, [C0], lr)
    with pytest.raises(ValueError, match=r"^train: " + message):
        mgpu.train(1, BATCH, lr, 1, data=_loaders(), params=params, progress=False)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(replicas[0], before))


def _cli(monkeypatch, capsys, argv):
    for m in (chapter, train_module):
        monkeypatch.setattr(m, "load_data_fashion_mnist", lambda *a, **k: _loaders())
    code = main(argv + ["--epochs", "1", "--batch-size", str(BATCH)])
    return code, capsys.readouterr().err.strip()


def test_cli_refuses_a_bad_lr_and_clip_grad_norm_in_one_line(monkeypatch, capsys):
    code, err = _cli(monkeypatch, capsys, ["train", "--lr", "nan"])
    assert code == 2 and len(err.splitlines()) == 1
    assert "train: the learning rate must be a finite number > 0, got nan" in err
    code, err = _cli(monkeypatch, capsys, ["train", "--model", "resnet18", "--fused",
                                           "--clip-grad-norm=-1"])
    assert code == 2 and len(err.splitlines()) == 1
    assert "train_concise: clip_grad_norm must be a finite number >= 0" in err


def test_a_resumed_lenet_run_checks_the_lr_its_checkpoint_restores(tmp_path):
    """The lr a resumed schedule goes on with comes from the file, not from the user: it is
    checked as train checks one, before anything changes (the steps below trust it)."""
    from mgpu import checkpoint
    kw = dict(data=_loaders(), progress=False, schedule="step", checkpoint=str(tmp_path))
    mgpu.train(1, BATCH, 0.05, 2, params=mgpu.lenet_params(scale=0.1, seed=0), **kw)
    (_, path), = [f for f in checkpoint.TrainCheckpoints(str(tmp_path), None, "t").files()
                  if f[0] == STEPS]
    state, meta = checkpoint.load(path), checkpoint.read_meta(path)
    state["scheduler"]["_last_lr"] = [float("nan")]
    checkpoint.save(state, path, meta)
    for f in checkpoint.TrainCheckpoints(str(tmp_path), None, "t").files():
        if f[0] > STEPS:
            os.unlink(f[1])  # the newest is the edited one
    with pytest.raises(checkpoint.CheckpointError, match="train: the learning rate must be a "
                                                         "finite number > 0, got nan"):
        mgpu.train(1, BATCH, 0.05, 2, params=mgpu.lenet_params(scale=0.1, seed=0), resume=True,
                   **kw)
