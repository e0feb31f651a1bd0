"""The fused step's fast Adam paths: the clipping norm's sum of squares (parallel, in fixed blocks
and lanes: its documented order exactly, the float64 norm within rounding, the same bits for any
thread count), the shared update of CPU replicas for Adam, AdamW and amsgrad (bitwise the
per-replica update), deterministic mode bitwise on 1, 2 and 3 devices with a network of several
blocks, and amsgrad in the fused step against PyTorch's rule in float64, against the book's loop,
with its state shared with the optimizer and resumed bitwise from a checkpoint."""
import json

import numpy as np
import pytest

import mgpu
from conftest import assert_close
from mgpu import _core, nn
from test_data_parallel import batch, close
from test_fused_step import make, problem, residual_loss_and_grads

BLOCK = 1 << 14  # ops::kElementBlock


def blocked_sum_of_squares(x):
    """sum_squares' order in NumPy, exactly: float32 squares in float64; per block of BLOCK
    elements 16 lanes (lane l adds elements l, l + 16, ... in order), then lanes 0..7 += 8..15,
    0..3 += 4..7, 0..1 += 2..3, 0 += 1; then the blocks' sums in block order."""
    sq = (x * x).astype(np.float64)  # float32 products, as the kernel forms them
    total = 0.0
    for at in range(0, max(len(sq), 1), BLOCK):
        part = sq[at:at + BLOCK]
        rows = np.zeros(-(-len(part) // 16) * 16)  # a zero tail adds nothing (+0.0)
        rows[:len(part)] = part
        lanes = np.cumsum(rows.reshape(-1, 16), axis=0)[-1] if len(part) else np.zeros(16)
        for half in (8, 4, 2, 1):
            lanes[:half] = lanes[:half] + lanes[half:2 * half]
        total = total + lanes[0]
    return total


@pytest.mark.parametrize("n", [1, 17, BLOCK, BLOCK + 1, 5 * BLOCK + 3, 100003])
def test_sum_of_squares_is_its_documented_order_and_the_float64_norm(n):
    rng = np.random.default_rng(n)
    # Scales spread over six decades, so the order of the additions matters to the bits.
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    # The double the blocks add up to, then the op's float32 rounding of it.
    double = _core._sum_squares_blocks(x)
    assert double == blocked_sum_of_squares(x), n
    got = mgpu.Tensor(_core.sum_squares(mgpu.array(x)._t)).item()
    assert np.float32(got) == np.float32(double)
    exact = np.sum(x.astype(np.float64) ** 2)
    # Each float32 square is off by at most 2^-24 of itself, the float32 result by 2^-24 more.
    assert abs(got - exact) <= 2.5 * 2.0 ** -24 * exact, (got, exact)


def test_sum_of_squares_same_bits_for_any_thread_count():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(7 * BLOCK + 11) * 10.0 ** rng.uniform(-3, 3, 7 * BLOCK + 11))
    x = x.astype(np.float32)
    before = mgpu.num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            mgpu.set_num_threads(threads)
            got.append(_core._sum_squares_blocks(x))
    finally:
        mgpu.set_num_threads(before)
    assert got[0] == got[1] == got[2] == blocked_sum_of_squares(x)


# --- a network of several blocks through nn.DataParallel ------------------------------------

def wide_net(seed=0):
    """About 90 K parameters (6 blocks): the wide linear layer's weight spans block boundaries,
    so devices share blocks of one parameter and blocks hold the ends of several."""
    mgpu.random.seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 36, 600), nn.ReLU(), nn.Linear(600, 5))


OPTIMIZERS = {
    "adamw+clip": (lambda ps: mgpu.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-4), 0.5),
    "adamw+amsgrad+clip": (lambda ps: mgpu.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.6),
                                                       eps=1e-4, amsgrad=True), 0.5),
    "adam+l2": (lambda ps: mgpu.optim.Adam(ps, lr=0.01, weight_decay=0.01, eps=1e-4), None),
    "sgd+clip": (lambda ps: mgpu.optim.SGD(ps, lr=0.05, momentum=0.9), 0.5),
}


