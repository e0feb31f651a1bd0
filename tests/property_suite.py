"""Property-based checks of mgpu with Hypothesis, run by test_properties.py in a child process so
a crash (a signal, an abort) is reported with the example that caused it.

Usage: python property_suite.py GROUP EXAMPLES. Before each example the child writes it to stderr
("TRY <example>"), so the parent can name the last one if the child dies; at the end it prints
"TRIED <n>" (examples run) on stdout. GROUPs: elementwise, inplace, bad_args, idx_fuzz,
ckpt_fuzz.
"""
import gzip
import hashlib
import json
import operator
import os
import struct
import sys
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mgpu
from mgpu import _core, parallel

DEVICES = [mgpu.cpu(0), mgpu.cpu(1)] + ([mgpu.gpu(0)] if mgpu.num_gpus() > 0 else [])
CLEAN = (TypeError, ValueError, IndexError, MemoryError)
tried = 0


def announce(*example) -> None:
    global tried
    tried += 1
    print("TRY", *[repr(e) for e in example], file=sys.stderr, flush=True)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
devices = st.sampled_from(DEVICES)
ops = st.sampled_from(["+", "-", "*", "/"])


def np_op(op, a, b):
    return {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide}[op](a, b)


def py_op(op, a, b):
    """Python's operator (so mgpu's __add__/__radd__... run, never NumPy's ufuncs)."""
    return {"+": operator.add, "-": operator.sub, "*": operator.mul,
            "/": operator.truediv}[op](a, b)


def values(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 2.0, shape).astype(np.float32) * rng.choice([-1, 1], shape)


def as_view(a: np.ndarray, device, pad: int, dtype=np.float32):
    """``a`` (as ``dtype``) on ``device`` as rows [pad, pad + n) of a bigger tensor (a view), or
    as itself."""
    if pad == 0 or a.ndim == 0:
        return mgpu.array(a.astype(dtype), device=device, dtype=dtype)
    big = np.concatenate([np.full((pad,) + a.shape[1:], 7, np.float32), a,
                          np.full((1,) + a.shape[1:], 9, np.float32)])
    return mgpu.array(big.astype(dtype), device=device, dtype=dtype)[pad:pad + a.shape[0]]


# The dtypes mgpu tensors hold; the arithmetic ops take float32 only and refuse the others with a
# TypeError naming the operand (float32 is drawn more often: it is the one that computes).
DTYPES = [np.float32, np.float32, np.float32, np.int32, np.int64, np.uint8]


def close(got, expected):
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True), (got, expected)


CFG = dict(deadline=None, derandomize=True, database=None,
           suppress_health_check=list(HealthCheck))


def group_elementwise(n):
    @settings(max_examples=n, **CFG)
    @given(shapes, ops, devices, st.sampled_from(["same", "row", "scalar", "rscalar"]),
           st.integers(0, 3), st.integers(0, 2**31), st.sampled_from(DTYPES),
           st.sampled_from(DTYPES))
    def check(shape, op, device, kind, pad, seed, dtype_a, dtype_b):
        scalar = kind in ("scalar", "rscalar")
        announce(shape, op, device, kind, pad, seed, dtype_a.__name__,
                 None if scalar else dtype_b.__name__)
        a = values(shape, seed)
        ta = as_view(a, device, pad, dtype_a)
        if scalar:
            s = float(values((), seed + 1))
            call = (lambda: py_op(op, ta, s)) if kind == "scalar" else (lambda: py_op(op, s, ta))
            want = np_op(op, a.astype(np.float64), s) if kind == "scalar" else \
                np_op(op, s, a.astype(np.float64))
            dtypes = [dtype_a]
        else:
            bshape = shape if kind == "same" or len(shape) < 2 else shape[-1:]
            b = values(bshape, seed + 2)
            tb = as_view(b, device, pad if kind == "same" else 0, dtype_b)
            call = lambda: py_op(op, ta, tb)  # noqa: E731
            want = np_op(op, a.astype(np.float64), b.astype(np.float64))
            dtypes = [dtype_a, dtype_b]
        if any(d != np.float32 for d in dtypes):
            try:
                call()
            except TypeError as e:
                assert "float32" in str(e), e
                return
            raise AssertionError(f"{op} on {[d.__name__ for d in dtypes]} did not raise")
        got = call()
        close(got.numpy(), want.astype(np.float32))
        assert got.device == device and got.dtype == np.float32
    check()


