"""The learning rate is checked once per entry point, where the user gives it: an optimizer's
constructor and setters, and at every step the parameter groups as the step reads them
(``Optimizer.current_groups``), so a value a scheduler or the user wrote into ``param_groups``
is refused before anything changes, by the book's loop and by the fused step alike; the fused
model's own entry (``FusedModel.train_step``) checks ``lr`` and ``lrs``."""
import numpy as np
import pytest

import mgpu
from mgpu import nn, parallel
from mgpu.optim import lr_scheduler as sched
from test_data_parallel import batch, tiny_net

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
BAD = [-1.0, float("nan"), float("inf")]


def _state(net):
    return [p.numpy().copy() for p in net.parameters()]


def _unchanged(net, before):
    return all(np.array_equal(p.numpy(), b) for p, b in zip(net.parameters(), before))


def _book_step(net, trainer, X, y):
    trainer.zero_grad()
    nn.CrossEntropyLoss()(net(X), y).backward()
    trainer.step()


def _fused_step(net, trainer, X, y):
    net.train_step(X, y, nn.CrossEntropyLoss(), trainer)


@pytest.mark.parametrize("step", [_book_step, _fused_step], ids=["book", "fused"])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("lr", BAD)
def test_an_lr_written_into_param_groups_is_refused_at_the_next_step(step, optimizer, lr):
    net = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    trainer = getattr(mgpu.optim, optimizer)(net.parameters(), lr=0.1, momentum=0.9) \
        if optimizer == "SGD" else mgpu.optim.Adam(net.parameters(), lr=0.01)
    Xn, yn = batch(8)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    step(net, trainer, X, y)  # a good step first: the fused model exists, state is handed out
    trainer.param_groups[0]["lr"] = lr
    before = _state(net)
    name = "train_step" if step is _fused_step else f"{optimizer}.step"
    with pytest.raises(ValueError, match=rf"{name}: param_groups\[0\]: lr must be a finite "
                                         rf"number >= 0.0, got {lr}"):
        step(net, trainer, X, y)
    assert _unchanged(net, before)
    trainer.param_groups[0]["lr"] = 0.05  # a good value again: the run goes on
    step(net, trainer, X, y)
    assert not _unchanged(net, before)


@pytest.mark.parametrize("step", [_book_step, _fused_step], ids=["book", "fused"])
def test_a_scheduler_stepping_from_a_bad_lr_does_not_hide_it(step):
    """A schedule computes the next lr from the group's current one (StepLR multiplies it), so
    the user's bad value flows through the scheduler; the next step refuses it."""
    net = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.1)
    scheduler = sched.StepLR(trainer, step_size=1, gamma=0.5)
    Xn, yn = batch(8)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    step(net, trainer, X, y)
    scheduler.step()
    trainer.param_groups[0]["lr"] = -0.2
    scheduler.step()  # -0.1 now
    before = _state(net)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be a finite number >= 0.0, "
                                         r"got -0.1"):
        step(net, trainer, X, y)
    assert _unchanged(net, before)


def test_a_second_group_is_named_in_the_error():
    net = nn.DataParallel(tiny_net(), device_ids=[C0])
    params = list(net.parameters())
    trainer = mgpu.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}],
                             lr=0.1)
    trainer.param_groups[1]["lr"] = float("nan")
    Xn, yn = batch(4)
    with pytest.raises(ValueError, match=r"train_step: param_groups\[1\]: lr must be"):
        _fused_step(net, trainer, mgpu.array(Xn), mgpu.array(yn))


FUSED_SPEC = [("conv2d", {"padding": 1}), ("relu",), ("global_avg_pool",), ("flatten",),
              ("linear", {"transpose": True})]
FUSED_SHAPES = [(4, 1, 3, 3), (4,), (3, 4), (3,)]


@pytest.mark.parametrize("lrs", [[0.1, float("nan"), 0.1, 0.1], [0.1, 0.1, -1.0, 0.1],
                                 [0.1, 0.1, 0.1, float("inf")]])
def test_fused_model_refuses_a_bad_per_parameter_lr_changing_nothing(lrs):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in FUSED_SHAPES]
    replicas = [[mgpu.array(a, device=d) for a in arrays] for d in (C0, C1)]
    model = parallel.FusedModel(FUSED_SPEC, replicas, [[], []], [C0, C1])
    X = mgpu.array(rng.random((4, 1, 5, 5), dtype=np.float32))
    y = mgpu.array(np.array([0, 1, 2, 1]))
    bad = next(i for i, v in enumerate(lrs) if not 0 <= v < float("inf"))
    with pytest.raises(ValueError, match=rf"train_step: lrs\[{bad}\] must be a finite number"):
        model.train_step(X, y, 0.1, lrs=lrs)
    assert all(np.array_equal(p.numpy(), a) for ps in replicas for p, a in zip(ps, arrays))
    with pytest.raises(TypeError, match="lrs must be a list"):
        model.train_step(X, y, 0.1, lrs=0.1)
