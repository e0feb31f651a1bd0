"""mgpu.optim.lr_scheduler against PyTorch's formulas, computed here in float64 (closed forms,
written independently of the module's recursive updates), with two parameter groups of different
base lrs; schedules past their end, bad arguments and state dicts of another scheduler."""
import math

import numpy as np
import pytest

import mgpu
from conftest import crash_at_step
from mgpu import nn
from mgpu.optim import lr_scheduler as sched

BASES = (0.1, 0.02)


def two_groups(momentum=0.0, kind="sgd"):
    """An optimizer with two parameter groups (lrs BASES)."""
    a, b = nn.Parameter(mgpu.ones((2, 3))), nn.Parameter(mgpu.ones((4,)))
    groups = [{"params": [a], "lr": BASES[0]}, {"params": [b], "lr": BASES[1]}]
    if kind == "sgd":
        return mgpu.optim.SGD(groups, lr=1.0, momentum=momentum)
    return mgpu.optim.AdamW(groups, lr=1.0)


def run(opt, scheduler, steps):
    """The lrs of both groups at step 0 (after construction) and after each of ``steps``."""
    out = [[g["lr"] for g in opt.param_groups]]
    assert scheduler.get_last_lr() == out[0]
    for _ in range(steps):
        scheduler.step()
        out.append([g["lr"] for g in opt.param_groups])
        assert scheduler.get_last_lr() == out[-1]
    return np.array(out)


def expect(lrs, formula, what):
    t = np.arange(lrs.shape[0])
    ref = np.stack([np.array([formula(base, int(i)) for i in t]) for base in BASES], axis=1)
    np.testing.assert_allclose(lrs, ref, rtol=1e-12, atol=1e-15, err_msg=what)


