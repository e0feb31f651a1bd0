"""``bench allreduce``: mgpu.allreduce swept over sizes and device counts, reported as algbw =
bytes / time and busbw = algbw * 2(k-1)/k, with copy bandwidths as baselines."""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from ..device import cpu, try_gpu
from ..engine import core as _core
from ..parallel import allreduce
from ..tensor import zeros
from .common import Log, fmt_pct, header, machine_lines, measure, plural, say, table


def parse_size(text: str) -> int:
    """'1K', '4KiB', '16M', '1G' or plain bytes -> bytes (powers of 1024)."""
    s = str(text).strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" and s else s
    try:
        value = int(float(digits) * mult)
    except ValueError:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 4096, 4K, 16M") from None
    if value < 4:
        raise ValueError(f"size {text!r} is below one float32 (4 bytes)")
    return value


def format_size(nbytes: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            v = nbytes / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"


DEFAULT_SIZES = [1 << s for s in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB


def bus_factor(k: int) -> float:
    """busbw / algbw for an all-reduce over k devices: 2(k-1)/k (nccl-tests' convention)."""
    return 2.0 * (k - 1) / k


def bench_allreduce(devices: Sequence[int] = (2,), sizes: Sequence[int] = DEFAULT_SIZES,
                    warmup: int = 3, repeat: int = 10, min_time: float = 0.002,
                    log: Log = None) -> Dict:
    """mgpu.allreduce of one float32 tensor of each size per device, over k CPU devices.

    time is per all-reduce (back-to-back calls, then ``waitall``); algbw = size / time, busbw =
    algbw * 2(k-1)/k. A single copy cpu(0) -> cpu(1) and a NumPy host copy of the largest size
    are the memory-bandwidth baselines.
    """
    ks = [int(k) for k in devices]
    if not ks or min(ks) < 2:
        raise ValueError(f"bench allreduce: every device count must be >= 2, got {ks}")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 4:
        raise ValueError(f"bench allreduce: sizes must be >= 4 bytes, got {sizes}")
    out = header("allreduce", dict(devices=ks, sizes=sizes, warmup=warmup, repeat=repeat,
                                    min_time=min_time, dtype="float32"))
    rows = []
    for k in ks:
        devs = [try_gpu(i) for i in range(k)]
        for size in sizes:
            n = max(1, size // 4)
            say(log, f"bench allreduce: {format_size(4 * n)} over {plural(k, 'device')} ...")
            # Zeros stay zeros however often they are summed: no overflow, no denormals.
            data = [zeros((n,), device=d) for d in devs]
            m = measure(lambda: allreduce(data), warmup, repeat, _core.waitall, min_time)
            algbw = 4 * n / m["median"]
            rows.append({"devices": k, "bytes": 4 * n, "time": m, "algbw": algbw,
                         "busbw": algbw * bus_factor(k)})
    out["results"] = rows
    big = max(sizes) // 4
    src = zeros((big,), device=cpu(0))
    dst = zeros((big,), device=cpu(1))
    m = measure(lambda: _core.copy(dst._t, src._t), warmup, repeat, _core.waitall, min_time)
    a, b = np.zeros(big, np.float32), np.ones(big, np.float32)
    h = measure(lambda: np.copyto(a, b), warmup, repeat, lambda: None, min_time)
    out["baselines"] = [
        {"name": name, "bytes": 4 * big, "time": t, "bandwidth": 4 * big / t["median"]}
        for name, t in (("copy cpu(0) -> cpu(1)", m), ("numpy copyto (host memcpy)", h))]
    return out


def format_allreduce(r: Dict) -> str:
    lines = ["mgpu bench allreduce: mgpu.allreduce of one float32 tensor per device"]
    lines += machine_lines(r)
    s = r["settings"]
    lines.append(f"{s['warmup']} warm-up calls, {s['repeat']} samples of >= "
                 f"{s['min_time'] * 1e3:.0f} ms each; algbw = bytes / time, "
                 "busbw = algbw * 2(k-1)/k")
    for k in s["devices"]:
        lines.append("")
        rows = [[format_size(x["bytes"]), f"{x['time']['median'] * 1e6:.1f}",
                 fmt_pct(100 * x["time"]["spread"]), f"{x['algbw'] / 1e9:.2f}",
                 f"{x['busbw'] / 1e9:.2f}"] for x in r["results"] if x["devices"] == k]
        lines.append(f"k = {k} devices")
        lines += table(["size", "time us", "spread", "algbw GB/s", "busbw GB/s"], rows, "rrrrr")
    lines.append("")
    for b in r["baselines"]:
        lines.append(f"baseline {b['name']}, {format_size(b['bytes'])}: "
                     f"{b['time']['median'] * 1e6:.1f} us, {b['bandwidth'] / 1e9:.2f} GB/s")
    return "\n".join(lines)