def group_inplace(n):
    @settings(max_examples=n, **CFG)
    @given(st.integers(1, 8), st.integers(0, 3), ops, devices, st.data())
    def check(rows, cols, op, device, data):
        length = data.draw(st.integers(0, rows), label="length")
        dst = data.draw(st.integers(0, rows - length), label="dst")
        src = data.draw(st.integers(0, rows - length), label="src")
        row_src = data.draw(st.booleans(), label="row_src") and cols > 0
        announce(rows, cols, op, device, length, dst, src, row_src)
        base = values((rows, cols), rows * 31 + cols)
        a = base.copy()
        t = mgpu.array(base, device=device)
        if row_src:  # a[dst:dst+length] op= a[src] (a row broadcast, overlapping the target)
            src_np, src_t = a[src % rows], t[src % rows]
        else:
            src_np, src_t = a[src:src + length], t[src:src + length]
        target_np = a[dst:dst + length]
        expected = np_op(op, target_np, src_np.copy())  # NumPy's semantics: source read first
        a[dst:dst + length] = expected
        view = t[dst:dst + length]
        if op == "+":
            view += src_t
        elif op == "-":
            view -= src_t
        elif op == "*":
            view *= src_t
        else:
            view /= src_t
        close(t.numpy(), a)
    check()


# --- random bad arguments: each call must succeed or raise one of CLEAN ---------------------------

junk = st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-2**70, 2**70),
                 st.text(max_size=3), st.booleans(), st.just(np.zeros(2)), st.just([1, "a"]),
                 st.just((2.5, 3)), st.just(-1), st.just(2**62), st.just(2**63), st.just(2**64))
extent = st.one_of(st.integers(-3, 6), st.sampled_from([2**31, 2**32, 2**62, 2**62 + 1, 2**63 - 1]))
bad_shape = st.one_of(st.lists(extent, max_size=4).map(tuple), junk)


# The tensors the calls below may change: a call that raises must leave them as they were.
STATE = {}


def calls():
    """(description, thunk) pairs of API calls with random, mostly bad, arguments."""
    C0 = mgpu.cpu(0)
    STATE.update(t6=mgpu.arange(6), t23=mgpu.ones((2, 3)), p=mgpu.ones(3).attach_grad(),
                 lenet=mgpu.lenet_params(seed=0))
    x4 = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 9), st.integers(0, 9))
    return st.one_of(
        st.tuples(st.just("zeros"), bad_shape).map(lambda a: (a, lambda: mgpu.zeros(a[1]))),
        st.tuples(st.just("ones"), bad_shape, st.sampled_from(["float32", "int64", "uint8"])).map(
            lambda a: (a, lambda: mgpu.ones(a[1], dtype=a[2]))),
        st.tuples(st.just("reshape"), bad_shape).map(
            lambda a: (a, lambda: mgpu.arange(24).reshape(a[1]))),
        st.tuples(st.just("getitem"), junk).map(lambda a: (a, lambda: mgpu.arange(6)[a[1]])),
        st.tuples(st.just("setitem"), junk, junk).map(
            lambda a: (a, lambda: STATE["t6"].__setitem__(a[1], a[2]))),
        st.tuples(st.just("binary"), junk).map(lambda a: (a, lambda: mgpu.ones((2, 3)) + a[1])),
        st.tuples(st.just("inplace"), junk).map(
            lambda a: (a, lambda: STATE["t23"].__iadd__(a[1]))),
        st.tuples(st.just("conv2d"), x4, x4, extent, extent).map(
            lambda a: (a, lambda: mgpu.conv2d(mgpu.ones(a[1]), mgpu.ones(a[2]), stride=a[3],
                                              padding=a[4]).numpy())),
        st.tuples(st.just("avg_pool2d"), x4, extent, extent).map(
            lambda a: (a, lambda: mgpu.avg_pool2d(mgpu.ones(a[1]), a[2], a[3]).numpy())),
        st.tuples(st.just("cross_entropy"), st.integers(0, 4), st.integers(0, 4),
                  st.lists(st.integers(-2**40, 2**40), max_size=5)).map(
            lambda a: (a, lambda: mgpu.cross_entropy(
                mgpu.ones((a[1], a[2])), mgpu.array(np.array(a[3], dtype=np.int64))).numpy())),
        st.tuples(st.just("mm"), bad_shape, bad_shape).map(
            lambda a: (a, lambda: mgpu.mm(mgpu.ones(a[1]), mgpu.ones(a[2])).numpy())),
        st.tuples(st.just("seed"), junk).map(lambda a: (a, lambda: mgpu.random.seed(a[1]))),
        st.tuples(st.just("set_num_threads"), junk).map(
            lambda a: (a, lambda: mgpu.set_num_threads(a[1]))),
        st.tuples(st.just("device"), junk).map(lambda a: (a, lambda: mgpu.cpu(a[1]))),
        st.tuples(st.just("sgd"), junk, junk).map(
            lambda a: (a, lambda: parallel.sgd([STATE["p"]], a[1], a[2]))),
        st.tuples(st.just("train_batch"), junk, junk).map(
            lambda a: (a, lambda: parallel.train_batch(
                a[1], mgpu.array(np.arange(4)), [STATE["lenet"]], [C0], a[2]))),
        st.tuples(st.just("split_batch"), junk).map(
            lambda a: (a, lambda: parallel.split_batch(mgpu.ones((4, 2)), mgpu.ones(4), a[1]))),
        st.tuples(st.just("array_loader"), junk, junk).map(
            lambda a: (a, lambda: mgpu.data.array_loader(np.zeros((4, 2, 2)), np.zeros(4),
                                                         a[1], seed=a[2]))),
        st.tuples(st.just("copyto"), junk).map(lambda a: (a, lambda: mgpu.ones(2).copyto(a[1]))),
        st.tuples(st.just("from_dlpack"), junk).map(lambda a: (a, lambda: mgpu.from_dlpack(a[1]))),
    )


