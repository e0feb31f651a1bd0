"""DLPack against the real PyTorch and JAX (optional: skipped, with the reason, unless a peer
interpreter is found: $MGPU_TORCH_PYTHON / $MGPU_JAX_PYTHON, else build/peers/{torch,jax}/bin/python
as ``bash .ci/peers.sh torch jax`` makes them, and only if it imports the mgpu under test).

Each peer runs one script in its own interpreter (a subprocess with a timeout; the peers' venvs
hold their framework and NumPy, never pytest). The script is a list of checks; each check asserts
what it can on its side and returns what it saw, and the whole run prints one JSON object, a check
that raised giving its traceback instead. The tests here look at each check's JSON: values and
shapes for every dtype mgpu holds, both ways; bfloat16's bits both ways against the peer's own
rounding and the NumPy reference; refused dtypes named in the error; zero copy (a
write through either side for PyTorch; the buffer address for JAX, whose arrays are immutable);
the consumer outliving the producer's Python object; an export waiting for queued work; cpu(1);
non-contiguous PyTorch tensors; and one training step fed from PyTorch tensors against the same
step fed from NumPy. Nothing is installed from here.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import peers
from mgpu.bench import rivals
from test_bfloat16 import reference_bits, widened

TIMEOUT = 300  # seconds for one peer script (an interpreter start is ~1-3 s; the checks are small)
DTYPES = ["float32", "int32", "int64", "uint8"]  # what mgpu holds
PKG_ROOT = peers.PKG_ROOT


def _find_peer(peer):
    """(interpreter, framework version) of the first candidate that imports ``peer`` and the mgpu
    under test (the same package directory), else (None, why not)."""
    tried = []
    probe = (f"import {peer}, mgpu, os; print({peer}.__version__); "
             "print(os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__))))")
    for py in rivals.peer_python_candidates(peer):
        if not os.path.exists(py):
            tried.append(f"{py} (missing)")
            continue
        try:
            r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT,
                               env=peers.child_env(), cwd=os.path.dirname(__file__))
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py} ({e})")
            continue
        lines = r.stdout.split()
        if r.returncode != 0 or len(lines) != 2:
            tried.append(f"{py} ({(r.stderr.strip().splitlines() or ['failed'])[-1]})")
        elif os.path.realpath(lines[1]) != os.path.realpath(PKG_ROOT):
            tried.append(f"{py} (imports mgpu from {lines[1]}, not {PKG_ROOT})")
        else:
            return py, lines[0]
    return None, (f"no {peer} peer interpreter that imports {peer} and this mgpu (tried "
                  + "; ".join(tried) + f"); set $MGPU_{peer.upper()}_PYTHON or run "
                  f"`bash .ci/peers.sh {peer}`")


# float32 values that probe bfloat16's rounding: ties to even both ways, near ties, overflow to
# infinity, denormals (a tie among them too), infinities, zeros of both signs and a NaN.
BF16_SOURCE = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 3.4e38,
                        -3.39e38, 2.0**-133, 3 * 2.0**-134, 1e-40, np.inf, -np.inf, 0.0, -0.0,
                        np.nan, 65504.0], np.float32)

# Shared by both peers' scripts: the runner of the checks, and the tensors they start from.
COMMON = '''
import ctypes, gc, json, sys, traceback
import numpy as np
import mgpu

DTYPES = ["float32", "int32", "int64", "uint8"]
C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
CHECKS = []


def check(f):
    CHECKS.append(f)
    return f


# The test's BF16_SOURCE, bit for bit.
BF16_SOURCE = np.frombuffer(bytes.fromhex("@BF16_SOURCE@"), np.float32)


def source(dtype):
    """A 3x4 array with distinct values (negative ones too where the dtype has them)."""
    v = np.arange(12).reshape(3, 4) * 37 - 100
    return (v % 256 if dtype == "uint8" else v).astype(dtype)


def ptr(t):
    """The address of an mgpu tensor's memory: the data field (the first) of the DLTensor its
    capsule holds (any dtype; the unused capsule frees its export)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = t.__dlpack__()  # alive while its tensor is read
    return int(ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value)


