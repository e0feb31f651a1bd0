"""mgpu with the peers in one process: both import orders with PyTorch 2.15 and JAX (each in a child
interpreter of the peer venv that `.ci/peers.sh` makes, importing the mgpu under test through
PYTHONPATH), and weights by name between mgpu and PyTorch: d2l's PyTorch ResNet-18, wrapped in
DataParallel, loaded into mgpu's ResNet-18 gives the same logits, and mgpu's state dict loads into
the PyTorch model with strict=True and gives mgpu's logits. Skipped without a peer, failed instead
where $MGPU_REQUIRE_PEERS names it (the test command)."""
import json
import os
import subprocess
import textwrap

import numpy as np
import pytest

import peers
from mgpu.bench import rivals

TIMEOUT = 600  # seconds for one child (imports ~5-20 s; ResNet-18 on 4 images, both ways)
PKG_ROOT = peers.PKG_ROOT
HERE = os.path.dirname(os.path.abspath(__file__))
# The CUDA libraries _core may link to, which PyTorch's wheels also bring.
SONAMES = ["libnccl.so.2", "libcudnn.so.9", "libcublas.so.13", "libcublasLt.so.13"]


def _peer_python(peer):
    if peer == "torch":
        return peers.torch_python()
    tried = []
    for py in rivals.peer_python_candidates("jax"):
        if os.path.exists(py) and subprocess.run([py, "-c", "import jax"], capture_output=True,
                                                 timeout=TIMEOUT).returncode == 0:
            return py
        tried.append(py)
    peers.skip_or_fail("jax", f"no jax peer interpreter (tried {tried}); set $MGPU_JAX_PYTHON or "
                       "run `bash .ci/peers.sh jax`")


