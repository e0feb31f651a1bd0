"""The PyTorch peer the optional cross-check tests use, and when they skip instead.

``bench.find_torch_python`` prefers the project's own peer ($MGPU_TORCH_PYTHON, else
build/peers/torch made by ``bash .ci/peers.sh torch``: PyTorch 2.15), then falls back to this
interpreter and ``python3`` on PATH, where another PyTorch may live (Debian's python3-torch is
1.13). The tests assert on what PyTorch 2.15 gives (its CPU capability report, torch.compile), so
a PyTorch older than MIN_TORCH skips them with the reason, never fails them -- unless
$MGPU_REQUIRE_PEERS names the peer ("torch jax"): the test command sets it after making the peer
venvs, so a peer that is missing or broken there fails its tests instead of skipping them.
"""
import os
import re
from typing import Optional, Tuple

import pytest

import mgpu
from mgpu import bench

MIN_TORCH = (2, 15)
# The directory holding the mgpu under test: a peer's child process imports it from there.
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__)))


def child_env() -> dict:
    """This process's environment with PKG_ROOT first on PYTHONPATH, for a peer's child process
    (it imports the same mgpu as the tests)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    return env


def version_tuple(version: str) -> Optional[Tuple[int, ...]]:
    """(2, 15, 0) from '2.15.0+cpu'; None for text that starts with no version number."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def unsupported_torch(py: Optional[str], version: str) -> Optional[str]:
    """Why the PyTorch that ``py`` imports (``version``, or the reason none was found when
    ``py`` is None) cannot serve the peer tests, or None when it can."""
    if py is None:
        return version
    found = version_tuple(version)
    if found is None or found[:2] < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return (f"{py} has PyTorch {version.strip()!r}; the peer tests need PyTorch {need} or "
                "newer: run `bash .ci/peers.sh torch` (it makes build/peers/torch) or set "
                "MGPU_TORCH_PYTHON")
    return None


def required(peer: str) -> bool:
    """Whether $MGPU_REQUIRE_PEERS (names separated by spaces or commas) names ``peer``."""
    return peer in os.environ.get("MGPU_REQUIRE_PEERS", "").replace(",", " ").split()


def skip_or_fail(peer: str, why: str) -> None:
    """Skips the calling test for ``why``, or fails it where the peer is required."""
    if required(peer):
        pytest.fail(f"{why} (MGPU_REQUIRE_PEERS={os.environ['MGPU_REQUIRE_PEERS']!r} requires "
                    f"the {peer} peer: the test command makes it with `bash .ci/peers.sh {peer}`)")
    pytest.skip(why)


def torch_python() -> str:
    """The interpreter of a supported PyTorch peer; skips the calling test without one."""
    py, version = bench.find_torch_python()
    why = unsupported_torch(py, version)
    if why is not None:
        skip_or_fail("torch", why)
    return py