def test_step_lr():
    opt = two_groups()
    lrs = run(opt, sched.StepLR(opt, step_size=3, gamma=0.5), 10)
    expect(lrs, lambda b, t: b * 0.5 ** (t // 3), "StepLR")


def test_multi_step_lr_counts_a_repeated_milestone_twice():
    opt = two_groups()
    ms = [2, 5, 5, 8]
    lrs = run(opt, sched.MultiStepLR(opt, milestones=ms, gamma=0.1), 10)
    expect(lrs, lambda b, t: b * 0.1 ** sum(m <= t for m in ms), "MultiStepLR")


def test_linear_lr_warm_up_then_constant():
    opt = two_groups()
    lrs = run(opt, sched.LinearLR(opt, start_factor=0.25, end_factor=1.0, total_iters=4), 8)
    expect(lrs, lambda b, t: b * (0.25 + 0.75 * min(t, 4) / 4), "LinearLR")


def test_cosine_annealing_follows_the_cosine_past_t_max():
    opt = two_groups()
    lrs = run(opt, sched.CosineAnnealingLR(opt, T_max=5, eta_min=0.001), 13)
    expect(lrs, lambda b, t: 0.001 + (b - 0.001) * (1 + math.cos(math.pi * t / 5)) / 2,
           "CosineAnnealingLR")


def test_cosine_annealing_is_recursive_as_pytorchs():
    # PyTorch's form follows the group's current lr: a lr halved by hand at step 2 stays on
    # the scaled curve, eta_min + (lr - eta_min) * ratio of successive cosines.
    opt = two_groups()
    s = sched.CosineAnnealingLR(opt, T_max=6)
    s.step()
    s.step()
    for g in opt.param_groups:
        g["lr"] *= 0.5
    s.step()
    c = [1 + math.cos(math.pi * t / 6) for t in range(4)]
    for g, b in zip(opt.param_groups, BASES):
        assert g["lr"] == pytest.approx(0.5 * b * c[2] / 2 * c[3] / c[2], rel=1e-12)


def onecycle_ref(t, base_max, total, pct, div=25.0, final_div=1e4, three=False, linear=False):
    """PyTorch's OneCycleLR formula (docs): phases end at pct*total - 1 (and 2*pct*total - 2
    with three phases) and total - 1, annealed from each phase's start value to its end."""
    init = base_max / div
    low = init / final_div
    if three:
        phases = [(pct * total - 1, init, base_max), (2 * pct * total - 2, base_max, init),
                  (total - 1, init, low)]
    else:
        phases = [(pct * total - 1, init, base_max), (total - 1, base_max, low)]
    start = 0.0
    for i, (end, a, b) in enumerate(phases):
        if t <= end or i == len(phases) - 1:
            x = (t - start) / (end - start)
            if linear:
                return a + (b - a) * x
            return b + (a - b) / 2 * (1 + math.cos(math.pi * x))
        start = end
    raise AssertionError


@pytest.mark.parametrize("three,linear", [(False, False), (True, True), (True, False)])
def test_one_cycle(three, linear):
    opt = two_groups()
    s = sched.OneCycleLR(opt, max_lr=list(BASES), total_steps=20, pct_start=0.3,
                         anneal_strategy="linear" if linear else "cos", three_phase=three)
    lrs = run(opt, s, 20)
    expect(lrs, lambda b, t: onecycle_ref(t, b, 20, 0.3, three=three, linear=linear),
           f"OneCycleLR three={three} linear={linear}")


def test_one_cycle_cycles_momentum_and_beta1_inversely():
    opt = two_groups(momentum=0.9)
    s = sched.OneCycleLR(opt, max_lr=1.0, epochs=2, steps_per_epoch=5)
    moms = [opt.param_groups[0]["momentum"]]
    for _ in range(10):
        s.step()
        moms.append(opt.param_groups[0]["momentum"])
    # Momentum goes max -> base in phase 1 and back in phase 2, the lr's curves mirrored.
    up_end = 0.3 * 10 - 1
    for t, m in enumerate(moms):
        if t <= up_end:
            x, a, b = t / up_end, 0.95, 0.85
        else:
            x, a, b = (t - up_end) / (9 - up_end), 0.85, 0.95
        assert m == pytest.approx(b + (a - b) / 2 * (1 + math.cos(math.pi * x)), rel=1e-12)
    adam = two_groups(kind="adamw")
    sched.OneCycleLR(adam, max_lr=0.01, total_steps=10)
    assert [g["betas"] for g in adam.param_groups] == [(0.95, 0.999)] * 2


def test_one_cycle_past_total_steps_raises_and_changes_nothing():
    opt = two_groups()
    s = sched.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    for _ in range(4):
        s.step()
    before = ([g["lr"] for g in opt.param_groups], s.last_epoch, s.get_last_lr())
    with pytest.raises(ValueError, match="tried to step 5 times.*total_steps = 4"):
        s.step()
    assert ([g["lr"] for g in opt.param_groups], s.last_epoch, s.get_last_lr()) == before


def test_sequential_warm_up_then_cosine():
    opt = two_groups()
    warm = sched.LinearLR(opt, start_factor=0.1, total_iters=3)
    cos = sched.CosineAnnealingLR(opt, T_max=6, eta_min=0.0)
    s = sched.SequentialLR(opt, [warm, cos], milestones=[3])
    lrs = run(opt, s, 11)

    def ref(b, t):
        if t < 3:
            return b * (0.1 + 0.9 * t / 3)
        return b * (1 + math.cos(math.pi * (t - 3) / 6)) / 2
    expect(lrs, ref, "SequentialLR(LinearLR, CosineAnnealingLR)")


def test_sequential_ending_in_one_cycle_raises_past_its_end():
    opt = two_groups()
    s = sched.SequentialLR(opt, [sched.LinearLR(opt, 0.5, total_iters=2),
                                 sched.OneCycleLR(opt, 0.1, total_steps=3)], milestones=[2])
    for _ in range(5):  # 2 warm-up steps, then the cycle's step 0 and 3 more
        s.step()
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="tried to step"):
        s.step()
    assert opt.param_groups[0]["lr"] == lr and s.last_epoch == 5


def test_state_dict_resumes_the_same_schedule():
    def make():
        opt = two_groups()
        warm = sched.LinearLR(opt, start_factor=0.2, total_iters=2)
        return opt, sched.SequentialLR(opt, [warm, sched.CosineAnnealingLR(opt, T_max=5)], [2])
    opt_a, a = make()
    for _ in range(4):
        a.step()
    saved_opt, saved = opt_a.state_dict(), a.state_dict()
    opt_b, b = make()
    opt_b.load_state_dict(saved_opt)
    b.load_state_dict(saved)
    assert b.last_epoch == a.last_epoch == 4
    for _ in range(4):
        a.step()
        b.step()
        assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]


def test_a_state_dict_of_another_scheduler_or_shape_changes_nothing():
    opt = two_groups()
    s = sched.StepLR(opt, step_size=2)
    s.step()
    before = dict(s.__dict__)
    other = sched.CosineAnnealingLR(two_groups(), T_max=3).state_dict()
    with pytest.raises(ValueError, match="has no"):
        s.load_state_dict(other)
    one_group = sched.StepLR(mgpu.optim.SGD([nn.Parameter(mgpu.ones((2,)))], lr=0.1),
                             step_size=2).state_dict()
    with pytest.raises(ValueError, match="one value per parameter group"):
        s.load_state_dict(one_group)
    with pytest.raises(TypeError, match="expected a dict"):
        s.load_state_dict([1])
    assert s.__dict__ == before
    seq = sched.SequentialLR(opt, [sched.StepLR(opt, 2), sched.StepLR(opt, 3)], [4])
    bad = seq.state_dict()
    bad["_schedulers"] = bad["_schedulers"][:1]
    with pytest.raises(ValueError, match="holds 1 schedulers"):
        seq.load_state_dict(bad)


