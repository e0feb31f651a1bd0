"""Random tensors, seeded like NumPy: ``mgpu.random.seed(n)``, ``mgpu.random.normal(...)``.

Values are drawn on the host with NumPy's PCG64 generator and copied to the device, so a seed
gives the same numbers on every device and machine.
"""
from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

# A fresh process starts from a fixed seed, PyTorch's default (``torch.initial_seed()`` in a new
# interpreter), so two runs of the same script draw the same initial weights unless the program
# asks otherwise; ``seed`` sets another.
DEFAULT_SEED = 67280421310721

_rng = np.random.default_rng(DEFAULT_SEED)


def seed(n: int) -> None:
    """Makes every following draw reproducible."""
    global _rng
    _rng = np.random.default_rng(check_seed(n, "mgpu.random.seed"))


def get_state() -> dict:
    """The generator's state as plain numbers and strings (NumPy's ``bit_generator.state``),
    e.g. for a checkpoint; :func:`set_state` restores it, so the draws continue identically."""
    return _rng.bit_generator.state


def set_state(state: dict) -> None:
    """Restores a state from :func:`get_state` (ValueError if it is not one)."""
    global _rng
    _rng = generator_from_state(state)


def generator() -> np.random.Generator:
    """The generator every draw takes its numbers from now (``nn.init`` draws from it too)."""
    return _rng


def set_generator(g: np.random.Generator) -> None:
    """Makes ``g`` the generator of every following draw (a resumed run's, checked beforehand
    with :func:`generator_from_state`)."""
    global _rng
    _rng = g


def generator_from_state(state) -> np.random.Generator:
    """A generator in ``state`` (checked: ValueError names what is wrong)."""
    if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
        raise ValueError("mgpu.random.set_state: expected a state from mgpu.random.get_state() "
                         f"(a dict with bit_generator 'PCG64'), got {str(state)[:80]}")
    g = np.random.default_rng()
    try:
        g.bit_generator.state = state
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"mgpu.random.set_state: not a PCG64 state: {e}") from None
    return g


def check_seed(n, op: str) -> int:
    """A seed: an integer in [0, 2**64) (ValueError or TypeError otherwise, never truncated)."""
    if isinstance(n, bool) or not isinstance(n, (numbers.Integral, np.integer)):
        raise TypeError(f"{op}: the seed must be an integer, got {n!r} ({type(n).__name__})")
    if not 0 <= int(n) < 2**64:
        raise ValueError(f"{op}: the seed must be in [0, 2**64), got {n}")
    return int(n)


def normal(loc: float = 0.0, scale: float = 1.0, size=None, device=None, ctx=None,
           rng: Optional[np.random.Generator] = None):
    """Samples of N(loc, scale^2) with shape ``size``, as a float32 tensor on ``device``."""
    from .tensor import array
    g = rng if rng is not None else _rng
    return array(g.normal(loc, scale, size=size), device=device or ctx, dtype=np.float32)


def uniform(low: float = 0.0, high: float = 1.0, size=None, device=None, ctx=None):
    """Samples of U[low, high) with shape ``size``, as a float32 tensor on ``device``."""
    from .tensor import array
    return array(_rng.uniform(low, high, size=size), device=device or ctx, dtype=np.float32)


def randn(*shape, device=None):
    """Standard normal samples of the given shape (PyTorch's ``torch.randn``)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return normal(size=shape, device=device)


def step_seed() -> int:
    """A seed in [0, 2**64) drawn from the generator: the fused step draws one per step for a
    model with dropout, the seed of that step's masks (so ``seed`` repeats them, and a
    checkpoint, which saves :func:`get_state`, resumes them)."""
    return int(_rng.integers(0, 2**64, dtype=np.uint64))


def dropout_mask(shape, p: float, device=None):
    """Dropout's mask as a float32 tensor on ``device``: each element is 1 / (1 - p) (computed in
    float32, as PyTorch scales) with probability 1 - p, else 0; all zeros when p is 1."""
    from .tensor import array
    keep = _rng.random(size=shape) >= p
    scale = np.float32(0.0) if p >= 1.0 else np.float32(1.0) / np.float32(1.0 - p)
    return array(np.where(keep, scale, np.float32(0.0)).astype(np.float32), device=device)