def group_bad_args(n):
    threads = mgpu.num_threads()

    @settings(max_examples=n, **CFG)
    @given(calls())
    def check(call):
        description, thunk = call
        announce(description)
        tensors = [STATE["t6"], STATE["t23"], STATE["p"], *STATE["lenet"]]
        before = [t.numpy().copy() for t in tensors]
        try:
            thunk()
        except CLEAN:
            # A refused call changes nothing (a Python exception at the call, not at the wait).
            for t, b in zip(tensors, before):
                assert np.array_equal(t.numpy(), b, equal_nan=True), f"{description} changed state"
        finally:
            try:
                mgpu.waitall()  # an asynchronous failure must be clean too
            except CLEAN:
                pass
            if mgpu.num_threads() != threads:
                mgpu.set_num_threads(threads)
    check()


# --- the IDX reader on mutated files ------------------------------------------------------------

def idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def group_idx_fuzz(n):
    valid = idx_bytes(np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5))
    folder = tempfile.mkdtemp(prefix="mgpu-idx-fuzz-")
    path = os.path.join(folder, "f-idx3-ubyte")

    @settings(max_examples=n, **CFG)
    @given(st.lists(st.tuples(st.integers(0, len(valid) + 8), st.integers(0, 255)), max_size=6),
           st.integers(0, len(valid) + 8), st.booleans(), st.binary(max_size=8))
    def check(edits, cut, compress, tail):
        data = bytearray(valid)
        for pos, byte in edits:
            if pos < len(data):
                data[pos] = byte
        data = bytes(data[:cut]) + tail
        if compress:
            data = gzip.compress(data)
            if edits:  # damage the compressed stream too
                pos, byte = edits[0]
                data = data[:pos % len(data)] + bytes([byte]) + data[pos % len(data) + 1:]
        announce(edits, cut, compress, tail)
        with open(path, "wb") as f:
            f.write(data)
        try:
            a = _core.read_idx(path)
            assert isinstance(a, np.ndarray) and a.dtype == np.uint8
            assert a.size * a.itemsize <= len(data) * (1 if not compress else 1032)
        except (ValueError, OSError, EOFError):
            pass
    check()


# --- the checkpoint reader on mutated files ------------------------------------------------------

def resign(data: bytes) -> bytes:
    """``data`` with its header length and checksum made right again (as mgpu.save computes
    them), so the reader gets past the checksum to the header's and the tree's contents."""
    from mgpu import checkpoint as ck
    (n,) = struct.unpack_from("<Q", data, 0)
    header, body = data[8:8 + n], data[8 + n:]
    at = header.find(b"sha256:")
    if at < 0 or len(header) < at + len(ck._CHECKSUM_PLACEHOLDER):
        return data
    header = header[:at] + ck._CHECKSUM_PLACEHOLDER.encode() + header[at + 71:]
    digest = hashlib.sha256(struct.pack("<Q", len(header)) + header + body).hexdigest()
    header = header[:at] + f"sha256:{digest}".encode() + header[at + 71:]
    return struct.pack("<Q", len(header)) + header + body


