"""mgpu.optim: SGD with parameter groups, Adam and AdamW against PyTorch's update rules written
here in NumPy float64; bad hyperparameters and state dicts; the fused step (DataParallel.
train_step) with AdamW, clipping and a schedule against the book's loop, bitwise on 1, 2 and 3
devices in deterministic mode; optionally against PyTorch itself (a peer interpreter)."""
import json
import math
import subprocess

import numpy as np
import pytest

import mgpu
import peers
from conftest import assert_close, crash_at_step
from mgpu import nn
from mgpu.optim import lr_scheduler as sched
from test_data_parallel import batch, close, tiny_net


def adam_ref(w, grads, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0, decoupled=False,
             amsgrad=False, lrs=None):
    """PyTorch's Adam / AdamW in float64; ``lrs`` overrides lr per step (a schedule)."""
    b1, b2 = betas
    w = w.astype(np.float64).copy()
    m, v, vmax = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    out = []
    for t, g in enumerate(grads, start=1):
        a = lrs[t - 1] if lrs is not None else lr
        g = g.astype(np.float64)
        if decoupled:
            w = w * (1 - a * wd)
        elif wd:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        denom = np.sqrt(vmax if amsgrad else v) / math.sqrt(1 - b2 ** t) + eps
        w = w - a / (1 - b1 ** t) * m / denom
        out.append(w.copy())
    return out


def sgd_ref(w, grads, lr, momentum=0.0, wd=0.0):
    w, buf, out = w.astype(np.float64).copy(), None, []
    for g in grads:
        g = g.astype(np.float64) + wd * w
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + g
            g = buf
        w = w - lr * g
        out.append(w.copy())
    return out


ADAM_CASES = [
    ("Adam", dict(lr=0.01), dict(lr=0.01)),
    ("Adam", dict(lr=0.01, weight_decay=0.1), dict(lr=0.01, wd=0.1)),
    ("AdamW", dict(lr=0.01), dict(lr=0.01, wd=0.01, decoupled=True)),  # PyTorch's default wd
    ("AdamW", dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.2),
     dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3, wd=0.2, decoupled=True)),
    ("Adam", dict(lr=0.01, amsgrad=True), dict(lr=0.01, amsgrad=True)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True),
     dict(lr=0.01, wd=0.1, decoupled=True, amsgrad=True)),
]


@pytest.mark.parametrize("cls,kw,ref_kw", ADAM_CASES)
def test_adam_matches_pytorchs_rule_over_six_steps(rng, cls, kw, ref_kw):
    w0 = rng.normal(size=(5, 4))
    # Gradients of varying scale, some steps shrinking, so m and v differ from their bias.
    grads = [rng.normal(size=(5, 4)) * s for s in (1.0, 0.3, 2.0, 0.5, 1.0, 0.1)]
    p = nn.Parameter(mgpu.array(w0.astype(np.float32)))
    opt = getattr(mgpu.optim, cls)([p], **kw)
    for step, (g, expected) in enumerate(zip(grads, adam_ref(w0, grads, **ref_kw)), start=1):
        p.grad = mgpu.array(g.astype(np.float32))
        opt.step()
        assert_close(p.numpy(), expected, "sum", f"{cls} {kw} after step {step}")
    st = opt.state_dict()["state"][0]
    assert st["step"] == 6.0 and st["exp_avg"].shape == p.shape


def test_param_groups_have_their_own_lr_and_weight_decay(rng):
    w = [rng.normal(size=(3, 2)), rng.normal(size=(4,))]
    grads = [[rng.normal(size=x.shape) for _ in range(3)] for x in w]
    for cls in ("SGD", "AdamW"):
        ps = [nn.Parameter(mgpu.array(x.astype(np.float32))) for x in w]
        groups = [{"params": [ps[0]], "lr": 0.1, "weight_decay": 0.05}, {"params": [ps[1]]}]
        if cls == "SGD":
            opt = mgpu.optim.SGD(groups, lr=0.01, momentum=0.9)
            refs = [sgd_ref(w[0], grads[0], 0.1, 0.9, 0.05), sgd_ref(w[1], grads[1], 0.01, 0.9)]
        else:
            opt = mgpu.optim.AdamW(groups, lr=0.01, weight_decay=0.0)
            refs = [adam_ref(w[0], grads[0], 0.1, wd=0.05, decoupled=True),
                    adam_ref(w[1], grads[1], 0.01, decoupled=True)]
        assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
        for step in range(3):
            for p, g in zip(ps, grads):
                p.grad = mgpu.array(g[step].astype(np.float32))
            opt.step()
            for i, p in enumerate(ps):
                assert_close(p.numpy(), refs[i][step], "sum", f"{cls} group {i} step {step}")
        sd = opt.state_dict()
        assert [g["params"] for g in sd["param_groups"]] == [[0], [1]]