def queued(device, n=1 << 20, times=40):
    """A large tensor on ``device`` with many updates still queued: `times` everywhere."""
    t = mgpu.zeros((n,), device=device)
    for _ in range(times):
        t += 1.0
    return t


def run():
    out = {"mgpu": mgpu.__file__, "numpy": np.__version__}
    for f in CHECKS:
        try:
            out[f.__name__] = f()
        except BaseException:
            out[f.__name__] = {"error": traceback.format_exc()}
    print(json.dumps(out))
'''

TORCH = '''
import torch
VERSION = torch.__version__


@check
def torch_from_mgpu():
    """torch.from_dlpack(mgpu tensor): values, and writes seen both ways."""
    out = {}
    for dt in DTYPES:
        src = source(dt)
        m = mgpu.array(src)
        x = torch.from_dlpack(m)
        r = {"values": x.tolist(), "dtype": str(x.dtype), "shape": list(x.shape),
             "same_memory": x.data_ptr() == ptr(m)}
        x[0, 0] = 7  # written by torch, read by mgpu
        r["mgpu_sees"] = m.numpy()[0, 0].item()
        m[:] = mgpu.array(src[::-1].copy())  # written by mgpu, read by torch
        mgpu.waitall()
        r["torch_sees"] = x.tolist()
        out[dt] = r
    return out


@check
def mgpu_from_torch():
    """mgpu.from_dlpack(torch tensor): values, and writes seen both ways."""
    out = {}
    for dt in DTYPES:
        src = source(dt)
        x = torch.from_numpy(src.copy())
        m = mgpu.from_dlpack(x)
        r = {"values": m.numpy().tolist(), "dtype": str(m.dtype), "shape": list(m.shape),
             "device": str(m.device), "same_memory": x.data_ptr() == ptr(m)}
        x[0, 0] = 7
        r["mgpu_sees"] = m.numpy()[0, 0].item()
        m[:] = mgpu.array(src[::-1].copy())
        mgpu.waitall()
        r["torch_sees"] = x.tolist()
        out[dt] = r
    return out


@check
def refused_dtypes():
    out = {}
    for dt in (torch.float64, torch.float16, torch.bool, torch.int8, torch.int16,
               torch.complex64):
        try:
            mgpu.from_dlpack(torch.zeros(3, dtype=dt))
            out[str(dt)] = ["accepted", ""]
        except Exception as e:
            out[str(dt)] = [type(e).__name__, str(e)]
    return out


@check
def bfloat16():
    """torch.bfloat16 both ways (DLPack's kDLBfloat, 16 bits): shared memory, the bits kept;
    PyTorch's rounding of the same float32 values; a copy through __dlpack__(copy=True)."""
    x32 = torch.from_numpy(BF16_SOURCE.copy())
    x = x32.to(torch.bfloat16)
    m = mgpu.from_dlpack(x)
    r = {"torch_bits": (x.view(torch.int16).numpy().view(np.uint16)).tolist(),
         "in_dtype": str(m.dtype), "in_bits": m.bits().tolist(), "in_same": x.data_ptr() == ptr(m)}
    x[0] = 5.0  # written by torch, read by mgpu
    r["mgpu_sees"] = int(m.bits()[0])
    mine = mgpu.array(BF16_SOURCE, dtype=mgpu.bfloat16, device=C1)
    y = torch.from_dlpack(mine)
    r["out_dtype"] = str(y.dtype)
    r["out_bits"] = y.view(torch.int16).numpy().view(np.uint16).tolist()
    r["out_same"] = y.data_ptr() == ptr(mine)
    r["mgpu_bits"] = mine.bits().tolist()
    z = torch.from_dlpack(mine.__dlpack__(copy=True))
    r["copy_bits"] = z.view(torch.int16).numpy().view(np.uint16).tolist()
    r["copy_same"] = z.data_ptr() == ptr(mine)
    r["widened"] = z.float().numpy().view(np.uint32).tolist()
    return r


