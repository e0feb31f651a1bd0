"""mgpu.nn modules, nn.init, optim.SGD and models (sec. 12.6) against NumPy float64 references,
and Module's behaviour: registration, state_dict, train/eval, apply, to(device), zero_grad."""
import math

import numpy as np
import pytest

import mgpu
import reference as ref
from conftest import assert_close
from mgpu import nn

CPU0, CPU1 = mgpu.cpu(0), mgpu.cpu(1)


def f32(a):
    return np.asarray(a, dtype=np.float32)


def grads_of(module):
    return {k: p.grad.numpy() for k, p in module.named_parameters()}


# --- Module behaviour ------------------------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = nn.Parameter(mgpu.ones((2,)))
        self.register_buffer("count", mgpu.zeros((1,)))
        self.plain = 5

    def forward(self, x):
        return self.fc(x) * 1.0


def test_module_registers_parameters_buffers_and_children():
    m = Two()
    assert [k for k, _ in m.named_parameters()] == ["scale", "fc.weight", "fc.bias"]
    assert [k for k, _ in m.named_buffers()] == ["count"]
    assert list(m.children()) == [m.fc]
    assert list(m.modules()) == [m, m.fc]
    assert m.plain == 5 and "plain" not in m.state_dict()
    assert list(m.state_dict()) == ["scale", "count", "fc.weight", "fc.bias"]
    assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(TypeError, match="assign an mgpu.nn.Parameter"):
        m.scale = mgpu.ones((2,))
    with pytest.raises(TypeError, match="must be an mgpu.nn.Module"):
        m.add_module("bad", 3)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        m.nope


def test_shared_parameter_appears_once():
    lin = nn.Linear(2, 2)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    assert len(list(net.parameters())) == 2
    assert len(list(net.modules())) == 3  # net, lin, relu


def test_module_without_super_init_is_a_clear_error():
    class Bad(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="super\\(\\).__init__\\(\\)"):
        Bad()


def test_sequential_indexing_len_iteration_and_add_module():
    a, b, c = nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)
    net = nn.Sequential(a, b)
    net.add_module("head", c)
    assert len(net) == 3 and net[0] is a and net[-1] is c and list(net) == [a, b, c]
    assert list(net[1:]) == [b, c] and isinstance(net[1:], nn.Sequential)
    assert net.head is c
    with pytest.raises(IndexError):
        net[3]
    with pytest.raises(TypeError):
        net["head"]
    X = np.random.default_rng(0).normal(size=(5, 4))
    p = {k: v.numpy().astype(np.float64) for k, v in net.state_dict().items()}
    hidden = np.maximum(X @ p["0.weight"].T + p["0.bias"], 0)
    expected = hidden @ p["head.weight"].T + p["head.bias"]
    assert_close(net(mgpu.array(X)).numpy(), expected, "sum", "Sequential")


def test_apply_visits_children_first_then_self():
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    seen = []
    assert net.apply(lambda m: seen.append(type(m).__name__)) is net
    assert seen == ["Linear", "ReLU", "Linear", "Sequential", "Sequential"]


def test_apply_with_the_books_init_weights():
    mgpu.random.seed(3)
    net = nn.Sequential(nn.Conv2d(1, 64, 3), nn.Flatten(), nn.Linear(64 * 4, 100))

    def init_weights(module):
        if type(module) in [nn.Linear, nn.Conv2d]:
            nn.init.normal_(module.weight, std=0.01)

    net.apply(init_weights)
    for w in (net[0].weight.numpy(), net[2].weight.numpy()):
        assert abs(w.std() - 0.01) < 0.001 and abs(w.mean()) < 0.001
    # Biases keep their default initialisation.
    assert np.abs(net[2].bias.numpy()).max() <= 1 / math.sqrt(256) + 1e-7