def test_bad_hyperparameters_are_clear_errors_that_change_nothing():
    p = nn.Parameter(mgpu.ones((3,)))
    bad = [
        (mgpu.optim.SGD, dict(lr=-0.1), "lr must be"),
        (mgpu.optim.SGD, dict(lr=0.1, weight_decay=-1e-4), "weight_decay must be"),
        (mgpu.optim.Adam, dict(lr=-1e-3), "lr must be"),
        (mgpu.optim.Adam, dict(weight_decay=-0.01), "weight_decay must be"),
        (mgpu.optim.AdamW, dict(betas=(1.0, 0.999)), r"betas\[0\] must lie in \[0, 1\)"),
        (mgpu.optim.AdamW, dict(betas=(0.9, -0.1)), r"betas\[1\] must be"),
        (mgpu.optim.Adam, dict(eps=-1e-8), "eps must be"),
        (mgpu.optim.Adam, dict(lr=float("nan")), "lr must be"),
    ]
    for cls, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            cls([p], **kw)
    with pytest.raises(TypeError, match="betas must be a pair"):
        mgpu.optim.Adam([p], betas=0.9)
    opt = mgpu.optim.AdamW([p], lr=0.01)
    with pytest.raises(ValueError, match="lr must be"):
        opt.lr = -1.0
    q = nn.Parameter(mgpu.ones((2,)))
    with pytest.raises(ValueError, match="weight_decay must be"):
        opt.add_param_group({"params": [q], "weight_decay": -1.0})
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [p]})
    assert opt.lr == 0.01 and len(opt.param_groups) == 1 and len(opt.params) == 1


def _adam_run(p_host, grads, opt_state=None):
    p = nn.Parameter(mgpu.array(p_host))
    opt = mgpu.optim.AdamW([p], lr=0.02, weight_decay=0.1)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for g in grads:
        p.grad = mgpu.array(g)
        opt.step()
    return p, opt


def test_adam_state_dict_resumes_bitwise_and_rejects_another_shape(rng):
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(5)]
    whole, _ = _adam_run(w0, grads)
    first, opt = _adam_run(w0, grads[:2])
    saved = opt.state_dict()
    second, _ = _adam_run(first.numpy(), grads[2:], saved)
    np.testing.assert_array_equal(second.numpy(), whole.numpy())
    # Wrong shape, missing step, missing moment, wrong group count: nothing changes.
    before = {k: (v.numpy().copy() if isinstance(v, mgpu.Tensor) else v)
              for k, v in opt.state[0].items()}
    cases = [
        (lambda sd: sd["state"][0].__setitem__("exp_avg", mgpu.ones((3, 4))), ValueError,
         "has shape"),
        (lambda sd: sd["state"][0].pop("step"), ValueError, "'step'"),
        (lambda sd: sd["state"][0].pop("exp_avg_sq"), ValueError, "exp_avg_sq"),
        (lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 1.5)), ValueError,
         "betas"),
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), ValueError,
         "list of 1 group"),
    ]
    for edit, error, match in cases:
        sd = {"state": {0: dict(saved["state"][0])},
              "param_groups": [dict(saved["param_groups"][0])]}
        edit(sd)
        with pytest.raises(error, match=match):
            opt.load_state_dict(sd)
        for k, v in opt.state[0].items():
            got = v.numpy() if isinstance(v, mgpu.Tensor) else v
            np.testing.assert_array_equal(got, before[k])
        assert opt.param_groups[0]["betas"] == (0.9, 0.999)


# --- the fused step --------------------------------------------------------------------------

def _make(kind, params, groups=False):
    ps = list(params)
    if groups:
        ps = [{"params": ps[:3], "lr": 0.02, "weight_decay": 0.05}, {"params": ps[3:]}]
    if kind == "sgd":
        return mgpu.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)
    # eps 1e-4: the conv biases ahead of batch norm get gradients of rounding noise only
    # (batch norm takes the mean out), which Adam with eps 1e-8 would turn into lr-sized steps
    # of random sign, so two correct summation orders could not be compared.
    if kind == "adam":
        return mgpu.optim.Adam(ps, lr=0.01, weight_decay=1e-3, eps=1e-4)
    return mgpu.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-4)