@check
def lifetime():
    """Each consumer outlives the producer's Python object; freed memory is reused meanwhile."""
    x = torch.from_dlpack(mgpu.arange(4096) * 3.0)  # the capsule holds the only reference
    gc.collect()
    junk = [mgpu.full((4096,), -7.0) for _ in range(20)]
    mgpu.waitall()
    to_torch = x.tolist()
    del junk
    y = torch.arange(4096, dtype=torch.float32) * 5.0
    m = mgpu.from_dlpack(y)
    del y
    gc.collect()
    junk = [torch.full((4096,), -7.0) for _ in range(20)]
    to_mgpu = m.numpy().tolist()
    m2 = m * 2.0  # and it still works in ops
    return {"torch": to_torch, "mgpu": to_mgpu, "mgpu_op": m2.numpy().tolist()}


@check
def pending_work():
    """An export waits for the queue: torch reads the finished values at once."""
    t = queued(C0)
    a = mgpu.ones((384, 384))
    p = mgpu.mm(a, a)
    x, y = torch.from_dlpack(t).clone(), torch.from_dlpack(p).clone()
    return {"sum": [x.min().item(), x.max().item()], "mm": [y.min().item(), y.max().item()]}


@check
def cpu1():
    """A cpu(1) tensor with queued work goes to torch as CPU memory; back through torch it is
    plain CPU memory (DLPack names one CPU), so it comes back on cpu(0), sharing the memory."""
    t = queued(C1, n=1 << 16)
    x = torch.from_dlpack(t)
    r = {"dlpack_device": list(t.__dlpack_device__()), "torch_device": str(x.device),
         "values": [x.min().item(), x.max().item()]}
    x[0] = -1.0
    r["mgpu_sees"] = t.numpy()[0].item()
    back = mgpu.from_dlpack(x)
    r["back_device"] = str(back.device)
    r["back_same_memory"] = ptr(back) == ptr(t)
    r["back_values"] = back.numpy()[:3].tolist()
    return r


@check
def non_contiguous():
    """mgpu holds only contiguous tensors: a strided torch view is refused with a clear error
    (a silent copy would break from_dlpack's sharing); contiguous views are shared. A tensor
    that requires grad is refused by PyTorch itself."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    out = {}
    for name, v in [("transpose", x.T), ("column_slice", x[:, 1:3]), ("step", x[::2]),
                    ("expand", torch.ones(1, 6).expand(4, 6)), ("column", x[:, :1]),
                    ("requires_grad", torch.ones(3, requires_grad=True))]:
        try:
            mgpu.from_dlpack(v)
            out[name] = ["accepted", ""]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    out["transpose_contiguous"] = mgpu.from_dlpack(x.T.contiguous()).numpy().tolist()
    rows = mgpu.from_dlpack(x[1:3])  # contiguous, at an offset in torch's storage
    x[1, 0] = 100.0
    out["rows"] = rows.numpy().tolist()
    row = mgpu.from_dlpack(x[2:3, :])
    out["row"] = row.numpy().tolist()
    return out


@check
def copy_keyword():
    """torch.from_dlpack(..., copy=True) gets its own memory; copy=False shares mgpu's."""
    m = mgpu.arange(3)
    own = torch.from_dlpack(m, device="cpu", copy=True)
    shared = torch.from_dlpack(m, device="cpu", copy=False)
    own[0], shared[1] = 9.0, 8.0
    mgpu.waitall()
    return {"mgpu": m.numpy().tolist(), "own": own.tolist(), "shared": shared.tolist()}