def test_state_dict_round_trip_gives_the_same_outputs():
    mgpu.random.seed(0)
    a = mgpu.models.LeNet()
    mgpu.random.seed(1)
    b = mgpu.models.LeNet()
    X = mgpu.randn(3, 1, 28, 28)
    assert not np.allclose(a(X).numpy(), b(X).numpy())
    result = b.load_state_dict(a.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(a(X).numpy(), b(X).numpy())
    # Loading copies: b's parameters stay b's objects and do not alias a's memory.
    a.fc2.bias.fill_(7.0)
    assert not np.allclose(b.fc2.bias.numpy(), 7.0)
    # NumPy values load too.
    b.load_state_dict({k: v.numpy() for k, v in a.state_dict().items()})
    np.testing.assert_array_equal(b.fc2.bias.numpy(), np.full(10, 7.0, np.float32))


@pytest.mark.parametrize("change", ["missing", "unexpected", "misshaped", "not a tensor"])
def test_bad_load_state_dict_raises_and_changes_nothing(change):
    net = mgpu.models.LeNet()
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    sd = {k: v.numpy() + 1.0 for k, v in net.state_dict().items()}
    if change == "missing":
        del sd["fc1.bias"]
    elif change == "unexpected":
        sd["fc3.weight"] = np.zeros((2, 2), np.float32)
    elif change == "misshaped":
        sd["conv2.weight"] = np.zeros((50, 20, 3, 3), np.float32)
    else:
        sd["fc1.bias"] = [0.0] * 128
    err = TypeError if change == "not a tensor" else ValueError
    with pytest.raises(err, match="Nothing was loaded"):
        net.load_state_dict(sd)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


def test_load_state_dict_non_strict_reports_keys():
    net = mgpu.models.LeNet()
    sd = dict(net.state_dict())
    del sd["fc1.bias"]
    sd["extra"] = mgpu.zeros((1,))
    result = net.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["fc1.bias"] and result.unexpected_keys == ["extra"]


def test_to_device_keeps_parameter_objects_and_an_earlier_optimizer():
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Linear(3, 2))
    params = list(net.parameters())
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.5)
    before = [p.numpy() for p in params]
    assert net.to(CPU1) is net
    assert [id(p) for p in net.parameters()] == [id(p) for p in params]
    assert all(p.device == CPU1 for p in params)
    X = mgpu.array(np.ones((4, 3)), device=CPU1)
    nn.CrossEntropyLoss()(net(X), mgpu.array(np.zeros(4, np.int64), device=CPU1)).backward()
    trainer.step()
    assert all(not np.allclose(p.numpy(), b) for p, b in zip(params, before))


def test_zero_grad_to_none_and_to_zeros():
    net = nn.Linear(2, 1)
    net(mgpu.ones((3, 2))).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=False)
    assert all(np.all(p.grad.numpy() == 0) for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


# --- layers against NumPy float64 ----------------------------------------------------------------

@pytest.mark.parametrize("stride,padding,kernel", [(1, 1, 3), (2, 1, 3), (2, 0, 1), (1, 0, 2)])
def test_conv2d_module_forward_and_parameter_grads(device, rng, stride, padding, kernel):
    mgpu.random.seed(1)
    conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding).to(device)
    x = f32(rng.normal(size=(2, 3, 7, 6)))
    y = conv(mgpu.array(x, device=device))
    w, b = conv.weight.numpy(), conv.bias.numpy()
    expected = ref.conv2d_forward(x, w, b, stride, padding)
    assert_close(y.numpy(), expected, "sum", "Conv2d forward", device)
    dy = f32(rng.normal(size=expected.shape))
    y.backward(mgpu.array(dy, device=device))
    _, dw, db = ref.conv2d_backward(x, w, dy, stride, padding)
    assert_close(conv.weight.grad.numpy(), dw, "sum", "Conv2d dw", device)
    assert_close(conv.bias.grad.numpy(), db, "sum", "Conv2d db", device)


def test_conv2d_without_bias_and_bad_inputs():
    conv = nn.Conv2d(2, 3, 3, bias=False)
    assert conv.bias is None and [k for k, _ in conv.named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match="expected input \\(N, 2, H, W\\)"):
        conv(mgpu.ones((1, 3, 5, 5)))
    with pytest.raises(ValueError, match="too small"):
        conv(mgpu.ones((1, 2, 2, 2)))
    with pytest.raises(TypeError, match="NumPy array"):
        conv(np.ones((1, 2, 5, 5), np.float32))


