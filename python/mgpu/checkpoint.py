"""Checkpoints: ``mgpu.save(obj, path)`` / ``mgpu.load(path)`` and the training loops' resume.

A file is a safetensors file: an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte offsets, plus ``__metadata__``), then the raw little-endian tensor bytes.
``__metadata__`` holds the format name and version, a SHA-256 over the whole file, and the saved
object's structure as JSON. Loading parses JSON and copies bytes, nothing else: no pickle, no code.
``save`` stores tensors, NumPy arrays, numbers, strings and lists, tuples and dicts of them
(``net.state_dict()``, ``trainer.state_dict()``); a bfloat16 tensor (or ml_dtypes array) is
stored as safetensors' BF16, its raw bits, and loads back bit for bit. Writes are atomic (a
temporary file, fsync, rename, directory fsync): a crash or a full disk never damages the
previous file. A corrupt, truncated, other-version or foreign file is refused with a
``CheckpointError`` naming the file.

The training loops (``mgpu.train``, ``mgpu.chapter.train_concise``; ``mgpu train --checkpoint DIR
--checkpoint-every K [--resume]``) write ``DIR/ckpt-<step>.mgpu`` every K steps and at each
epoch's end, keeping the newest two: the parameters, batch norm buffers, SGD's momentum, the data
loader's epoch and position (its shuffle is a function of seed and epoch), the RNG, the step and
the results so far. ``resume=True`` continues from the newest, mid-epoch included, and ends with
the parameters the uninterrupted run would have had: on the same devices, or on any device count
with ``deterministic=True``. A checkpoint of another network, batch size, data order or device
count is refused before anything changes. Resuming a run that has finished its epochs trains
nothing and returns (and prints) its results. Under ``mpirun`` rank 0 writes and every rank reads.
SIGTERM or SIGUSR1 during a loop writes the checkpoint of the step it finishes, then stops the run
(``mgpu.loop``: ``mgpu.Preempted``, the CLI's exit status 128 + the signal).
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import faults, tensorfile

FORMAT = "mgpu.checkpoint"
VERSION = 1
_MAX_HEADER = 100 << 20  # a header larger than this is not ours (safetensors uses the same cap)
_CHECKSUM_PLACEHOLDER = "sha256:" + "0" * 64
# safetensors' dtype names; tensors are stored little-endian.
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
_DTYPE_NAMES = {np.dtype(v).newbyteorder("=").str: k for k, v in _DTYPES.items()}
_DTYPES["BF16"] = "<u2"  # bfloat16's raw bits (read back as tensorfile.BFloat16Bits)


class CheckpointError(ValueError):
    """A file that cannot be loaded as a checkpoint; the message names the file and the fault."""

    def __init__(self, path, what: str):
        self.path = os.fspath(path)
        super().__init__(f"checkpoint {self.path}: {what}")


# --- the object tree: JSON with tensors replaced by references --------------------------------

def _encode(obj, path: str, tensors: List[Tuple[str, np.ndarray, str]], names: set):
    from .tensor import Tensor, bfloat16_from_bits
    if isinstance(obj, (Tensor, np.ndarray)):
        bf16 = obj.dtype.name == "bfloat16"  # an mgpu tensor's, or ml_dtypes'
        if bf16:
            array = (obj if isinstance(obj, Tensor) else bfloat16_from_bits(
                np.ascontiguousarray(obj).view(np.uint16))).bits()
        else:
            array = obj.numpy() if isinstance(obj, Tensor) else obj
        if not bf16 and array.dtype.newbyteorder("=").str not in _DTYPE_NAMES:
            raise TypeError(f"mgpu.save: {path or 'the object'} has dtype {array.dtype}, which a "
                            f"checkpoint cannot hold (it holds {', '.join(_DTYPES)})")
        name = path or "tensor"
        k = 1
        while name in names:
            k += 1
            name = f"{path}#{k}"
        names.add(name)
        tensors.append((name, array, "BF16" if bf16 else
                        _DTYPE_NAMES[array.dtype.newbyteorder("=").str]))
        return {"__tensor__" if isinstance(obj, Tensor) else "__ndarray__": name}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        # JSON has no NaN or infinity: they are kept as tagged strings.
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, f"{path}.{i}" if path else str(i), tensors, names)
                 for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}.{k}" if path else k, tensors, names)
                    for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))) or isinstance(k, np.generic):
                raise TypeError(f"mgpu.save: {path or 'the object'} has a key of type "
                                f"{type(k).__name__}; keys must be str, int, float, bool or None")
            pairs.append([_encode(k, "", [], set()),
                          _encode(v, f"{path}.{k}" if path else str(k), tensors, names)])
        return {"__dict__": pairs}
    raise TypeError(f"mgpu.save: {path or 'the object'} is a {type(obj).__name__}; a checkpoint "
                    "holds mgpu tensors, NumPy arrays, numbers, strings, None, and lists, tuples "
                    "and dicts of them (no pickle, so no other objects)")


def _decode(node, arrays: Dict[str, np.ndarray], device, where: str):
    """The object of a stored tree; CheckpointError where the tree is not one save() writes
    (a damaged file whose checksum was made to fit must not end in a TypeError or a KeyError)."""
    if isinstance(node, list):
        return [_decode(v, arrays, device, where) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, value), = node.items()
        if tag in ("__tensor__", "__ndarray__"):
            if not isinstance(value, str) or value not in arrays:
                raise CheckpointError(where, f"its structure refers to a tensor {value!r} that "
                                      "the file does not hold (corrupt)")
            if isinstance(arrays[value], tensorfile.BFloat16Bits):
                from .tensor import bfloat16_from_bits
                t = bfloat16_from_bits(arrays[value].bits, device)
                return t.numpy() if tag == "__ndarray__" else t
            if tag == "__ndarray__":
                return arrays[value].copy()
            from .tensor import array
            try:
                return array(arrays[value], device=device, dtype=arrays[value].dtype)
            except (TypeError, ValueError) as e:
                raise CheckpointError(where, f"tensor '{value}' cannot be an mgpu tensor ({e}); "
                                      "the file is corrupt") from None
        if tag == "__tuple__":
            if not isinstance(value, list):
                raise CheckpointError(where, f"its structure has a tuple stored as {value!r} "
                                      "(corrupt)")
            return tuple(_decode(v, arrays, device, where) for v in value)
        if tag == "__float__":
            if value not in ("nan", "inf", "-inf"):  # the only floats JSON cannot hold
                raise CheckpointError(where, f"its structure has a float stored as {value!r} "
                                      "(corrupt)")
            return float(value)
        if tag == "__dict__":
            if not isinstance(value, list) or not all(
                    isinstance(kv, list) and len(kv) == 2 for kv in value):
                raise CheckpointError(where, "its structure has a dict whose items are not "
                                      "[key, value] pairs (corrupt)")
            out = {}
            for k, v in value:
                k = _decode(k, arrays, device, where)
                k = tuple(k) if isinstance(k, list) else k
                try:
                    hash(k)
                except TypeError:
                    raise CheckpointError(where, f"its structure has a dict key {k!r} that is "
                                          "not a str, number, bool or None (corrupt)") from None
                out[k] = _decode(v, arrays, device, where)
            return out
    return {k: _decode(v, arrays, device, where) for k, v in node.items()}


# --- writing ---------------------------------------------------------------------------------

def _header(tensors: List[Tuple[str, np.ndarray, str]], tree, meta: Optional[dict]) -> bytes:
    entries: Dict[str, Any] = {"__metadata__": {
        "format": FORMAT, "version": str(VERSION), "checksum": _CHECKSUM_PLACEHOLDER,
        "tree": json.dumps(tree, separators=(",", ":")),
        "meta": json.dumps(meta or {}, separators=(",", ":"))}}
    offset = 0
    for name, a, code in tensors:
        entries[name] = {"dtype": code, "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # tensor data 8-byte aligned, as safetensors pads


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot sync a directory; the rename still stands
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def save(obj, path, meta: Optional[dict] = None) -> None:
    """Writes ``obj`` (tensors, NumPy arrays, numbers, strings, None, and lists, tuples and dicts
    of them, e.g. ``net.state_dict()`` or ``trainer.state_dict()``) to ``path``, atomically.

    The bytes go to a temporary file in the same directory, which is flushed and fsynced and
    only then renamed over ``path`` (then the directory is fsynced): a crash or a failed write
    (a full disk) leaves ``path`` as it was, never half written. ``meta`` is a JSON-able dict
    stored beside the tree (see :func:`read_meta`). Waits for the tensors' queued work.
    """
    path = os.fspath(path)
    tensors: List[Tuple[str, np.ndarray, str]] = []
    tree = _encode(obj, "", tensors, set())
    # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    tensors = [(n, np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C"), code)
               for n, a, code in tensors]
    header = _header(tensors, tree, meta)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"mgpu.save: the directory {directory} does not exist; create "
                                f"it first (writing {path})")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        prefix = struct.pack("<Q", len(header)) + header
        digest = hashlib.sha256(prefix)
        _write_all(fd, prefix)
        total = sum(a.nbytes for _, a, _ in tensors)
        written = 0
        for _, a, _ in tensors:
            if written < total // 2 <= written + a.nbytes:
                faults.fault("write")
            raw = a.reshape(-1).view(np.uint8)
            digest.update(raw)
            _write_all(fd, raw)
            written += a.nbytes
        # The checksum covers the file with its own field zeroed; it is written in last.
        where = 8 + header.index(_CHECKSUM_PLACEHOLDER.encode())
        os.pwrite(fd, f"sha256:{digest.hexdigest()}".encode(), where)
        os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            kept = ("the previous file is unchanged" if os.path.exists(path)
                    else "nothing was written")
            raise OSError(e.errno, f"mgpu.save: writing {path} failed ({e.strerror or e}); "
                          f"{kept}") from e
        raise
    os.close(fd)
    faults.fault("rename")
    os.replace(tmp, path)
    faults.fault("dirsync")
    _fsync_dir(directory)


# --- reading ---------------------------------------------------------------------------------

def read_file(path) -> Tuple[Any, Dict[str, np.ndarray], dict, str]:
    """Reads and verifies a file: (tree, arrays by name, meta, checksum). CheckpointError on any
    fault."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(path, "is a directory; pass a checkpoint file (train's checkpoints "
                              "are the ckpt-*.mgpu files inside it)")
    with open(path, "rb") as f:
        data = f.read()
    size = len(data)
    if size < 8:
        raise CheckpointError(path, f"is {size} bytes long: truncated, or not an mgpu checkpoint")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(path, f"its first 8 bytes give a header of {n} bytes but the file "
                              f"has {size}: truncated, or not an mgpu checkpoint")
    raw_header = data[8:8 + n]
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(path, "its header is not valid JSON: the file is corrupt, or not "
                              "an mgpu checkpoint") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(path, f"not an mgpu checkpoint (its header has no format "
                              f"'{FORMAT}'; a safetensors file from elsewhere?)")
    if meta.get("version") != str(VERSION):
        raise CheckpointError(path, f"format version {meta.get('version')!r}; this mgpu reads "
                              f"version {VERSION} (was it written by another mgpu version?)")
    payload = size - 8 - n
    try:
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max([int(v["data_offsets"][1]) for v in entries.values()], default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise CheckpointError(path, "a tensor entry in its header has no valid data_offsets "
                              "(corrupt)") from None
    if payload < end:
        raise CheckpointError(path, f"truncated: its header describes {end} bytes of tensor "
                              f"data but only {payload} follow it ({size} bytes in all)")
    checksum = meta.get("checksum")
    if not isinstance(checksum, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", checksum):
        raise CheckpointError(path, "its header has no valid checksum (corrupt)")
    at = raw_header.find(checksum.encode())
    digest = hashlib.sha256(data[:8 + at])
    digest.update(_CHECKSUM_PLACEHOLDER.encode())
    digest.update(memoryview(data)[8 + at + len(checksum):])
    if digest.hexdigest() != checksum[7:]:
        raise CheckpointError(path, "checksum mismatch: the file is corrupt (changed after it "
                              "was written, or only partly copied)")
    if payload != end:
        raise CheckpointError(path, f"{payload - end} bytes follow its tensor data (corrupt)")
    arrays = {}
    body = memoryview(data)[8 + n:]
    for name, e in entries.items():
        try:
            dtype = np.dtype(_DTYPES[e["dtype"]])
            shape, offsets = list(e["shape"]), list(e["data_offsets"])
            # Integers only (a float or a bool in a shape is damage, not a size), and the element
            # count in Python's integers: a product that overflows int64 cannot pass as small.
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in shape + offsets):
                raise ValueError
            begin, stop = offsets
            count = math.prod(shape)
            if min(shape, default=0) < 0 or stop - begin != count * dtype.itemsize or begin < 0:
                raise ValueError
            arrays[name] = np.frombuffer(body, dtype=dtype, count=count,
                                         offset=begin).reshape(shape)
            if e["dtype"] == "BF16":
                arrays[name] = tensorfile.BFloat16Bits(arrays[name])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(path, f"tensor '{name}' has an invalid entry {e!r} "
                                  "(corrupt)") from None
    try:
        tree = json.loads(meta["tree"])
        extra = json.loads(meta.get("meta", "{}"))
    except (KeyError, TypeError, ValueError, RecursionError):
        raise CheckpointError(path, "its stored structure is not valid JSON (corrupt)") from None
    return tree, arrays, extra, checksum


def load(path, device=None):
    """Reads an object written by :func:`save`, after checking the file whole, or any other
    safetensors file (PyTorch's, Hugging Face's: ``safetensors.numpy.save_file``) as a dict of
    its tensors by name (see :mod:`mgpu.tensorfile` for the dtypes it converts and refuses).

    mgpu tensors come back on ``device`` (default ``cpu(0)``), NumPy arrays as NumPy arrays.
    A file that is corrupt, truncated, of another format version or not a safetensors file raises
    :class:`CheckpointError` (a ValueError) naming the file and the fault; nothing is returned
    half. Reading parses JSON and copies bytes only: no code is executed.
    """
    foreign = _foreign(path)
    if foreign is not None:
        from .tensor import array, bfloat16_from_bits
        return {name: bfloat16_from_bits(a.bits, device)
                if isinstance(a, tensorfile.BFloat16Bits) else array(a, device=device,
                                                                    dtype=a.dtype)
                for name, a in foreign.items()}
    tree, arrays, _, _ = read_file(path)
    return _decode(tree, arrays, device, os.fspath(path))


def _foreign(path):
    """The arrays of a safetensors file that is not one of mgpu's checkpoints, or None for a
    file that is (or that is no safetensors file at all: :func:`read_file` says what is wrong)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return None
    with open(path, "rb") as f:  # the header first: a checkpoint is read once, by read_file
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        head += f.read(min(n, _MAX_HEADER))
        parsed = tensorfile.read_header(head)
        if parsed is None or tensorfile.is_mgpu_header(parsed[1], FORMAT):
            return None
        data = head + f.read()
    try:
        return tensorfile.parse(data)[0]
    except tensorfile.TensorFileError as e:
        raise CheckpointError(path, f"a safetensors file that mgpu cannot read: {e}") from None


def read_meta(path) -> dict:
    """The ``meta`` dict given to :func:`save` (the file is verified whole first)."""
    return read_file(path)[2]


# --- a training run's checkpoint directory ---------------------------------------------------

_FILE = re.compile(r"ckpt-(\d{9,})\.mgpu")
_STALE = re.compile(r"\.ckpt-\d{9,}\.mgpu\.tmp\.\d+")
_KEEP = 2  # the newest files kept: one to fall back on if the newest is damaged later


class TrainCheckpoints:
    """The checkpoints of one training run in ``directory``: ``ckpt-<step>.mgpu``, written by
    rank 0 every ``every`` steps and at each epoch's end, the newest two kept.

    ``start(resume)`` returns the newest checkpoint's state (every rank reads the file and they
    check that they read the same one), or None for a fresh run; a fresh run refuses a directory
    that already holds checkpoints, so two runs never mix. ``write(state, step)`` is collective:
    every rank calls it, rank 0 writes, and all raise if the write failed.
    """

    def __init__(self, directory, every, op: str):
        if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"{op}: checkpoint must be a directory path, got "
                            f"{type(directory).__name__}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"{op}: checkpoint_every must be an integer >= 1 (steps between "
                             f"checkpoints) or None (each epoch's end only), got {every!r}")
        self.dir = os.fspath(directory)
        self.every = every
        self.op = op
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ValueError(f"{op}: checkpoint={self.dir!r} is a file; pass a directory (the "
                             "run writes its ckpt-<step>.mgpu files there)")
        os.makedirs(self.dir, exist_ok=True)

    def files(self) -> List[Tuple[int, str]]:
        """(step, path) of every checkpoint in the directory, oldest first."""
        found = []
        for name in os.listdir(self.dir):
            m = _FILE.fullmatch(name)
            if m:
                found.append((int(m.group(1)), os.path.join(self.dir, name)))
        return sorted(found)

    def start(self, resume: bool):
        """(path, state) of the newest checkpoint when resuming, else None (see the class)."""
        from . import distributed as dist
        files = self.files()
        if dist.rank() == 0:
            for name in os.listdir(self.dir):  # left by a process killed while writing
                if _STALE.fullmatch(name):
                    os.unlink(os.path.join(self.dir, name))
        if not resume:
            if files:
                raise ValueError(f"{self.op}: {self.dir} already holds checkpoints (newest "
                                 f"{files[-1][1]}); pass resume=True (--resume) to continue that "
                                 "run, or choose an empty directory")
            return None
        if dist.world_size() > 1:  # every rank must resume from the same file
            from .tensor import array
            mine = files[-1][0] if files else -1
            newest = array(np.array([mine], dtype=np.int64))
            dist.broadcast(newest, root=0)
            if int(newest.numpy()[0]) != mine:
                raise ValueError(f"{self.op}: rank {dist.rank()} sees newest checkpoint step "
                                 f"{mine} in {self.dir} but rank 0 sees {int(newest.numpy()[0])}"
                                 "; every rank must see the same directory (a shared file "
                                 "system)")
        if not files:
            return None
        path = files[-1][1]
        tree, arrays, _, checksum = read_file(path)
        if dist.world_size() > 1:
            from .tensor import array
            mine = int(checksum[7:22], 16)
            theirs = array(np.array([mine], dtype=np.int64))
            dist.broadcast(theirs, root=0)
            if int(theirs.numpy()[0]) != mine:
                raise CheckpointError(path, f"rank {dist.rank()} read other bytes than rank 0 "
                                      "(another file under the same name?)")
        return path, _decode(tree, arrays, None, path)

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def write(self, state, step: int) -> str:
        """Writes ``state`` as the checkpoint of ``step`` (collective; rank 0 writes)."""
        from . import distributed as dist
        path = os.path.join(self.dir, f"ckpt-{step:09d}.mgpu")
        failure = None
        if dist.rank() == 0:
            try:
                save(state, path, meta={"step": step})
                faults.fault("prune")
                for _, old in self.files()[:-_KEEP]:
                    os.unlink(old)
            except OSError as e:
                failure = e
        if dist.world_size() > 1:
            from .tensor import array
            status = array(np.array([0 if failure is None else 1], dtype=np.int32))
            dist.broadcast(status, root=0)
            if int(status.numpy()[0]) and failure is None:
                raise OSError(f"{self.op}: rank 0 could not write the checkpoint {path} (its "
                              "error says why); the previous checkpoint is unchanged")
        if failure is not None:
            raise failure
        return path


def check_run(path: str, state, kind: str, batch_size: int, num_devices: int,
              world_size: int, deterministic: int = 0) -> None:
    """CheckpointError unless ``state`` is a ``kind`` run's state that this run can continue:
    same batch size and deterministic mode (logical shard count, 0 for off), and, unless that
    mode is on, the same devices and processes (otherwise the gradients add in another order)."""
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(path, f"holds {got!r}, not the state of a {kind!r} run; resume "
                              "with the function (and --model) that wrote it")
    cfg = state.get("config", {})
    if cfg.get("batch_size") != batch_size:
        raise CheckpointError(path, f"was written with batch size {cfg.get('batch_size')}, this "
                              f"run has {batch_size}; resume with the same batch size")
    saved_shards = cfg.get("deterministic", 0)
    if saved_shards != deterministic:
        def mode(n):
            return f"deterministic={n} (logical shards)" if n else "deterministic=False"
        raise CheckpointError(path, f"was written with {mode(saved_shards)}, this run has "
                              f"{mode(deterministic)}; resume in the same mode")
    if deterministic:  # the same bits on any device and process count
        return
    if (cfg.get("num_devices"), cfg.get("world_size")) != (num_devices, world_size):
        raise CheckpointError(
            path, f"was written by a run on {cfg.get('num_devices')} device(s) x "
            f"{cfg.get('world_size')} process(es), this run has {num_devices} x {world_size}: "
            "the gradients would be summed in another order, so the run would not continue bit "
            "for bit. Resume on the same devices, train with deterministic=True (--deterministic: "
            "the same bits on any device count), or start a new run from its parameters "
            "(mgpu.load(file)).")


def check_shapes(path: str, what: str, saved, expected) -> None:
    """CheckpointError unless the arrays in ``saved`` have the shapes of ``expected``'s."""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(expected):
        n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise CheckpointError(path, f"holds {n} {what}, this network has {len(expected)}: it "
                              "belongs to another network")
    for i, (a, b) in enumerate(zip(saved, expected)):
        if tuple(getattr(a, "shape", ())) != tuple(b.shape):
            raise CheckpointError(path, f"{what} {i} has shape {tuple(a.shape)}, this network's "
                                  f"has {tuple(b.shape)}: it belongs to another network")


__all__ = ["save", "load", "read_meta", "CheckpointError", "FORMAT", "VERSION"]