def test_bad_arguments_are_clear_errors():
    opt = two_groups()
    with pytest.raises(ValueError, match="step_size must be >= 1"):
        sched.StepLR(opt, step_size=0)
    with pytest.raises(ValueError, match="start_factor must lie in"):
        sched.LinearLR(opt, start_factor=0.0)
    with pytest.raises(ValueError, match="end_factor must lie in"):
        sched.LinearLR(opt, end_factor=1.5)
    with pytest.raises(ValueError, match="pct_start"):
        sched.OneCycleLR(opt, 0.1, total_steps=10, pct_start=1.5)
    with pytest.raises(ValueError, match="anneal_strategy"):
        sched.OneCycleLR(opt, 0.1, total_steps=10, anneal_strategy="exp")
    with pytest.raises(ValueError, match="total_steps, or epochs"):
        sched.OneCycleLR(opt, 0.1)
    with pytest.raises(ValueError, match="expected 2 values for max_lr"):
        sched.OneCycleLR(opt, [0.1], total_steps=5)
    with pytest.raises(ValueError, match="expected 1 milestones"):
        sched.SequentialLR(opt, [sched.StepLR(opt, 2), sched.StepLR(opt, 2)], milestones=[])
    with pytest.raises(ValueError, match="another optimizer"):
        sched.SequentialLR(opt, [sched.StepLR(opt, 2), sched.StepLR(two_groups(), 2)], [3])
    with pytest.raises(TypeError, match="mgpu.optim optimizer"):
        sched.StepLR(object(), 2)
    fresh = two_groups()
    with pytest.raises(KeyError, match="initial_lr"):
        sched.StepLR(fresh, 2, last_epoch=3)
    assert [g["lr"] for g in fresh.param_groups] == list(BASES)


# --- LeNet's train (sec. 12.5) with a schedule, and the CLI --------------------------------------

def _lenet(tmp_path=None, crash_at=None, monkeypatch=None, **kw):
    """mgpu.train on the checkpoint tests' synthetic data (3 epochs of 5 steps, 2 devices); the
    lr of every step and the first replica's final parameters."""
    import ckpt_worker
    if crash_at is not None:
        crash_at_step(monkeypatch, crash_at)
    seen = {"lrs": []}

    def step(X, y, device_params, devices, lr):
        seen["lrs"].append(lr)
        seen["params"] = device_params[0]
        return mgpu.train_batch(X, y, device_params, devices, lr)
    ck = {} if tmp_path is None else dict(checkpoint=str(tmp_path), checkpoint_every=2,
                                          resume=True)
    mgpu.train(2, ckpt_worker.BATCH, 0.5, 3, params=mgpu.lenet_params(scale=0.1, seed=4),
               data=ckpt_worker.data(), progress=False, step=step, **ck, **kw)
    return seen["lrs"], [p.numpy() for p in seen["params"]]


def test_lenet_train_follows_warm_up_and_cosine_and_resumes_bitwise(tmp_path, monkeypatch):
    lrs, ref = _lenet(schedule="cosine", warmup_epochs=1)
    # 5 warm-up steps from lr / 5, then a cosine over the other 10 (PyTorch's LinearLR and
    # CosineAnnealingLR in a SequentialLR).
    want = [0.5 * (0.2 + 0.8 * t / 5) if t < 5 else 0.5 * (1 + math.cos(math.pi * (t - 5) / 10))
            / 2 for t in range(15)]
    np.testing.assert_allclose(lrs, want, rtol=1e-12)
    _, constant = _lenet()
    assert not np.allclose(constant[0], ref[0], rtol=1e-3)  # the schedule changed the run
    with pytest.raises(KeyboardInterrupt):
        _lenet(tmp_path, crash_at=8, monkeypatch=monkeypatch, schedule="cosine",
               warmup_epochs=1)
    monkeypatch.undo()
    resumed_lrs, got = _lenet(tmp_path, schedule="cosine", warmup_epochs=1)
    np.testing.assert_allclose(resumed_lrs, want[6:], rtol=1e-12)  # from the step-6 checkpoint
    for i, (a, b) in enumerate(zip(got, ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"parameter {i}")
    from mgpu.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="schedule"):
        _lenet(tmp_path)


def test_cli_schedule_options(capsys):
    from mgpu.cli import main
    assert main(["train", "--model", "lenet", "--optimizer", "adamw", "--epochs", "1"]) == 2
    assert "--optimizer, --weight-decay and --clip-grad-norm need --model resnet18" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--schedule", "exponential"])
    assert "invalid choice: 'exponential'" in capsys.readouterr().err
