"""The bfloat16 tensor dtype: rounding from float32 against an independent NumPy reference (ties,
NaN, infinities, denormals, overflow, random bit patterns), exact widening, the dtype API
(``mgpu.bfloat16``, ``astype``, ``to``, ``zeros``), NumPy out with and without ml_dtypes, copies
across CPU devices and emulated GPUs, the TypeError of ops that take float32 only, and bfloat16
in checkpoints and safetensors files (read and written by the ``safetensors`` package).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import mgpu

NUM_GPUS = mgpu.num_gpus()
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__)))


def reference_bits(x):
    """bfloat16 bits of float32 ``x`` by value, in float64: the nearer of the two bfloat16
    values around x (the truncation t and the next one away from zero, t + 1), ties to the even
    one; bits 0x7f80 stand for 2^128 there, so values from halfway past the largest bfloat16 on
    overflow to infinity, as IEEE rounding does. NaN: its sign and top 7 payload bits, the quiet
    bit set."""
    x = np.asarray(x, np.float32).reshape(-1)
    out = np.empty(x.shape, np.uint16)
    for i, v in enumerate(x):
        b = int(v.view(np.uint32))
        sign, t = b & 0x80000000, (b & 0x7fffffff) >> 16
        if np.isnan(v):
            out[i] = (b >> 16) | 0x40
            continue
        if np.isinf(v):
            out[i] = b >> 16
            continue

        def value(h):  # magnitude of bfloat16 bits h (no sign), 0x7f80 read as 2^128
            return 2.0 ** 128 if h == 0x7f80 else float(np.uint32(h << 16).view(np.float32))

        lo, hi, mag = value(t), value(t + 1), abs(float(v))
        if mag - lo < hi - mag or (mag - lo == hi - mag and t % 2 == 0):
            r = t
        else:
            r = t + 1
        out[i] = (sign >> 16) | r
    return out


def widened(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def cases():
    """float32 values that probe the rounding: ties either way, near-ties, the ends of the
    range, denormals, infinities and NaNs of both signs and several payloads."""
    f = []
    for t in (0x3f80, 0x3f81, 0x4049, 0x7f7e, 0x7f7f, 0x0000, 0x0001, 0x007f, 0x0080, 0x00ff):
        for low in (0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff):
            for sign in (0, 0x80000000):
                f.append(sign | (t << 16) | low)
    f += [0x7f800000, 0xff800000,              # +-inf
          0x7fc00000, 0xffc00000, 0x7f800001,  # quiet NaNs, a signalling NaN (payload low only)
          0x7fbfffff, 0xff812345, 0x7fffffff,  # NaNs whose payload is in both halves
          0x7f7fffff, 0x7f7f7fff, 0x7f7f8000,  # the largest float32 (to inf), below/at the tie
          0x00000001, 0x807fffff, 0x00008000,  # denormals: the smallest, the largest, a tie
          0x00018000, 0x007fffff]
    bits = np.array(f, np.uint32)
    rng = np.random.default_rng(7)
    bits = np.concatenate([bits, rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)])
    return bits.view(np.float32)


def test_the_reference_is_right_on_known_values():
    # Hand-checked: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and goes to the even 1; just past
    # it goes up; 1 + 3 * 2^-8 is a tie that goes up to the even 1 + 2^-6.
    x = np.array([1.0, 1 + 2**-8, 1 + 2**-8 + 2**-20, 1 + 3 * 2**-8, -2.5, 3.4e38, 2.0**-133,
                  np.inf], np.float32)
    assert reference_bits(x).tolist() == [0x3f80, 0x3f80, 0x3f81, 0x3f82, 0xc020, 0x7f80,
                                          0x0001, 0x7f80]


@pytest.mark.parametrize("device", [mgpu.cpu(0), mgpu.cpu(1)], ids=str)
def test_rounding_matches_the_reference_bit_for_bit(device):
    x = cases()
    want = reference_bits(x)
    t = mgpu.array(x, device=device).astype(mgpu.bfloat16)
    assert t.dtype == mgpu.bfloat16 and t.shape == x.shape and t.device == device
    got = t.bits()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x[i:i + 1].view(np.uint32)[0]), hex(got[i]), hex(want[i]))
                           for i in bad[:5]]
    assert np.array_equal(mgpu.array(x, device=device, dtype=mgpu.bfloat16).bits(), want)
    # Widening is exact: the bits land in the top half of a float32, NaN payloads included.
    back = t.astype(mgpu.float32).numpy()
    assert back.dtype == np.float32
    assert np.array_equal(back.view(np.uint32), widened(want).view(np.uint32))


def test_nan_stays_nan_and_infinities_and_zeros_keep_their_sign():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    x[1] = -np.abs(x[1])
    b = mgpu.array(x).astype(mgpu.bfloat16).bits()
    assert b.tolist() == [0x7fc0, 0xffc0, 0x7f80, 0xff80, 0x0000, 0x8000]
    sneaky = np.array([0x7f800001, 0xff800001], np.uint32).view(np.float32)  # low payload only
    f = mgpu.array(sneaky).astype(mgpu.bfloat16).astype(mgpu.float32).numpy()
    assert np.isnan(f).all() and np.signbit(f).tolist() == [False, True]


def test_casts_between_every_dtype_go_through_float32():
    x = np.array([-3.7, 0.0, 1.5, 255.0, 257.0, 1e6 + 3], np.float32)
    b = mgpu.array(x, dtype=mgpu.bfloat16)
    assert np.array_equal(b.bits(), reference_bits(x))
    as_float = widened(reference_bits(x))
    assert np.array_equal(b.astype(mgpu.int64).numpy(), as_float.astype(np.int64))
    assert np.array_equal(b.astype(mgpu.int32).numpy(), as_float.astype(np.int32))
    labels = np.array([0, 3, 9, 255, 257, 1025], np.int64)  # 257 and 1025: not bfloat16 values
    got = mgpu.array(labels).astype(mgpu.bfloat16)
    assert np.array_equal(got.bits(), reference_bits(labels.astype(np.float32)))
    img = np.array([0, 1, 128, 255], np.uint8)
    assert np.array_equal(mgpu.array(img).astype(mgpu.bfloat16).astype(mgpu.uint8).numpy(), img)
    # array() of a tensor with a dtype converts; a tensor of that dtype already is itself.
    assert mgpu.array(b, dtype=mgpu.float32).dtype == mgpu.float32
    assert b.astype(mgpu.bfloat16) is b and b.astype("bfloat16") is b


def test_the_dtype_api():
    assert mgpu.bfloat16 == mgpu.bfloat16 and mgpu.bfloat16 != mgpu.float32
    assert mgpu.bfloat16.name == "bfloat16" and mgpu.bfloat16.itemsize == 2
    z = mgpu.zeros((2, 3), dtype=mgpu.bfloat16)
    assert z.dtype == mgpu.bfloat16 and z.dtype.name == "bfloat16"
    assert z.bits().tolist() == [[0] * 3] * 2
    assert mgpu.ones(4, dtype="bfloat16").bits().tolist() == [0x3f80] * 4
    assert mgpu.full((2,), -2.5, dtype=mgpu.bfloat16).bits().tolist() == [0xc020] * 2
    assert mgpu.zeros_like(z).dtype == mgpu.bfloat16
    t = mgpu.array([1.0, 2.0, 3.0])
    assert t.to(mgpu.bfloat16).dtype == mgpu.bfloat16  # PyTorch's t.to(dtype)
    assert t.to(mgpu.float32) is t and t.to(mgpu.cpu(0)) is t
    assert t.to(mgpu.cpu(1)).device == mgpu.cpu(1)
    with pytest.raises(TypeError, match="unsupported dtype float64.*bfloat16"):
        t.astype(np.float64)
    with pytest.raises(TypeError, match="bits\\(\\): only a bfloat16 tensor"):
        t.bits()
    with pytest.raises(TypeError, match="uint16"):
        mgpu.bfloat16_from_bits(np.zeros(3, np.int32))
    # Assignment into a bfloat16 tensor rounds; a bfloat16 tensor copies its bits.
    z[0] = [1.0, 1 + 2**-8 + 2**-20, -0.0]
    z[1] = mgpu.bfloat16_from_bits(np.array([0x7fc1, 1, 0xff80], np.uint16))
    assert z.bits().tolist() == [[0x3f80, 0x3f81, 0x8000], [0x7fc1, 1, 0xff80]]
    assert mgpu.full((), 3.0, dtype=mgpu.bfloat16).item() == 3.0


def test_numpy_gives_ml_dtypes_arrays_where_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = cases()
    t = mgpu.array(x, dtype=mgpu.bfloat16)
    assert mgpu.bfloat16 == np.dtype(ml_dtypes.bfloat16)
    a = t.numpy()
    assert a.dtype == ml_dtypes.bfloat16 and np.array_equal(a.view(np.uint16), t.bits())
    # ml_dtypes' own rounding agrees wherever it is defined the same (NaNs: canonical there).
    finite = ~np.isnan(x)
    assert np.array_equal(x[finite].astype(ml_dtypes.bfloat16).view(np.uint16),
                          t.bits()[finite])
    back = mgpu.array(a)  # an ml_dtypes array stays bfloat16, bit for bit
    assert back.dtype == mgpu.bfloat16 and np.array_equal(back.bits(), t.bits())
    assert mgpu.array(a, dtype=mgpu.float32).numpy().view(np.uint32).tolist() == \
        widened(t.bits()).view(np.uint32).tolist()
    assert t.astype(ml_dtypes.bfloat16) is t


def test_numpy_gives_exact_float32_values_without_ml_dtypes():
    """Where ml_dtypes cannot be imported (simulated in a fresh interpreter), mgpu.bfloat16 is
    mgpu's own marker and numpy() gives the exact values as float32; bits() the raw bits."""
    code = """
import sys
sys.modules["ml_dtypes"] = None  # import ml_dtypes now raises ImportError
import numpy as np
import mgpu
x = np.array([1.0, 1 + 2**-8 + 2**-20, -3.0e38, 2.0**-130, np.inf], np.float32)
t = mgpu.array(x, dtype=mgpu.bfloat16)
a = t.numpy()
print(repr(mgpu.bfloat16), t.dtype == "bfloat16", t.dtype == mgpu.bfloat16, a.dtype)
print(a.view(np.uint32).tolist())
print(t.bits().tolist())
print(np.asarray(t).dtype, t.astype("float32").numpy().view(np.uint32).tolist() ==
      a.view(np.uint32).tolist())
"""
    env = dict(os.environ, PYTHONPATH=PKG_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "mgpu.bfloat16 True True float32"
    bits = reference_bits(np.array([1.0, 1 + 2**-8 + 2**-20, -3.0e38, 2.0**-130, np.inf],
                                   np.float32))
    assert lines[1] == str(widened(bits).view(np.uint32).tolist())
    assert lines[2] == str(bits.tolist())
    assert lines[3] == "float32 True"


def test_copies_across_cpu_devices_keep_the_bits():
    bits = reference_bits(cases())
    t = mgpu.bfloat16_from_bits(bits, device=mgpu.cpu(0))
    u = t.to(mgpu.cpu(1))
    assert u.device == mgpu.cpu(1) and u.dtype == mgpu.bfloat16
    assert np.array_equal(u.bits(), bits)
    v = mgpu.zeros(bits.shape, device=mgpu.cpu(0), dtype=mgpu.bfloat16)
    u.copyto(v)
    assert np.array_equal(v.bits(), bits)
    w = mgpu.zeros(bits.shape, device=mgpu.cpu(1))  # float32: copy refuses another dtype
    with pytest.raises(TypeError, match="dtypes differ \\(bfloat16 into float32\\)"):
        u.copyto(w)


@pytest.mark.gpu
@pytest.mark.skipif(NUM_GPUS < 1, reason=f"needs a GPU, mgpu.num_gpus() == {NUM_GPUS} (the "
                    "emulated build has them: PYTHONPATH=build/cpp-tests/python)")
def test_gpu_casts_and_copies_match_the_cpu_bit_for_bit():
    x = cases()
    want = reference_bits(x)
    gpus = [mgpu.gpu(i) for i in range(min(NUM_GPUS, 2))]
    for g in gpus:
        t = mgpu.array(x, device=g).astype(mgpu.bfloat16)  # the cast kernel on the GPU
        assert t.device == g and np.array_equal(t.bits(), want), g
        assert np.array_equal(t.astype(mgpu.float32).numpy().view(np.uint32),
                              widened(want).view(np.uint32)), g
        assert np.array_equal(mgpu.array(x, device=g, dtype=mgpu.bfloat16).bits(), want), g
        host = t.to(mgpu.cpu(1))
        assert np.array_equal(host.bits(), want), g
        assert np.array_equal(host.to(g).bits(), want), g
        ints = mgpu.array(np.array([1, -7, 300], np.int32), device=g).astype(mgpu.bfloat16)
        assert ints.bits().tolist() == reference_bits(np.array([1, -7, 300], np.float32)).tolist()
    if len(gpus) == 2:
        assert np.array_equal(t.to(gpus[0]).to(gpus[1]).bits(), want)


def test_ops_refuse_bfloat16_with_the_fix():
    b = mgpu.ones((2, 3), dtype=mgpu.bfloat16)
    f = mgpu.ones((2, 3))
    fix = r"astype\(mgpu\.float32\).*mgpu\.autocast\('bf16'\)"
    for expr in (lambda: b + f, lambda: f * b, lambda: b * 2.0, lambda: b.sum(),
                 lambda: mgpu.relu(b), lambda: mgpu.mm(b, mgpu.ones((3, 2))),
                 lambda: b.requires_grad_()):
        with pytest.raises(TypeError, match=fix):
            expr()
    with pytest.raises(TypeError, match=r"relu: x is a bfloat16 tensor; .*" + fix):
        mgpu.relu(b)
    with pytest.raises(TypeError, match=r"bfloat16.*" + fix):
        b += 1.0


def test_checkpoints_keep_bfloat16_bit_for_bit(tmp_path):
    bits = reference_bits(cases()).reshape(-1, 4)
    obj = {"w": mgpu.bfloat16_from_bits(bits), "f": mgpu.ones(3), "n": 5}
    path = tmp_path / "c.mgpu"
    mgpu.save(obj, path)
    got = mgpu.load(path, device=mgpu.cpu(1))
    assert got["w"].dtype == mgpu.bfloat16 and got["w"].device == mgpu.cpu(1)
    assert np.array_equal(got["w"].bits(), bits) and got["n"] == 5
    assert got["f"].dtype == mgpu.float32


def test_safetensors_reads_and_writes_mgpu_bfloat16(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    bits = reference_bits(cases()[:60]).reshape(3, 20)
    path = tmp_path / "c.mgpu"
    mgpu.save({"w": mgpu.bfloat16_from_bits(bits)}, path)
    entries = dict(safetensors.deserialize(path.read_bytes()))
    assert entries["w"]["dtype"] == "BF16" and list(entries["w"]["shape"]) == [3, 20]
    assert bytes(entries["w"]["data"]) == bits.astype("<u2").tobytes()
    # A file safetensors wrote (as from PyTorch) loads as a bfloat16 tensor, bits unchanged.
    foreign = tmp_path / "hf.safetensors"
    data = np.ascontiguousarray(bits, "<u2")
    spec = safetensors.TensorSpec(dtype="bfloat16", shape=[3, 20], data_ptr=data.ctypes.data,
                                  data_len=data.nbytes)
    foreign.write_bytes(bytes(safetensors.serialize({"w": spec})))
    t = mgpu.load(foreign)["w"]
    assert t.dtype == mgpu.bfloat16 and np.array_equal(t.bits(), bits)