def test_linear_module_forward_and_grads(device, rng):
    lin = nn.Linear(5, 3).to(device)
    x = f32(rng.normal(size=(4, 5)))
    xt = mgpu.array(x, device=device).requires_grad_()
    y = lin(xt)
    w, b = lin.weight.numpy().astype(np.float64), lin.bias.numpy()
    assert_close(y.numpy(), x @ w.T + b, "sum", "Linear forward", device)
    dy = f32(rng.normal(size=(4, 3)))
    y.backward(mgpu.array(dy, device=device))
    assert_close(lin.weight.grad.numpy(), dy.T.astype(np.float64) @ x, "sum", "Linear dw", device)
    assert_close(lin.bias.grad.numpy(), dy.sum(0), "sum", "Linear db", device)
    assert_close(xt.grad.numpy(), dy.astype(np.float64) @ w, "sum", "Linear dx", device)
    with pytest.raises(ValueError, match="expected input \\(N, 5\\)"):
        lin(mgpu.ones((4, 6), device=device))


def test_pooling_flatten_relu_modules(device, rng):
    x = f32(rng.normal(size=(2, 3, 4, 6)))
    xt = mgpu.array(x, device=device)
    assert_close(nn.AdaptiveAvgPool2d((1, 1))(xt).numpy(), x.mean(axis=(2, 3), keepdims=True),
                 "sum", "AdaptiveAvgPool2d", device)
    assert_close(nn.AvgPool2d(2)(xt).numpy(), ref.avg_pool2d_forward(x, 2), "sum", "AvgPool2d",
                 device)
    assert nn.Flatten()(xt).shape == (2, 72)
    assert_close(nn.ReLU()(xt).numpy(), np.maximum(x, 0), "elementwise", "ReLU", device)
    with pytest.raises(ValueError, match="only output_size \\(1, 1\\)"):
        nn.AdaptiveAvgPool2d((2, 2))


# --- initialisation -----------------------------------------------------------------------------

def test_default_init_is_pytorchs_kaiming_uniform_and_seeded():
    mgpu.random.seed(5)
    a = nn.Conv2d(16, 8, 3)
    mgpu.random.seed(5)
    b = nn.Conv2d(16, 8, 3)
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    bound = 1 / math.sqrt(16 * 9)
    w = a.weight.numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.1 * bound  # the std of U[-b, b]
    assert np.abs(a.bias.numpy()).max() <= bound


def test_init_functions():
    mgpu.random.seed(2)
    t = mgpu.zeros((200, 300))
    nn.init.xavier_uniform_(t)
    a = math.sqrt(6 / (200 + 300))
    assert np.abs(t.numpy()).max() <= a and np.abs(t.numpy()).max() > 0.99 * a
    nn.init.kaiming_uniform_(t)
    assert np.abs(t.numpy()).max() <= math.sqrt(6 / 300)
    nn.init.normal_(t, mean=2.0, std=0.5)
    assert abs(t.numpy().mean() - 2.0) < 0.01 and abs(t.numpy().std() - 0.5) < 0.01
    nn.init.zeros_(t)
    assert not t.numpy().any()
    nn.init.ones_(t)
    assert np.all(t.numpy() == 1)
    with pytest.raises(TypeError, match="expected an mgpu tensor"):
        nn.init.normal_(np.zeros(3))


# --- losses ---------------------------------------------------------------------------------------

def test_cross_entropy_loss_default_is_the_mean_like_pytorch(rng):
    logits = f32(rng.normal(size=(6, 4)))
    labels = rng.integers(0, 4, size=6)
    expected = ref.softmax_cross_entropy_forward(logits, labels)
    got = nn.CrossEntropyLoss()(mgpu.array(logits), mgpu.array(labels))
    assert got.shape == () and abs(got.item() - expected.mean()) < 1e-5
    per = nn.CrossEntropyLoss(reduction="none")(mgpu.array(logits), mgpu.array(labels))
    assert_close(per.numpy(), expected, "sum", "CrossEntropyLoss(none)")
    assert nn.SoftmaxCrossEntropyLoss()(mgpu.array(logits), mgpu.array(labels)).shape == (6,)


# --- SGD ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("momentum,dampening,weight_decay,nesterov", [
    (0.0, 0.0, 0.0, False), (0.9, 0.0, 0.0, False), (0.9, 0.0, 1e-2, False),
    (0.8, 0.3, 5e-3, False), (0.9, 0.0, 1e-2, True)])