def _run(py, script, *args):
    """The JSON the child prints last; the child's failure (an ImportError of either order
    among them) fails the test with its output."""
    r = subprocess.run([py, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                       timeout=TIMEOUT, env=peers.child_env(), cwd=HERE)
    assert r.returncode == 0, f"child failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert os.path.realpath(out["mgpu"]).startswith(os.path.realpath(PKG_ROOT) + os.sep), out
    return out


ORDER = '''
import importlib, json, os, sys
order, peer, sonames = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
for name in (["mgpu", peer] if order == "mgpu-first" else [peer, "mgpu"]):
    importlib.import_module(name)
import numpy as np
import mgpu
x = mgpu.array(np.arange(6, dtype=np.float32).reshape(2, 3))
out = {"mgpu": mgpu.__file__}
if peer == "torch":
    import torch
    y = torch.from_dlpack(x) * 2
    out["values"] = mgpu.from_dlpack(y).numpy().tolist()
    out["nccl"] = list(torch.cuda.nccl.version())  # through the NCCL torch is bound to
else:
    import jax.numpy as jnp
    out["values"] = np.asarray(jnp.from_dlpack(x) * 2).tolist()
mapped = {}
with open("/proc/self/maps") as f:
    for line in f:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path) in sonames:
            mapped.setdefault(os.path.basename(path), set()).add(os.path.realpath(path))
out["mapped"] = {k: sorted(v) for k, v in mapped.items()}
wheels = {}
for entry in sys.path:
    for name in sonames:
        for folder in ("nccl", "cudnn", "cu13", "cublas"):
            p = os.path.join(entry or ".", "nvidia", folder, "lib", name)
            if os.path.exists(p):
                wheels.setdefault(name, os.path.realpath(p))
out["wheels"] = wheels
print(json.dumps(out))
'''


@pytest.mark.parametrize("peer", ["torch", "jax"])
@pytest.mark.parametrize("order", ["mgpu-first", "peer-first"])
def test_mgpu_and_a_peer_share_one_process_in_either_import_order(peer, order):
    out = _run(_peer_python(peer), ORDER, order, peer, ",".join(SONAMES))
    assert out["values"] == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    for soname, paths in out["mapped"].items():
        # One copy of each library, and the peer's own where its wheels hold one: mgpu never
        # makes a peer bind to another copy (the toolkit's) than the one it was built for.
        assert len(paths) == 1, (soname, paths)
        if soname in out["wheels"]:
            assert paths == [out["wheels"][soname]], (soname, paths, out["wheels"][soname])
    if peer == "torch":
        assert tuple(out["nccl"]) >= (2, 0, 0), out["nccl"]


D2L = '''
import json, sys
import numpy as np
import mgpu
import torch
from torch import nn
from torch.nn import functional as F
from mgpu.models import resnet18

torch.manual_seed(0)
torch.set_num_threads(2)


class Residual(nn.Module):
    """d2l's residual block (sec. 8.6), PyTorch."""

    def __init__(self, input_channels, num_channels, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = nn.Conv2d(input_channels, num_channels, kernel_size=3, padding=1,
                               stride=strides)
        self.conv2 = nn.Conv2d(num_channels, num_channels, kernel_size=3, padding=1)
        self.conv3 = (nn.Conv2d(input_channels, num_channels, kernel_size=1, stride=strides)
                      if use_1x1conv else None)
        self.bn1 = nn.BatchNorm2d(num_channels)
        self.bn2 = nn.BatchNorm2d(num_channels)

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3:
            X = self.conv3(X)
        return F.relu(Y + X)


def resnet_block(in_channels, out_channels, num_residuals, first_block=False):
    blk = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blk.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blk)


def d2l_resnet18(num_classes, in_channels=1):
    """d2l's ResNet-18 of sec. 12.6, PyTorch."""
    net = nn.Sequential(nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU())
    net.add_module("resnet_block1", resnet_block(64, 64, 2, first_block=True))
    net.add_module("resnet_block2", resnet_block(64, 128, 2))
    net.add_module("resnet_block3", resnet_block(128, 256, 2))
    net.add_module("resnet_block4", resnet_block(256, 512, 2))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def randomise_batch_norm(net):
    """Statistics and affine parameters far from their defaults, so every buffer matters."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.num_batches_tracked.fill_(7)


X = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
out = {"mgpu": mgpu.__file__}

# PyTorch -> mgpu: DataParallel's state dict (module. names), torch tensors as they are.
theirs = d2l_resnet18(10)
randomise_batch_norm(theirs)
theirs.eval()
with torch.no_grad():
    out["torch_logits"] = theirs(torch.from_numpy(X)).numpy().tolist()
ours = resnet18(10)
tsd, osd = theirs.state_dict(), ours.state_dict()
out["same_names"] = list(tsd) == list(osd)
out["same_shapes"] = all(tuple(tsd[k].shape) == tuple(osd[k].shape) for k in tsd)
keys = ours.load_state_dict(nn.DataParallel(theirs).state_dict())
out["incompatible"] = [keys.missing_keys, keys.unexpected_keys]
ours.eval()
with mgpu.no_grad():
    out["mgpu_logits"] = ours(mgpu.array(X)).numpy().tolist()
out["count"] = int(ours.state_dict()["1.num_batches_tracked"].item())

# mgpu -> PyTorch: mgpu's state dict through DLPack, by name, strict.
mine = resnet18(10)
rng = np.random.default_rng(1)
state = {k: v.numpy() for k, v in mine.state_dict().items()}
for k in state:
    if k.endswith("running_mean"):
        state[k] = rng.uniform(-0.5, 0.5, state[k].shape).astype(np.float32)
    elif k.endswith("running_var"):
        state[k] = rng.uniform(0.5, 2.0, state[k].shape).astype(np.float32)
mine.load_state_dict(state)
mine.eval()
with mgpu.no_grad():
    out["mine_logits"] = mine(mgpu.array(X)).numpy().tolist()
back = d2l_resnet18(10)
keys = back.load_state_dict({k: torch.from_dlpack(v) for k, v in mine.state_dict().items()},
                            strict=True)
out["back_incompatible"] = [list(keys.missing_keys), list(keys.unexpected_keys)]
out["back_equal"] = all(np.array_equal(v.numpy(), back.state_dict()[k].numpy())
                        for k, v in mine.state_dict().items())
back.eval()
with torch.no_grad():
    out["back_logits"] = back(torch.from_numpy(X)).numpy().tolist()
print(json.dumps(out))
'''


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape == (4, 10), what
    assert np.abs(want).max() > 0.1, f"{what}: logits too small to tell anything: {want}"
    # float32 through 18 layers, summed in different orders by the two libraries:
    # within 1e-5 of the logits' scale (2-3e-7 measured on AVX-512); a wrong or missing
    # weight moves them by far more.
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, f"{what}: relative error {err:.2e}\n{got}\n{want}"


@pytest.fixture(scope="module")
def d2l_run():
    return _run(_peer_python("torch"), D2L)


def test_d2l_pytorch_resnet18_weights_give_the_same_logits_in_mgpu(d2l_run):
    out = d2l_run
    assert out["same_names"] and out["same_shapes"]
    assert out["incompatible"] == [[], []]
    assert out["count"] == 7
    _close(out["mgpu_logits"], out["torch_logits"], "PyTorch's weights in mgpu")


def test_mgpu_state_dict_loads_into_pytorch_by_name_strictly(d2l_run):
    out = d2l_run
    assert out["back_incompatible"] == [[], []] and out["back_equal"]
    _close(out["back_logits"], out["mine_logits"], "mgpu's weights in PyTorch")