def book_vs_fused(devices, kind, clip=None, schedule=False, groups=False, steps=3,
                  fused_devices=None):
    """(book net, fused net) after ``steps`` steps of the same data: the book's loop with
    nn.utils.clip_grad_norm_ and the optimizer, and DataParallel.train_step."""
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(nets[0], device_ids=devices),
              nn.DataParallel(nets[1], device_ids=fused_devices or devices)]
    opts = [_make(kind, m.parameters(), groups) for m in models]
    scheds = [sched.CosineAnnealingLR(o, T_max=steps) for o in opts] if schedule else []
    loss = nn.CrossEntropyLoss()
    for step in range(steps):
        X, y = batch(8, seed=step)
        opts[0].zero_grad()
        loss(models[0](mgpu.array(X, device=devices[0])),
             mgpu.array(y, device=devices[0])).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(models[0].parameters(), clip)
        opts[0].step()
        d0 = (fused_devices or devices)[0]
        models[1].train_step(mgpu.array(X, device=d0), mgpu.array(y, device=d0), loss, opts[1],
                             clip_grad_norm=clip)
        for s in scheds:
            s.step()
    return nets, opts


def assert_nets_close(a, b, label):
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if not name.endswith("num_batches_tracked"):
            close(sb[name].numpy(), sa[name].numpy(), f"{label}: {name}")


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("k", [1, 2])
def test_fused_step_equals_the_books_loop_with_clipping(kind, k):
    # max_norm 0.5 is below the gradients' norm here (checked), so the clip really scales.
    nets, opts = book_vs_fused([mgpu.cpu(i) for i in range(k)], kind, clip=0.5)
    assert_nets_close(nets[0], nets[1], f"{kind} k={k} clip 0.5")
    if kind != "sgd":
        a, b = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
        assert sorted(a) == sorted(b) and all(a[i]["step"] == b[i]["step"] == 3.0 for i in a)
        for i in a:
            close(b[i]["exp_avg_sq"].numpy(), a[i]["exp_avg_sq"].numpy(), f"{kind} v[{i}]")


def test_the_clip_really_clips_in_both_loops():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    X, y = batch(8, seed=0)
    nn.CrossEntropyLoss()(model(mgpu.array(X)), mgpu.array(y)).backward()
    norm = float(nn.utils.clip_grad_norm_(model.parameters(), 0.5))
    assert norm > 1.0  # so book_vs_fused's max_norm 0.5 scales every gradient
    # Clipped and unclipped fused steps differ: the fused clip is not a no-op.
    plain, _ = book_vs_fused([mgpu.cpu(0)], "sgd", clip=None, steps=1)
    clipped, _ = book_vs_fused([mgpu.cpu(0)], "sgd", clip=0.5, steps=1)
    w = [n[1].state_dict()["0.weight"].numpy() for n in (plain, clipped)]
    assert not np.allclose(w[0], w[1], rtol=1e-3)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fused_step_follows_a_schedule_and_parameter_groups(kind):
    nets, opts = book_vs_fused([mgpu.cpu(0), mgpu.cpu(1)], kind, schedule=True, groups=True,
                               steps=4)
    assert_nets_close(nets[0], nets[1], f"{kind} cosine schedule, two groups")
    assert [g["lr"] for g in opts[0].param_groups] == [g["lr"] for g in opts[1].param_groups]


@pytest.mark.parametrize("order", ["book, fused, book, fused", "fused, book, fused, book"])
def test_switching_between_the_books_loop_and_the_fused_step_keeps_adams_state(order):
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(n, device_ids=[mgpu.cpu(0), mgpu.cpu(1)]) for n in nets]
    opts = [_make("adamw", m.parameters()) for m in models]
    loss = nn.CrossEntropyLoss()
    for step, kind in enumerate(order.split(", ")):
        X, y = batch(8, seed=step)
        for i, m in enumerate(models):
            if i == 1 and kind == "fused":
                m.train_step(mgpu.array(X), mgpu.array(y), loss, opts[1])
                continue
            opts[i].zero_grad()
            loss(m(mgpu.array(X)), mgpu.array(y)).backward()
            opts[i].step()
        assert_nets_close(nets[0], nets[1], f"after step {step} ({kind})")
    a, b = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in a:
        assert a[i]["step"] == b[i]["step"] == 4.0
        close(b[i]["exp_avg"].numpy(), a[i]["exp_avg"].numpy(), f"exp_avg {i}")