def test_sgd_matches_pytorchs_rule_over_three_steps(rng, momentum, dampening, weight_decay,
                                                    nesterov):
    lr = 0.1
    w0 = rng.normal(size=(4, 3))
    grads = [rng.normal(size=(4, 3)) for _ in range(3)]
    p = nn.Parameter(mgpu.array(w0))
    opt = mgpu.optim.SGD([p], lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
    w, buf = w0.copy(), None
    for g_host in grads:
        p.grad = mgpu.array(g_host)
        opt.step()
        g = g_host + weight_decay * w
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        w = w - lr * g
        assert_close(p.numpy(), w, "sum", "SGD step")
    assert set(opt.state_dict()["state"]) == ({0} if momentum else set())


def test_sgd_errors_and_zero_grad():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = mgpu.optim.SGD(a.parameters(), lr=0.1)
    b(mgpu.ones((1, 2))).sum().backward()  # gradients into another network
    before = [p.numpy() for p in a.parameters()]
    with pytest.raises(ValueError, match="none of the optimizer's 2 parameters has a gradient"):
        opt.step()
    assert all(np.array_equal(p.numpy(), q) for p, q in zip(a.parameters(), before))
    with pytest.raises(TypeError, match="single tensor"):
        mgpu.optim.SGD(a.weight, lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        mgpu.optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="does not require grad"):
        mgpu.optim.SGD([mgpu.ones((2,))], lr=0.1)
    a(mgpu.ones((1, 2))).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in a.parameters())


# --- autograd through several consumers -----------------------------------------------------------

def test_gradient_sums_every_path_of_a_non_leaf(rng):
    """h feeds three consumers (relu, a product, the residual add): dL/dW must sum all paths."""
    x = f32(rng.normal(size=(4, 3)))
    w = f32(rng.normal(size=(3, 3)))
    W = mgpu.array(w).requires_grad_()
    h = mgpu.mm(mgpu.array(x), W)
    out = (mgpu.relu(h) + h * h + h).sum()
    out.backward()
    hh = x.astype(np.float64) @ w
    dh = (hh > 0) + 2 * hh + 1
    assert_close(W.grad.numpy(), x.T.astype(np.float64) @ dh, "sum", "three-path gradient")


def test_gradient_through_a_residual_block_matches_finite_differences(rng):
    """conv -> relu -> conv plus the identity shortcut: the input's gradient sums both paths."""
    mgpu.random.seed(4)
    c1, c2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
    x = rng.normal(size=(1, 2, 4, 4))
    w1, b1, w2, b2 = (t.numpy().astype(np.float64)
                      for t in (c1.weight, c1.bias, c2.weight, c2.bias))

    def f(xv):
        y = ref.conv2d_forward(np.maximum(ref.conv2d_forward(xv, w1, b1, 1, 1), 0), w2, b2, 1, 1)
        return (y + xv).sum()

    xt = mgpu.array(x).requires_grad_()
    (c2(mgpu.relu(c1(xt))) + xt).sum().backward()
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = 1e-6
        num[i] = (f(x + e) - f(x - e)) / 2e-6
    assert_close(xt.grad.numpy(), num, "sum", "residual block dx")


# --- models ---------------------------------------------------------------------------------------

def test_lenet_module_equals_the_chapters_lenet():
    params = mgpu.lenet_params(seed=0, scale=0.1)
    net = mgpu.models.LeNet.from_params(params)
    X = mgpu.randn(3, 1, 28, 28)
    assert_close(net(X).numpy(), mgpu.lenet(X, params).numpy(), "sum", "LeNet module")
    for a, b in zip(net.to_params(), params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_numpy_arrays_where_the_chapter_passes_tensors():
    params = [p.numpy() for p in mgpu.lenet_params(seed=0)]
    d = mgpu.get_params(params, CPU1)
    assert all(p.device == CPU1 and p.grad is not None for p in d)
    with pytest.raises(TypeError, match="conv2d: x is a NumPy array"):
        mgpu.conv2d(np.ones((1, 1, 5, 5), np.float32), mgpu.ones((1, 1, 3, 3)))
    with pytest.raises(TypeError, match="relu: x must be an mgpu tensor"):
        mgpu.relu([1.0, 2.0])
    with pytest.raises(TypeError, match="get_params"):
        mgpu.get_params(["w"], CPU0)