@check
def edge_shapes():
    """0-d, empty and row-sliced tensors both ways."""
    m = mgpu.arange(12).reshape(3, 4)
    return {"scalar_in": [mgpu.from_dlpack(torch.tensor(2.5)).shape,
                          mgpu.from_dlpack(torch.tensor(2.5)).item()],
            "scalar_out": [list(torch.from_dlpack(m.sum()).shape),
                           torch.from_dlpack(m.sum()).item()],
            "empty_in": list(mgpu.from_dlpack(torch.zeros(0, 3)).shape),
            "empty_out": list(torch.from_dlpack(mgpu.zeros((0, 3))).shape),
            "rows_out": torch.from_dlpack(m[1:3]).tolist()}


@check
def train_step():
    """One fused LeNet step on cpu(0)+cpu(1), fed from torch tensors via DLPack (the parameters
    too: the step updates torch's memory in place) against the same step fed from NumPy."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(32, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=32).astype(np.int64)
    init = [p.numpy() for p in mgpu.lenet_params(seed=1)]
    devices = [C0, C1]

    def step(Xm, ym, params):
        replicas = [params, mgpu.get_params(params, C1)]
        losses = mgpu.train_batch(Xm, ym, replicas, devices, 0.1, deterministic=True)
        return sum(l.item() for l in losses), replicas

    loss_np, rep_np = step(mgpu.array(X), mgpu.array(y), [mgpu.array(p) for p in init])
    tparams = [torch.from_numpy(p.copy()) for p in init]
    loss_t, rep_t = step(mgpu.from_dlpack(torch.from_numpy(X.copy())),
                         mgpu.from_dlpack(torch.from_numpy(y.copy())),
                         [mgpu.from_dlpack(p) for p in tparams])
    mgpu.waitall()
    return {"loss_numpy": loss_np, "loss_torch": loss_t,
            "params_differ": [int(np.sum(a.numpy() != b.numpy()))
                              for a, b in zip(rep_np[0] + rep_np[1], rep_t[0] + rep_t[1])],
            "torch_params_differ": [int(np.sum(a.numpy() != t.numpy()))
                                    for a, t in zip(rep_np[0], tparams)],
            "moved": [int(np.sum(a != t.numpy())) for a, t in zip(init, tparams)]}


run()
'''

JAX = '''
import jax
import jax.numpy as jnp
jax.config.update("jax_enable_x64", True)  # int64 and float64 stay what they are


def jptr(a):
    return int(a.unsafe_buffer_pointer())


@check
def jax_from_mgpu():
    """jnp.from_dlpack / jax.dlpack.from_dlpack of an mgpu tensor: values, and the address (JAX
    arrays are immutable, so zero copy shows as the same buffer, not as a write)."""
    out = {}
    for dt in DTYPES:
        m = mgpu.array(source(dt))
        a = jnp.from_dlpack(m)
        b = jax.dlpack.from_dlpack(m)
        out[dt] = {"values": np.asarray(a).tolist(), "dtype": str(a.dtype), "shape": list(a.shape),
                   "values_dlpack_module": np.asarray(b).tolist(),
                   "same_memory": jptr(a) == ptr(m)}
    return out


@check
def mgpu_from_jax():
    out = {}
    for dt in DTYPES:
        a = jnp.asarray(source(dt))
        m = mgpu.from_dlpack(a)
        cap = mgpu.from_dlpack(a.__dlpack__())  # the capsule path
        out[dt] = {"values": m.numpy().tolist(), "dtype": str(m.dtype), "shape": list(m.shape),
                   "device": str(m.device), "capsule_values": cap.numpy().tolist(),
                   "same_memory": jptr(a) == ptr(m)}
    t = jnp.arange(12, dtype=jnp.float32).reshape(3, 4).T  # JAX materialises its transposes
    out["transpose"] = mgpu.from_dlpack(t).numpy().tolist()
    return out


@check
def bfloat16():
    """jnp.bfloat16 both ways; with ml_dtypes (JAX's dependency) numpy() gives its bfloat16."""
    import ml_dtypes
    a = jnp.asarray(BF16_SOURCE).astype(jnp.bfloat16)
    m = mgpu.from_dlpack(a)
    mine = mgpu.array(BF16_SOURCE, dtype=mgpu.bfloat16)
    b = jnp.from_dlpack(mine)
    host = mine.numpy()
    return {"jax_bits": np.asarray(a).view(np.uint16).tolist(), "in_dtype": str(m.dtype),
            "in_bits": m.bits().tolist(), "in_same": jptr(a) == ptr(m),
            "out_dtype": str(b.dtype), "out_bits": np.asarray(b).view(np.uint16).tolist(),
            "mgpu_bits": mine.bits().tolist(),
            "numpy_is_ml_dtypes": host.dtype == np.dtype(ml_dtypes.bfloat16),
            "numpy_bits": host.view(np.uint16).tolist(),
            "dtype_is_ml_dtypes": mgpu.bfloat16 == np.dtype(ml_dtypes.bfloat16)}


@check
def refused_dtypes():
    out = {}
    for dt in (jnp.float64, jnp.float16, jnp.bool_, jnp.int8, jnp.complex64):
        try:
            mgpu.from_dlpack(jnp.zeros(3, dtype=dt))
            out[jnp.dtype(dt).name] = ["accepted", ""]
        except Exception as e:
            out[jnp.dtype(dt).name] = [type(e).__name__, str(e)]
    return out


@check
def lifetime():
    a = jnp.from_dlpack(mgpu.arange(4096) * 3.0)
    gc.collect()
    junk = [mgpu.full((4096,), -7.0) for _ in range(20)]
    mgpu.waitall()
    to_jax = np.asarray(a).tolist()
    del junk
    b = jnp.arange(4096, dtype=jnp.float32) * 5.0
    m = mgpu.from_dlpack(b)
    del b
    gc.collect()
    junk = [jnp.full((4096,), -7.0, dtype=jnp.float32) + i for i in range(20)]
    jax.block_until_ready(junk)
    return {"jax": to_jax, "mgpu": m.numpy().tolist(), "mgpu_op": (m * 2.0).numpy().tolist()}


@check
def pending_work():
    """An export waits for the queue: JAX reads the finished values at once (copied out right
    away, before a JAX reduction's compile time gives the queue time to finish anyway)."""
    a = np.array(jnp.from_dlpack(queued(C0)))
    c = np.array(jnp.from_dlpack(queued(C1, n=1 << 16)))
    return {"sum": [float(a.min()), float(a.max())], "cpu1": [float(c.min()), float(c.max())]}


run()
'''

SCRIPTS = {"torch": TORCH, "jax": JAX}


_RUNS = {}


def _run_peer(name):
    """(peer name, framework version, the peer script's JSON): one interpreter run per peer and
    session; skips (with the reason) without the peer."""
    if name not in _RUNS:
        py, version = _find_peer(name)
        why = peers.unsupported_torch(py, version) if name == "torch" else \
            (version if py is None else None)
        if why is not None:
            _RUNS[name] = why
        else:
            code = (textwrap.dedent(COMMON).replace("@BF16_SOURCE@", BF16_SOURCE.tobytes().hex())
                    + textwrap.dedent(SCRIPTS[name]))
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                               env=peers.child_env(), cwd=os.path.dirname(__file__))
            assert r.returncode == 0, \
                f"{name} script failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert os.path.realpath(out["mgpu"]).startswith(os.path.realpath(PKG_ROOT))
            _RUNS[name] = (name, version, out)
    if isinstance(_RUNS[name], str):
        peers.skip_or_fail(name, _RUNS[name])
    return _RUNS[name]


@pytest.fixture(params=["torch", "jax"])
def peer(request):
    return _run_peer(request.param)


@pytest.fixture
def torch_peer():
    return _run_peer("torch")


def _result(peer, check):
    name, _, out = peer
    if check not in out:
        pytest.skip(f"{name} has no check {check}")
    r = out[check]
    assert not (isinstance(r, dict) and "error" in r), f"{name} {check}:\n{r.get('error')}"
    return r


def _source(dtype):
    v = np.arange(12).reshape(3, 4) * 37 - 100
    return (v % 256 if dtype == "uint8" else v).astype(dtype)


def test_peer_to_mgpu_shares_values_and_memory(peer):
    r = _result(peer, "mgpu_from_torch" if peer[0] == "torch" else "mgpu_from_jax")
    for dt in DTYPES:
        src, got = _source(dt), r[dt]
        assert got["dtype"] == dt and got["shape"] == [3, 4] and got["device"] == "cpu(0)"
        assert np.array_equal(np.array(got["values"], dtype=dt), src), dt
        assert got["same_memory"], dt
        if peer[0] == "torch":  # writes through either side are seen by the other
            assert got["mgpu_sees"] == 7, dt
            assert np.array_equal(np.array(got["torch_sees"], dtype=dt), src[::-1]), dt
        else:
            assert np.array_equal(np.array(got["capsule_values"], dtype=dt), src), dt
    if peer[0] == "jax":
        assert r["transpose"] == np.arange(12.0).reshape(3, 4).T.tolist()


def test_mgpu_to_peer_shares_values_and_memory(peer):
    r = _result(peer, "torch_from_mgpu" if peer[0] == "torch" else "jax_from_mgpu")
    for dt in DTYPES:
        src, got = _source(dt), r[dt]
        assert got["dtype"] in (dt, f"torch.{dt}") and got["shape"] == [3, 4]
        assert np.array_equal(np.array(got["values"], dtype=dt), src), dt
        assert got["same_memory"], dt
        if peer[0] == "torch":
            assert got["mgpu_sees"] == 7, dt
            assert np.array_equal(np.array(got["torch_sees"], dtype=dt), src[::-1]), dt
        else:
            assert np.array_equal(np.array(got["values_dlpack_module"], dtype=dt), src), dt


def test_unsupported_dtypes_are_refused_by_name(peer):
    r = _result(peer, "refused_dtypes")
    assert len(r) >= 5
    for dt, (kind, msg) in r.items():
        name = dt.replace("torch.", "")
        assert kind == "TypeError", (dt, kind, msg)
        assert f"unsupported element type {name}; mgpu holds float32, bfloat16, int32, int64 " \
            "or uint8" in msg, (dt, msg)


def test_consumer_outlives_the_producers_object(peer):
    r = _result(peer, "lifetime")
    n = np.arange(4096, dtype=np.float32)
    assert r[peer[0]] == (n * 3).tolist()
    assert r["mgpu"] == (n * 5).tolist() and r["mgpu_op"] == (n * 10).tolist()


def test_export_waits_for_queued_work(peer):
    r = _result(peer, "pending_work")
    assert r["sum"] == [40.0, 40.0]
    if peer[0] == "torch":
        assert r["mm"] == [384.0, 384.0]
    else:
        assert r["cpu1"] == [40.0, 40.0]


def test_cpu1_tensor_goes_to_torch_and_back(torch_peer):
    # (JAX's import of a cpu(1) tensor is in its pending-work check.)
    r = _result(torch_peer, "cpu1")
    assert r["dlpack_device"] == [1, 0] and r["torch_device"] == "cpu"
    assert r["values"] == [40.0, 40.0] and r["mgpu_sees"] == -1.0
    assert r["back_device"] == "cpu(0)" and r["back_same_memory"]
    assert r["back_values"] == [-1.0, 40.0, 40.0]


def test_non_contiguous_torch_tensors_are_refused_clearly(torch_peer):
    # (JAX arrays are always contiguous: its transpose is in test_peer_to_mgpu_...)
    r = _result(torch_peer, "non_contiguous")
    for view in ("transpose", "column_slice", "step", "expand", "column"):
        kind, msg = r[view]
        assert kind == "ValueError" and "not contiguous" in msg and ".contiguous()" in msg, view
    # PyTorch refuses to export a tensor that requires grad; mgpu passes its reason on.
    kind, msg = r["requires_grad"]
    assert kind == "ValueError" and "refused to export" in msg and "detach()" in msg, msg
    x = np.arange(24.0).reshape(4, 6)
    assert r["transpose_contiguous"] == x.T.tolist()
    x[1, 0] = 100.0
    assert r["rows"] == x[1:3].tolist() and r["row"] == x[2:3].tolist()


def test_torch_copy_keyword_copies_or_shares(torch_peer):
    r = _result(torch_peer, "copy_keyword")
    assert r == {"mgpu": [0.0, 8.0, 2.0], "own": [9.0, 1.0, 2.0], "shared": [0.0, 8.0, 2.0]}


def test_edge_shapes_cross_both_ways(torch_peer):
    r = _result(torch_peer, "edge_shapes")
    assert r["scalar_in"] == [[], 2.5] and r["scalar_out"] == [[], 66.0]
    assert r["empty_in"] == [0, 3] and r["empty_out"] == [0, 3]
    assert r["rows_out"] == np.arange(4.0, 12.0).reshape(2, 4).tolist()


def test_bfloat16_crosses_both_ways_bit_for_bit(peer):
    r = _result(peer, "bfloat16")
    theirs = np.array(r["torch_bits" if peer[0] == "torch" else "jax_bits"], np.uint16)
    mine = np.array(r["mgpu_bits"], np.uint16)
    want = reference_bits(BF16_SOURCE)
    nan = np.isnan(BF16_SOURCE)
    # The peer's own rounding agrees with mgpu's and the reference but for NaN payloads (the
    # peers give one canonical NaN, mgpu keeps the payload's top bits).
    assert np.array_equal(mine, want)
    assert np.array_equal(theirs[~nan], want[~nan])
    assert ((theirs[nan] & 0x7f80) == 0x7f80).all() and (theirs[nan] & 0x7f).all()
    assert r["in_dtype"] == "bfloat16" and r["in_bits"] == theirs.tolist() and r["in_same"]
    assert r["out_dtype"] in ("torch.bfloat16", "bfloat16") and r["out_bits"] == mine.tolist()
    if peer[0] == "torch":
        assert r["out_same"] and r["mgpu_sees"] == 0x40a0  # torch's write of 5.0, seen by mgpu
        assert r["copy_bits"] == mine.tolist() and not r["copy_same"]
        assert r["widened"] == widened(mine).view(np.uint32).tolist()
    else:
        assert r["dtype_is_ml_dtypes"] and r["numpy_is_ml_dtypes"]
        assert r["numpy_bits"] == mine.tolist()


def test_training_step_fed_from_torch_matches_numpy(torch_peer):
    r = _result(torch_peer, "train_step")
    assert np.isfinite(r["loss_numpy"]) and r["loss_numpy"] > 0
    assert r["loss_torch"] == r["loss_numpy"]  # deterministic=True: bitwise the same step
    assert r["params_differ"] == [0] * 16 and r["torch_params_differ"] == [0] * 8
    assert all(m > 0 for m in r["moved"][::2])  # the step updated torch's weights in place



def test_a_peer_is_used_only_if_it_imports_the_mgpu_under_test(monkeypatch, tmp_path):
    monkeypatch.setenv("MGPU_TORCH_PYTHON", str(tmp_path / "missing" / "python"))
    py, why = _find_peer("torch")
    assert py is None and "missing" in why and "$MGPU_TORCH_PYTHON" in why
    assert "bash .ci/peers.sh torch" in why
    # An interpreter that imports torch but some other mgpu is not used either.
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nprint('9.9-fake')\nprint('/elsewhere')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MGPU_TORCH_PYTHON", str(fake))
    py, why = _find_peer("torch")
    assert py is None and f"imports mgpu from /elsewhere, not {PKG_ROOT}" in why
    fake.write_text(f"#!{sys.executable}\nprint('9.9-fake')\nprint({PKG_ROOT!r})\n")
    assert _find_peer("torch") == (str(fake), "9.9-fake")
