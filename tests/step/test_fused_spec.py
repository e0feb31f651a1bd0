"""The fused step's layer list (mgpu.fused_spec): the spec emitted for a network holding every
module class the step runs, and for a residual block, pinned against tuples written out by hand
(slot 0 is the input, layer i writes slot i + 1); the modules it refuses, each named in the error
with the whole emit table."""
import pytest

import mgpu
from mgpu import fused_spec, nn
from mgpu.models import Residual

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


def every_module():
    """Every emit in the table, on (N, 2, 8, 8) images: 8x8 -> 4x4 -> 2x2 -> 1x1 -> 3 classes."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),                     # params 0, 1
        nn.BatchNorm2d(4),                                           # params 2, 3; buffers 0, 1
        nn.ReLU(),
        Residual(4, 4),              # conv1 4, 5; conv2 6, 7; bn1 8, 9 (2, 3); bn2 10, 11 (4, 5)
        Residual(4, 6, use_1x1conv=True, strides=2),   # conv1 12, 13; conv2 14, 15; conv3 16, 17;
                                                       # bn1 18, 19 (6, 7); bn2 20, 21 (8, 9)
        nn.SyncBatchNorm(6, eps=1e-3, momentum=0.2),                 # params 22, 23; buffers 10, 11
        nn.BatchNorm2d(6, affine=False),                             # buffers 12, 13
        nn.MaxPool2d(3, stride=1, padding=1),
        nn.AvgPool2d(2),
        nn.Dropout(0.0),                                             # the identity: no layer
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.25), nn.Linear(5, 3, bias=False)))


def bn(src, params, buffers, eps=1e-5, momentum=0.1, affine=True, sync=False):
    return ("batch_norm", {"in": src, "params": params, "buffers": buffers, "eps": eps,
                           "momentum": momentum, "affine": affine, "sync": sync})


def conv(src, params, stride, padding, bias=True):
    return ("conv2d", {"in": src, "params": params, "stride": stride, "padding": padding,
                       "bias": bias})


def plain(kind, src, **opts):
    return (kind, dict({"in": src, "params": []}, **opts))


EVERY_SPEC = [
    conv(0, [0, 1], 2, 1),                                   # -> slot 1
    bn(1, [2, 3], [0, 1]),                                   # 2
    plain("relu", 2),                                        # 3
    conv(3, [4, 5], 1, 1),                                   # 4  the first block: conv1
    bn(4, [8, 9], [2, 3]),                                   # 5  bn1
    plain("relu", 5),                                        # 6
    conv(6, [6, 7], 1, 1),                                   # 7  conv2
    bn(7, [10, 11], [4, 5]),                                 # 8  bn2
    ("add", {"in": [8, 3]}),                                 # 9  the identity shortcut
    plain("relu", 9),                                        # 10
    conv(10, [12, 13], 2, 1),                                # 11 the second block: conv1
    bn(11, [18, 19], [6, 7]),                                # 12
    plain("relu", 12),                                       # 13
    conv(13, [14, 15], 1, 1),                                # 14 conv2
    bn(14, [20, 21], [8, 9]),                                # 15
    conv(10, [16, 17], 2, 0),                                # 16 conv3, the 1x1 shortcut
    ("add", {"in": [15, 16]}),                               # 17
    plain("relu", 17),                                       # 18
    bn(18, [22, 23], [10, 11], eps=1e-3, momentum=0.2, sync=True),  # 19 SyncBatchNorm
    bn(19, [], [12, 13], affine=False),                      # 20
    plain("max_pool2d", 20, kernel=3, stride=1, padding=1),  # 21
    plain("avg_pool2d", 21, kernel=2, stride=2),             # 22 (Dropout(0.0) emits nothing)
    plain("global_avg_pool", 22),                            # 23
    plain("flatten", 23),                                    # 24
    ("linear", {"in": 24, "params": [24, 25], "bias": True, "transpose": True,  # 25
                "round_db": True}),
    plain("dropout", 25, p=0.25),                            # 26
    ("linear", {"in": 26, "params": [26], "bias": False, "transpose": True,     # 27
                "round_db": True}),
]


def _built(net, bf16=False):
    b = fused_spec.SpecBuilder(list(net.parameters()), bf16=bf16)
    out = b.emit(net, 0)
    return b, out


def _running(*bns):
    return [t for m in bns for t in (m.running_mean, m.running_var)]


def test_every_supported_module_emits_its_layers():
    net = every_module()
    b, out = _built(net)
    assert b.spec == EVERY_SPEC
    assert out == len(EVERY_SPEC)
    assert b.dropout
    want = _running(net[1], net[3].bn1, net[3].bn2, net[4].bn1, net[4].bn2, net[5], net[6])
    assert len(b.buffers) == len(want) and all(x is y for x, y in zip(b.buffers, want))


def test_data_parallel_builds_its_fused_model_from_that_spec():
    net = every_module()
    dp = nn.DataParallel(net, device_ids=[C0, C1])
    fused = dp._fused_model()
    assert fused.spec == EVERY_SPEC and fused.dropout
    assert all(x is y for x, y in zip(fused.replica_buffers[0], _built(net)[0].buffers))


def test_every_emitted_kind_and_option_is_one_the_engines_records_take():
    """The emits and the C++ records (_core.layer_kinds) agree: each emitted kind is a record a
    spec may name, each option one it takes ("in", "params", "buffers" place the layer)."""
    records = dict(mgpu._core.layer_kinds())
    placing = {"in", "params", "buffers"}
    for kind, opts in _built(every_module(), bf16=True)[0].spec:
        assert kind in records, kind
        assert set(opts) - placing <= set(records[kind]), (kind, opts, records[kind])
    assert {k for k, o in records.items() if "bf16" in o} == {"conv2d", "conv2d_relu_pool",
                                                                "linear"}


def test_a_residual_block_alone_in_bf16():
    """A block at the root, shortcut a 1x1 convolution; bf16 marks the convolutions only."""
    block = Residual(3, 5, use_1x1conv=True, strides=2)  # conv1 0, 1; conv2 2, 3; conv3 4, 5;
    b, out = _built(block, bf16=True)                    # bn1 6, 7; bn2 8, 9
    bf = {"bf16": True}
    assert b.spec == [
        ("conv2d", dict(conv(0, [0, 1], 2, 1)[1], **bf)),
        bn(1, [6, 7], [0, 1]),
        plain("relu", 2),
        ("conv2d", dict(conv(3, [2, 3], 1, 1)[1], **bf)),
        bn(4, [8, 9], [2, 3]),
        ("conv2d", dict(conv(0, [4, 5], 2, 0)[1], **bf)),
        ("add", {"in": [5, 6]}),
        plain("relu", 7),
    ]
    assert out == 8 and not b.dropout
    assert all(x is y for x, y in zip(b.buffers, _running(block.bn1, block.bn2)))


def test_bf16_marks_the_products_only():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2, 2))
    kinds = [(kind, opts.get("bf16")) for kind, opts in _built(net, bf16=True)[0].spec]
    assert kinds == [("conv2d", True), ("relu", None), ("flatten", None), ("linear", True)]
    assert all("bf16" not in opts for _, opts in _built(net)[0].spec)


class _Conv(nn.Conv2d):
    pass


class _Linear(nn.Linear):
    pass


class _BatchNorm(nn.BatchNorm2d):
    pass


class _Block(Residual):
    pass


class _Identity(nn.Module):
    def forward(self, x):
        return x


def test_subclasses_of_conv2d_and_linear_are_taken():
    net = nn.Sequential(_Conv(1, 2, 3, padding=1), nn.Flatten(), _Linear(8, 2))
    assert [kind for kind, _ in _built(net)[0].spec] == ["conv2d", "flatten", "linear"]


REFUSED = [  # (the class the error names, a module of it the step cannot run)
    ("BatchNorm2d", lambda: nn.BatchNorm2d(3, track_running_stats=False)),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(3, momentum=None)),
    ("SyncBatchNorm", lambda: nn.SyncBatchNorm(3, momentum=None)),
    ("BatchNorm1d", lambda: nn.BatchNorm1d(3)),
    ("_BatchNorm", lambda: _BatchNorm(3)),  # batch norm and Residual: exactly those classes
    ("_Block", lambda: _Block(3, 3)),
    ("AvgPool2d", lambda: nn.AvgPool2d((2, 3))),
    ("AvgPool2d", lambda: nn.AvgPool2d(2, (1, 2))),
    ("MaxPool2d", lambda: nn.MaxPool2d((2, 3))),
    ("MaxPool2d", lambda: nn.MaxPool2d(3, 1, (1, 0))),
    ("MaxPool2d", lambda: nn.MaxPool2d(2, (2, 1))),
    ("_Identity", _Identity),
]


@pytest.mark.parametrize("name,make", REFUSED, ids=[f"{i}-{n}" for i, (n, _) in
                                                   enumerate(REFUSED)])
def test_a_module_the_step_cannot_run_is_refused_naming_every_emit(name, make):
    net = nn.Sequential(nn.ReLU(), make())
    with pytest.raises(NotImplementedError) as e:
        _built(net)
    message = str(e.value)
    assert message.startswith(f"train_step: the fused step has no layer for {name}; "
                              "supported are ")
    table = fused_spec.emitted_classes()
    assert {c.__name__ for c in table} == {
        "Sequential", "Conv2d", "BatchNorm2d", "SyncBatchNorm", "ReLU", "Flatten",
        "AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d", "Dropout", "Linear", "Residual"}
    listed = message.split("supported are ")[1]
    for cls in table:
        assert cls.__name__ in listed, cls
    assert "models.Residual" in listed and "MaxPool2d (square)" in listed
    assert "BatchNorm1d" not in listed
    assert "SyncBatchNorm (with running statistics and a momentum)" in listed
    assert listed.endswith("; use the book's loop for other modules")


def test_a_refused_module_leaves_data_parallel_to_the_book_loop():
    dp = nn.DataParallel(nn.Sequential(nn.Flatten(), nn.Linear(4, 2), _Identity()),
                         device_ids=[C0])
    X, y = mgpu.ones((2, 1, 2, 2)), mgpu.array([0, 1])
    with pytest.raises(NotImplementedError, match="no layer for _Identity"):
        dp.train_step(X, y, nn.CrossEntropyLoss(), mgpu.optim.SGD(dp.parameters(), lr=0.1))
    nn.CrossEntropyLoss()(dp(X), y).backward()  # the book's loop runs it