def fused_run(k, kind, steps=3, deterministic=False, n=12):
    """Every replica's parameters and buffers, the optimizer's state and the losses after
    ``steps`` fused steps on k CPU devices."""
    net = wide_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    make_opt, clip = OPTIMIZERS[kind]
    opt = make_opt(model.parameters())
    loss = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        X, y = batch(n, seed=step)
        losses.append(model.train_step(mgpu.array(X), mgpu.array(y), loss, opt,
                                       deterministic=deterministic, clip_grad_norm=clip).item())
    fused = model._fused
    replicas = [[t.numpy() for t in fused.replica_params[d] + fused.replica_buffers[d]]
                for d in range(k)]
    state = {(i, key): v.numpy() for i, e in opt.state_dict()["state"].items()
             for key, v in e.items() if key != "step"}
    return losses, replicas, state, net


def assert_same_bits(a, b, label):
    assert a[0] == b[0], f"{label}: losses {a[0]} vs {b[0]}"
    for d, (ra, rb) in enumerate(zip(a[1], b[1])):
        for i, (x, y) in enumerate(zip(ra, rb)):
            np.testing.assert_array_equal(x, y, err_msg=f"{label}: replica {d}, tensor {i}")
    assert sorted(a[2]) == sorted(b[2]), label
    for key in a[2]:
        np.testing.assert_array_equal(a[2][key], b[2][key], err_msg=f"{label}: state {key}")


def test_the_clip_scales_the_wide_nets_gradients():
    # max_norm 0.5 is below the first step's gradient norm, so the clip paths really scale.
    net = wide_net()
    X, y = batch(12)
    nn.CrossEntropyLoss()(net(mgpu.array(X)), mgpu.array(y)).backward()
    assert nn.utils.get_total_norm([p.grad for p in net.parameters()]) > 1.0


def _update_task_names(k, kind):
    """The names of the device tasks of one traced fused step (after one untraced)."""
    import tempfile
    net = wide_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    make_opt, clip = OPTIMIZERS[kind]
    opt = make_opt(model.parameters())
    X, y = batch(12)
    for traced in (False, True):
        if not traced:
            model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt,
                             clip_grad_norm=clip)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/step.json"
            with mgpu.profile(path):
                model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt,
                                 clip_grad_norm=clip)
            with open(path) as f:
                return {e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}


@pytest.mark.parametrize("kind", ["adamw+clip", "adamw+amsgrad+clip", "adam+l2", "sgd+clip"])
@pytest.mark.parametrize("k", [2, 3])
def test_shared_update_equals_the_per_replica_update_bitwise(k, kind, monkeypatch):
    out = {}
    for shared in (True, False):
        monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1" if shared else "0")
        out[shared] = fused_run(k, kind)
    assert_same_bits(out[True], out[False], f"{kind} on {k} devices, shared vs not")
    # The shared path really ran (and the other did not).
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1")
    name = "allreduce and sgd" if kind.startswith("sgd") else "allreduce and adam"
    assert name in _update_task_names(k, kind)
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "0")
    assert name not in _update_task_names(k, kind)


@pytest.mark.parametrize("kind", ["adamw+clip", "adamw+amsgrad+clip"])
def test_deterministic_mode_gives_the_same_bits_on_1_2_3_devices(kind):
    runs = {k: fused_run(k, kind, deterministic=True) for k in (1, 2, 3)}
    for k in (2, 3):
        one = runs[1]
        # Replica 0 of each run against the one device's (every replica holds the same).
        assert_same_bits((one[0], one[1][:1], one[2]), (runs[k][0], runs[k][1][:1], runs[k][2]),
                         f"{kind}: {k} devices vs 1")