# What a damaged header may hold in place of a value: JSON of every kind, odd numbers included.
json_junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.sampled_from([0, 1, -1, 4, 2**31, 2**32, 2**62, 2**63, 2**64]),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
              st.sampled_from(["F32", "I64", "U8", "BOOL", "F16", "x", "__tensor__", "w"])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["__tensor__", "__ndarray__", "__tuple__", "__float__", "__dict__", "w",
                         "a"]), inner, max_size=2),
    max_leaves=6)


def group_ckpt_fuzz(n):
    """Raw damage (bytes changed, the file cut, a tail added: the checksum must refuse it) and
    re-signed damage (a header field or the stored tree replaced by arbitrary JSON, the checksum
    made right again): mgpu.load returns an object or raises CheckpointError, nothing else."""
    from mgpu import checkpoint as ck
    folder = tempfile.mkdtemp(prefix="mgpu-ckpt-fuzz-")
    good = os.path.join(folder, "good.mgpu")
    mgpu.save({"w": mgpu.array(np.arange(6, dtype=np.float32).reshape(2, 3)),
               "raw": np.arange(4, dtype=np.int64), "pair": (1, "two", None),
               "state": {0: {"m": mgpu.array(np.full(2, -0.5, np.float32))}},
               "nan": float("nan"), "zero": np.zeros((0, 3), np.float32)}, good)
    valid = open(good, "rb").read()
    (hn,) = struct.unpack_from("<Q", valid, 0)
    header = json.loads(valid[8:8 + hn])
    names = sorted(k for k in header if k != "__metadata__")
    path = os.path.join(folder, "f.mgpu")

    @settings(max_examples=n, **CFG)
    @given(st.sampled_from(["bytes", "entry", "tree"]),
           st.lists(st.tuples(st.integers(0, len(valid) + 8), st.integers(0, 255)), max_size=4),
           st.integers(0, len(valid) + 8), st.binary(max_size=8),
           st.sampled_from(names), st.sampled_from(["dtype", "shape", "data_offsets", "*"]),
           json_junk, st.booleans())
    def check(kind, edits, cut, tail, name, field, junk_value, whole_tree):
        if kind == "bytes":  # the checksum (or the length) must catch it
            data = bytearray(valid)
            for pos, byte in edits:
                if pos < len(data):
                    data[pos] = byte
            data = bytes(data[:cut]) + tail
        else:
            h = json.loads(valid[8:8 + hn])
            if kind == "entry":
                if field == "*":
                    h[name] = junk_value
                else:
                    h[name][field] = junk_value
            else:
                tree = json.loads(h["__metadata__"]["tree"])
                if whole_tree or not isinstance(tree, dict):
                    tree = junk_value
                else:
                    tree[sorted(tree)[len(edits) % len(tree)]] = junk_value
                h["__metadata__"]["tree"] = json.dumps(tree)
            text = json.dumps(h, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            data = resign(struct.pack("<Q", len(text)) + text + valid[8 + hn:])
        announce(kind, edits, cut, tail, name, field, junk_value, whole_tree)
        with open(path, "wb") as f:
            f.write(data)
        try:
            mgpu.load(path)
            if kind == "bytes":
                assert data == valid, "damaged bytes were loaded: the checksum missed them"
        except ck.CheckpointError as e:
            assert path in str(e), e  # names the file
    check()


# The child's address space is capped (4 GiB; $MGPU_TEST_MAX_VM_BYTES to change it): a huge but
# representable request (mgpu.ones((2**31,), dtype="int64"), 16 GiB) must then be refused with a
# MemoryError whatever the machine. Without the cap the system may grant it and the kernel's OOM
# killer end this process (or another one on the machine) when the memory is written.
MAX_VM_BYTES = int(os.environ.get("MGPU_TEST_MAX_VM_BYTES", 4 << 30))

if __name__ == "__main__":
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MAX_VM_BYTES, MAX_VM_BYTES))
    group, examples = sys.argv[1], int(sys.argv[2])
    globals()["group_" + group](examples)
    print("TRIED", tried, flush=True)
