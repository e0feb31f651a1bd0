"""The compiled engine: ``mgpu._core``, the pybind11 module built from cpp/bind (its signatures in
``_core.pyi``). This is the one module that imports it by its private name; the rest of the
package reaches it as ``engine.core`` (``from .engine import core as _core``), so the engine has
one named seam on the bottom floor. ``mgpu/__init__`` runs ``_startup``'s checks before any
module of the package, so before the engine loads."""
from . import _core as core

__all__ = ["core"]