@pytest.mark.parametrize("k", [1, 2])
def test_the_clipped_fused_step_matches_the_books_loop_on_the_wide_net(k):
    # The book's loop clips with nn.utils.clip_grad_norm_ (another summation order); the fused
    # step must agree within float tolerance, on 1 and on 2 devices (the shared update).
    books = wide_net()
    model = nn.DataParallel(books, device_ids=[mgpu.cpu(i) for i in range(k)])
    opt = OPTIMIZERS["adamw+clip"][0](model.parameters())
    loss = nn.CrossEntropyLoss()
    for step in range(3):
        X, y = batch(12, seed=step)
        opt.zero_grad()
        loss(model(mgpu.array(X)), mgpu.array(y)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    want = books.state_dict()
    fused = fused_run(k, "adamw+clip")[3].state_dict()
    for name in want:
        if not name.endswith("num_batches_tracked"):
            close(fused[name].numpy(), want[name].numpy(), f"k={k}: {name}")


# --- amsgrad --------------------------------------------------------------------------------

def amsgrad_reference(X_steps, y_steps, params, lr, betas, eps, wd, max_norm):
    """PyTorch's AdamW with amsgrad on the residual net's mean loss, float64, clipping the
    global norm first; also returns the parameters without amsgrad (to see that it matters)."""
    out = []
    for amsgrad in (True, False):
        p = [np.float64(a) for a in params]
        m = [np.zeros_like(a) for a in p]
        v = [np.zeros_like(a) for a in p]
        vmax = [np.zeros_like(a) for a in p]
        for t, (X, y) in enumerate(zip(X_steps, y_steps), start=1):
            _, g = residual_loss_and_grads(X, y, p)
            g = [gi / len(y) for gi in g]
            norm = np.sqrt(sum(np.sum(gi * gi) for gi in g))
            g = [gi * min(1.0, max_norm / (norm + 1e-6)) for gi in g]
            for i in range(len(p)):
                p[i] = p[i] * (1 - lr * wd)
                m[i] = betas[0] * m[i] + (1 - betas[0]) * g[i]
                v[i] = betas[1] * v[i] + (1 - betas[1]) * g[i] * g[i]
                vmax[i] = np.maximum(vmax[i], v[i])
                denom = np.sqrt(vmax[i] if amsgrad else v[i]) / np.sqrt(1 - betas[1] ** t) + eps
                p[i] = p[i] - lr / (1 - betas[0] ** t) * m[i] / denom
        out.append((p, vmax))
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_fused_amsgrad_matches_pytorchs_rule_in_float64(k):
    # betas (0.9, 0.6) and a new batch every step: v falls for many weights, so the maximum
    # differs from v and amsgrad's denominator really differs from Adam's.
    _, _, params = problem(6)
    steps = [problem(6, seed=s)[:2] for s in (1, 2, 3, 4)]
    Xs, ys = [s[0] for s in steps], [s[1] for s in steps]
    lr, betas, eps, wd, max_norm = 0.02, (0.9, 0.6), 1e-3, 0.1, 0.3
    (want, want_vmax), (plain, _) = amsgrad_reference(Xs, ys, params, lr, betas, eps, wd,
                                                      max_norm)
    assert max(np.max(np.abs(a - b)) for a, b in zip(want, plain)) > 1e-3
    model, replicas = make(params, [mgpu.cpu(i) for i in range(k)])
    for t, (X, y) in enumerate(zip(Xs, ys), start=1):
        model.train_step(mgpu.array(X), mgpu.array(y), lr=lr, weight_decay=wd,
                         optimizer="adamw", betas=betas, eps=eps, step=t, max_norm=max_norm,
                         amsgrad=True)
    for d in range(k):
        for i, (p, e) in enumerate(zip(replicas[d], want)):
            assert_close(p.numpy(), e, "sum", f"replica {d} param {i}")
        for i, (b, e) in enumerate(zip(model.momentum_buffers(d, 2), want_vmax)):
            assert_close(b.numpy(), e, "sum", f"replica {d} max_exp_avg_sq {i}")


def amsgrad_trainer(params):
    return mgpu.optim.AdamW(params, lr=0.01, betas=(0.9, 0.6), eps=1e-4, amsgrad=True)


@pytest.mark.parametrize("k", [1, 2])
def test_fused_amsgrad_equals_the_books_loop_and_shares_its_state(k):
    from test_data_parallel import tiny_net
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(n, device_ids=[mgpu.cpu(i) for i in range(k)]) for n in nets]
    opts = [amsgrad_trainer(m.parameters()) for m in models]
    loss = nn.CrossEntropyLoss()
    for step in range(4):
        X, y = batch(8, seed=step)
        opts[0].zero_grad()
        loss(models[0](mgpu.array(X)), mgpu.array(y)).backward()
        nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
        opts[0].step()
        models[1].train_step(mgpu.array(X), mgpu.array(y), loss, opts[1], clip_grad_norm=0.5)
    sa, sb = nets[0].state_dict(), nets[1].state_dict()
    for name in sa:
        if not name.endswith("num_batches_tracked"):
            close(sb[name].numpy(), sa[name].numpy(), f"k={k}: {name}")
    a, b = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    assert sorted(a) == sorted(b)
    fused_vmax = models[1]._fused.model.momentum_buffers(0, 2)
    for i in a:
        assert a[i]["step"] == b[i]["step"] == 4.0
        close(b[i]["max_exp_avg_sq"].numpy(), a[i]["max_exp_avg_sq"].numpy(), f"vmax {i}")
        # The optimizer's maximum is the fused step's own buffer (a view), and it bounds v.
        np.testing.assert_array_equal(b[i]["max_exp_avg_sq"].numpy(), fused_vmax[i].numpy())
        assert np.all(b[i]["max_exp_avg_sq"].numpy() >= b[i]["exp_avg_sq"].numpy())
    assert any(np.any(b[i]["max_exp_avg_sq"].numpy() > b[i]["exp_avg_sq"].numpy()) for i in b)