def test_fused_lr_is_read_at_every_step():
    # lr 0 after the first step: the fused step must then leave the parameters as they are
    # (Adam's update scales with lr; AdamW's decay too).
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    opt = mgpu.optim.AdamW(model.parameters(), lr=0.01)
    X, y = batch(8)
    model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt)
    before = {k: v.numpy().copy() for k, v in net.state_dict().items() if "running" not in k}
    opt.param_groups[0]["lr"] = 0.0
    model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt)
    for k, v in before.items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(net.state_dict()[k].numpy(), v, err_msg=k)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_deterministic_fused_step_is_bitwise_the_same_on_1_2_3_devices(kind):
    results = []
    for k in (1, 2, 3):
        net = tiny_net()
        model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
        opt = _make(kind, model.parameters(), groups=True)
        s = sched.LinearLR(opt, start_factor=0.5, total_iters=2)
        for step in range(3):
            X, y = batch(9, seed=step)
            model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt,
                             deterministic=True, clip_grad_norm=0.5)
            s.step()
        results.append({n: t.numpy().copy() for n, t in net.state_dict().items()})
    for k, r in zip((2, 3), results[1:]):
        for name in r:
            np.testing.assert_array_equal(r[name], results[0][name],
                                          err_msg=f"{kind}: {name} on {k} devices vs 1")


def test_fused_step_refuses_what_it_does_not_do():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    X, y = mgpu.array(batch()[0]), mgpu.array(batch()[1])
    loss = nn.CrossEntropyLoss()
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="clip_grad_norm must be"):
        model.train_step(X, y, loss, mgpu.optim.AdamW(net.parameters()), clip_grad_norm=-1.0)
    ps = list(net.parameters())
    mixed = mgpu.optim.Adam([{"params": ps[:2], "betas": (0.8, 0.9)}, {"params": ps[2:]}])
    with pytest.raises(ValueError, match="one \\(betas, eps, amsgrad\\)"):
        model.train_step(X, y, loss, mixed)
    partly = mgpu.optim.AdamW(ps)
    ps[0].grad = mgpu.zeros(ps[0].shape)
    partly.step()  # only parameter 0 had a gradient: it alone is at step 1
    with pytest.raises(ValueError, match="same Adam step"):
        model.train_step(X, y, loss, partly)
    for k, v in net.state_dict().items():
        if k != "0.weight":  # partly.step() moved parameter 0 (the book's loop, on purpose)
            np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fused_adamw_and_clip_on_emulated_gpus_equal_the_books_loop_on_cpu(kind):
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated build), this build has {mgpu.num_gpus()}")
    nets, _ = book_vs_fused([mgpu.cpu(0), mgpu.cpu(1)], kind, clip=0.5, schedule=True,
                            fused_devices=[mgpu.gpu(0), mgpu.gpu(1)], steps=2)
    assert_nets_close(nets[0], nets[1], f"{kind} on 2 emulated GPUs vs the book's loop on CPUs")


# --- against PyTorch itself (optional) ---------------------------------------------------------

