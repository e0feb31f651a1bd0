"""The timeline: ``with mgpu.profile("trace.json"):`` (or ``MGPU_TRACE=trace.json``, or
``python -m mgpu train --trace trace.json``) records what every device, communication track, the
data loader and the host did, and writes a Chrome / Perfetto trace (open it in ui.perfetto.dev or
chrome://tracing, or draw it with ``mgpu.plot.timeline``). Under mpirun each rank writes its own
file (``trace.rank0.json``, ...); ``merge`` (``python -m mgpu trace-merge``) joins them."""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Callable, List, Sequence

from .engine import core as _core

# Whether a profile records; read by every Python span site (while none records, a site costs
# this one check).
active = False


def _rank_and_size():
    # The engine's, as mgpu.distributed reads them (that module sits a floor above this one).
    return _core.dist_rank(), _core.dist_world_size()


def rank_path(path: str, rank: int, world_size: int) -> str:
    """The file rank ``rank`` writes: ``path`` itself alone, ``stem.rankR.ext`` under mpirun."""
    if world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def _check_path(path, op: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{op}: the directory {parent!r} of {path!r} does not exist; create it "
                         "or choose another path")
    return path


def _write_json(path: str, doc: dict) -> None:
    # Written next to the target and renamed: a reader never sees half a trace.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


class profile:
    """Records a timeline of the work in its ``with`` block and writes it to ``path`` on exit.

    Tracks: ``host`` (Python calls, the fused step's enqueueing, waits), each device (its queue's
    tasks: on CPU devices the computation, on GPUs the host-side launches, which on the emulator
    include the kernels), ``<device> comm`` (collectives), ``data loader``. Each layer's forward
    and backward and each all-reduce bucket is a span wrapping its ops. The devices are waited
    for at both ends, so the trace holds whole tasks; results are unchanged by tracing.
    """

    def __init__(self, path):
        self.path = _check_path(path, "mgpu.profile")
        self.written: List[str] = []

    def __enter__(self) -> "profile":
        global active
        _core.waitall()
        _core.trace_start()
        active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global active
        try:
            _core.waitall()
        except Exception:
            if exc_type is None:
                self._stop()
                raise
        self._stop()

    def _stop(self) -> None:
        global active
        active = False
        rank, size = _rank_and_size()
        name = f"rank {rank} (pid {os.getpid()})" if size > 1 else f"mgpu (pid {os.getpid()})"
        body = _core.trace_stop(rank, name)
        events = json.loads("[" + body + "]")
        path = rank_path(self.path, rank, size)
        _write_json(path, {"traceEvents": events, "displayTimeUnit": "ms",
                           "otherData": {"rank": rank, "world_size": size, "clock": "monotonic"}})
        self.written = [path]


def merge(paths: Sequence[str], out: str) -> str:
    """Joins per-rank traces into one timeline (each rank is a process). The ranks' clocks are
    CLOCK_MONOTONIC: they line up on one machine, not across machines."""
    out = _check_path(out, "mgpu.trace.merge")
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise TypeError("mgpu.trace.merge: paths must be a non-empty list of trace files")
    events = []
    seen = set()
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or "traceEvents" not in doc:
            raise ValueError(f"mgpu.trace.merge: {p} is not a Chrome trace (no traceEvents)")
        pids = {e.get("pid") for e in doc["traceEvents"]}
        if pids & seen:
            raise ValueError(f"mgpu.trace.merge: {p} repeats process ids {sorted(pids & seen)} "
                             "of another file; pass each rank's file once")
        seen |= pids
        events.extend(doc["traceEvents"])
    _write_json(out, {"traceEvents": events, "displayTimeUnit": "ms"})
    return out


def span(name: str):
    """Decorator: a host span named ``name`` around each call while a profile records."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if not active:
                return fn(*args, **kwargs)
            t0 = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                _core.trace_record(name, t0, time.monotonic_ns())
        return traced
    return wrap


class scope:
    """``with scope("evaluate"):`` a host span (nothing while no profile records)."""
    __slots__ = ("name", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.monotonic_ns() if active else 0
        return self

    def __exit__(self, *exc):
        if self.t0 and active:
            _core.trace_record(self.name, self.t0, time.monotonic_ns())


_env_profile = None


def start_from_env() -> None:
    """``MGPU_TRACE=path``: record the whole program, write at exit."""
    global _env_profile
    path = os.environ.get("MGPU_TRACE")
    if not path:
        return
    import atexit
    _env_profile = profile(path)
    _env_profile.__enter__()

    def finish():
        if _core.trace_running():
            _env_profile.__exit__(None, None, None)
    atexit.register(finish)