def test_fused_amsgrad_resumes_bitwise_from_a_checkpoint(tmp_path):
    """Two steps, a checkpoint of the network and the optimizer (mgpu.save), a new process's
    worth of objects loaded from it, two more steps: the bits of four uninterrupted steps."""
    def steps(model, opt, seeds):
        for s in seeds:
            X, y = batch(12, seed=s)
            model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), opt,
                             clip_grad_norm=0.5)

    devices = [mgpu.cpu(0), mgpu.cpu(1)]
    whole = wide_net()
    model = nn.DataParallel(whole, device_ids=devices)
    opt = amsgrad_trainer(model.parameters())
    steps(model, opt, range(4))

    first = wide_net()
    model = nn.DataParallel(first, device_ids=devices)
    opt = amsgrad_trainer(model.parameters())
    steps(model, opt, range(2))
    path = str(tmp_path / "ckpt.safetensors")
    mgpu.save({"net": first.state_dict(), "optimizer": opt.state_dict()}, path)

    state = mgpu.load(path)
    assert all("max_exp_avg_sq" in e for e in state["optimizer"]["state"].values())
    resumed = wide_net(seed=5)  # other initial weights, replaced by the checkpoint's
    resumed.load_state_dict(state["net"])
    model = nn.DataParallel(resumed, device_ids=devices)
    opt = amsgrad_trainer(model.parameters())
    opt.load_state_dict(state["optimizer"])
    steps(model, opt, range(2, 4))
    want, got = whole.state_dict(), resumed.state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)


def test_amsgrad_must_be_one_for_every_group():
    from test_data_parallel import tiny_net
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    ps = list(net.parameters())
    mixed = mgpu.optim.Adam([{"params": ps[:2], "amsgrad": True}, {"params": ps[2:]}])
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    X, y = batch()
    with pytest.raises(ValueError, match="one \\(betas, eps, amsgrad\\)"):
        model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), mixed)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
    _, _, params = problem(4)
    fused, _ = make(params, [mgpu.cpu(0)])
    X, y = problem(4)[:2]
    with pytest.raises(ValueError, match="amsgrad is a variant"):
        fused.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, amsgrad=True)


@pytest.mark.gpu
def test_fused_amsgrad_with_clipping_on_emulated_gpus_matches_the_cpu_devices():
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated build), this build has {mgpu.num_gpus()}")
    from test_data_parallel import tiny_net
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(nets[0], device_ids=[mgpu.cpu(0), mgpu.cpu(1)]),
              nn.DataParallel(nets[1], device_ids=[mgpu.gpu(0), mgpu.gpu(1)])]
    opts = [amsgrad_trainer(m.parameters()) for m in models]
    for step in range(2):
        X, y = batch(8, seed=step)
        for m, o, d in zip(models, opts, (mgpu.cpu(0), mgpu.gpu(0))):
            m.train_step(mgpu.array(X, device=d), mgpu.array(y, device=d), nn.CrossEntropyLoss(),
                         o, clip_grad_norm=0.5)
    sa, sb = nets[0].state_dict(), nets[1].state_dict()
    for name in sa:
        if not name.endswith("num_batches_tracked"):
            close(sb[name].numpy(), sa[name].numpy(), f"GPUs vs CPUs: {name}")
    a, b = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in a:
        close(b[i]["max_exp_avg_sq"].numpy(), a[i]["max_exp_avg_sq"].numpy(), f"vmax {i}")