def test_against_pytorch_itself(rng):
    py = peers.torch_python()  # skips without a supported PyTorch peer (fails if one is required)
    w0 = rng.normal(size=(3, 4)).astype(np.float32)
    grads = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(4)]
    script = f"""
import json, torch
w0, grads = json.loads({json.dumps(json.dumps([w0.tolist(), [g.tolist() for g in grads]]))})
out = {{}}
for name in ("Adam", "AdamW"):
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = getattr(torch.optim, name)([p], lr=0.01, weight_decay=0.1)
    s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=4)
    lrs = []
    for g in grads:
        p.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    out[name] = [p.detach().tolist(), lrs]
print(json.dumps(out))
"""
    r = subprocess.run([py, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    for name in ("Adam", "AdamW"):
        p = nn.Parameter(mgpu.array(w0))
        opt = getattr(mgpu.optim, name)([p], lr=0.01, weight_decay=0.1)
        s = sched.OneCycleLR(opt, max_lr=0.05, total_steps=4)
        lrs = []
        for g in grads:
            p.grad = mgpu.array(g)
            nn.utils.clip_grad_norm_([p], 1.0)
            opt.step()
            s.step()
            lrs.append(opt.param_groups[0]["lr"])
        np.testing.assert_allclose(lrs, theirs[name][1], rtol=1e-12)
        np.testing.assert_allclose(p.numpy(), np.array(theirs[name][0]), rtol=1e-5, atol=1e-6)


# --- checkpoints: optimizer and schedule state resume bitwise ----------------------------------

def concise_run(tmp_path, name, crash_at=None, monkeypatch=None, fused=False, **kw):
    """train_concise on the checkpoint tests' synthetic data, 2 epochs of 5 steps on 2 devices,
    checkpointing every 2 steps into tmp_path/name (None: no checkpoints), crashing (a
    KeyboardInterrupt from the step hook) at step ``crash_at``."""
    import ckpt_worker
    if crash_at is not None:
        crash_at_step(monkeypatch, crash_at)
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
    ck = {} if name is None else dict(checkpoint=str(tmp_path / name), checkpoint_every=2,
                                      resume=True)
    mgpu.chapter.train_concise(net, 2, ckpt_worker.BATCH, 0.01, 2, data=ckpt_worker.data(),
                               progress=False, fused=fused, **ck, **kw)
    return {k: v.numpy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("fused,kw", [
    (False, dict(optimizer="adamw", schedule="cosine", warmup_epochs=1, clip_grad_norm=1.0)),
    (True, dict(optimizer="adam", weight_decay=1e-3, schedule="onecycle", clip_grad_norm=1.0)),
    (True, dict(optimizer="sgd", schedule="onecycle")),  # OneCycleLR turns SGD's momentum on
])
def test_train_concise_resumes_optimizer_and_schedule_bitwise(tmp_path, monkeypatch, fused, kw):
    ref = concise_run(tmp_path, None, fused=fused, **kw)
    with pytest.raises(KeyboardInterrupt):
        concise_run(tmp_path, "c", crash_at=7, monkeypatch=monkeypatch, fused=fused, **kw)
    monkeypatch.undo()
    state = mgpu.load(sorted((tmp_path / "c").glob("*.mgpu"))[-1])
    assert state["scheduler"]["last_epoch"] == 6 and state["step"] == 6
    got = concise_run(tmp_path, "c", fused=fused, **kw)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    # Another optimizer, or no schedule, cannot continue this run.
    from mgpu.checkpoint import CheckpointError
    other = dict(kw, optimizer="adamw" if kw["optimizer"] != "adamw" else "sgd")
    with pytest.raises(CheckpointError, match="optimizer"):
        concise_run(tmp_path, "c", fused=fused, **other)
    with pytest.raises(CheckpointError, match="schedule"):
        concise_run(tmp_path, "c", fused=fused, **dict(kw, schedule="none", warmup_epochs=0))


# --- under mpirun: the clip's norm is the reduced gradients', the same on every rank -------------

@pytest.mark.parametrize("shards", [0, 8])
def test_fused_adamw_with_clipping_under_mpirun_matches_one_process(tmp_path, shards):
    """2 ranks x 1 device take the steps of 1 process x 2 devices (AdamW, cosine schedule, clip
    0.05): the clip factor comes from the gradients summed over the ranks, so every rank updates
    alike; deterministic (8 logical shards): bitwise the steps of 1 process x 1 device."""
    import dist_worker
    from test_distributed import HAVE_MPI, load, mpirun
    if not HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")
    rc, out, err, _ = mpirun(2, "adamw_clip", tmp_path, 1, shards, timeout=120, limit=300)
    assert rc == 0, f"mpirun adamw_clip failed:\n{out}\n{err}"
    ranks = [load(tmp_path, f"adamw_clip_L1_{shards}", r) for r in range(2)]
    if shards:
        expected = dist_worker.adamw_clip_steps([mgpu.cpu(0)], shards=shards)
    else:
        expected = dist_worker.adamw_clip_steps([mgpu.cpu(0), mgpu.cpu(1)])
    for r, got in enumerate(ranks):
        assert len(got.files) == len(expected)
        for i, e in enumerate(expected):
            if shards:
                np.testing.assert_array_equal(got[f"arr_{i}"], e, err_msg=f"rank {r} state {i}")
            else:
                close(got[f"arr_{i}"], e, f"rank {r} state {i} vs 1 process x 2 devices")
            np.testing.assert_array_equal(got[f"arr_{i}"], ranks[0][f"arr_{i}"])
    # The clip binds at every step: without it (or with a looser one) the parameters differ.
    for other in (None, 0.1):
        free = dist_worker.adamw_clip_steps([mgpu.cpu(0)], shards=shards or False, clip=other)
        assert not np.allclose(free[0], expected[0], rtol=1e-3), f"clip {other}"
