"""The rivals of ``bench train``: finding an interpreter with PyTorch or JAX, and running the
chapters' code in it (``torch_rival.py``, ``jax_rival.py``, next to this file, by path: they never
import mgpu) for one JSON result."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from .common import summarize


def interpreter_path(py: Optional[str]) -> Optional[str]:
    """``py`` made absolute when it is a path (``build/peers/torch/bin/python``), so it names the
    same file from the children's working directories; a bare name (``python3``) stays as it is,
    for the PATH search."""
    return os.path.abspath(py) if py and os.sep in py else py


def probe_python(candidates: tuple, code: str):
    """(interpreter, what ``code`` printed) for the first of ``candidates`` that runs ``code``,
    else (None, [each candidate with why it failed]). The answer is cached by the absolute paths,
    so a relative one is probed again from another working directory."""
    return _probe_absolute(tuple(map(interpreter_path, candidates)), code)


@functools.lru_cache(maxsize=None)
def _probe_absolute(candidates: tuple, code: str):
    tried = []
    for py in candidates:
        if not py or not os.path.exists(py):
            tried.append(f"{py} (missing)")
            continue
        try:
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300,
                               cwd=tempfile.gettempdir())
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py} ({e})")
            continue
        if r.returncode == 0:
            return py, r.stdout.strip()
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        tried.append(f"{py} ({last})")
    return None, tried


def find_torch_python(explicit: Optional[str] = None):
    """(interpreter, torch version) of a Python that can ``import torch``, or (None, reason).

    Tries ``explicit`` only when given; else the project's peer first ($MGPU_TORCH_PYTHON, or
    build/peers/torch/bin/python made by ``bash .ci/peers.sh torch``: PyTorch 2.15 from PyPI),
    then this interpreter, then ``python3`` on PATH (e.g. Debian's python3-torch, 1.13: older and
    slower, the last resort; the version found is in every report, and the tests skip a PyTorch
    older than they support). The answer is cached.
    """
    import shutil
    candidates = ((explicit,) if explicit else
                  (*peer_python_candidates("torch"), sys.executable,
                   shutil.which("python3") or "/usr/bin/python3"))
    py, found = probe_python(tuple(dict.fromkeys(candidates)),
                             "import torch, numpy; print(torch.__version__)")
    if py is not None:
        return py, found
    return None, ("no Python with PyTorch found (tried " + "; ".join(found) + "); run `bash "
                  ".ci/peers.sh torch` (it makes build/peers/torch), or pass --torch-python")


# The variable that names each peer's interpreter (see mgpu.environment).
PEER_PYTHON_ENV = {"torch": "MGPU_TORCH_PYTHON", "jax": "MGPU_JAX_PYTHON"}


def peer_python_candidates(peer: str) -> List[str]:
    """Where a peer's interpreter is looked for: $MGPU_<PEER>_PYTHON when set, else
    build/peers/<peer>/bin/python (made by ``bash .ci/peers.sh <peer>``) in the current directory
    or in a directory above this package (the repository's, when mgpu runs from build/dev)."""
    env = os.environ.get(PEER_PYTHON_ENV[peer])
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [os.getcwd()] + [os.path.dirname(here)]
    while os.path.dirname(roots[-1]) != roots[-1]:
        roots.append(os.path.dirname(roots[-1]))
    out = []
    for root in roots:
        py = os.path.join(root, "build", "peers", peer, "bin", "python")
        if os.path.exists(py) and py not in out:
            out.append(py)
    return out or [os.path.join(os.getcwd(), "build", "peers", peer, "bin", "python")]


def jax_python_candidates() -> List[str]:
    """Where ``find_jax_python`` looks when no interpreter is given: $MGPU_JAX_PYTHON when set,
    else build/peers/jax/bin/python (``peer_python_candidates``)."""
    return peer_python_candidates("jax")


def find_jax_python(explicit: Optional[str] = None):
    """(interpreter, jax version) of a Python that can import jax, flax and optax, or (None,
    reason). Tries ``explicit`` only when given, else ``jax_python_candidates()``."""
    candidates = tuple([explicit] if explicit else jax_python_candidates())
    py, found = probe_python(candidates, "import jax, flax, optax, numpy; print(jax.__version__)")
    if py is not None:
        return py, found
    return None, ("no Python with JAX, Flax and Optax found (tried " + "; ".join(found) + "); run "
                  "`bash .ci/peers.sh jax` (it makes build/peers/jax) or pass --jax-python")


RIVALS = ("torch", "jax")
FRAMEWORK = {"torch": "PyTorch", "jax": "JAX"}


def parse_compare(compare: Optional[str]) -> List[str]:
    """``--compare``: None, or rivals separated by commas ('torch', 'jax', 'torch,jax')."""
    if compare is None:
        return []
    names = [c.strip() for c in str(compare).split(",") if c.strip()]
    if not names or set(names) - set(RIVALS) or len(set(names)) != len(names):
        raise ValueError(f"bench train: --compare takes 'torch', 'jax' or 'torch,jax', got "
                         f"{compare!r}")
    return names


def find_rivals(names: Sequence[str], explicit: Dict[str, Optional[str]]) -> Dict:
    """{rival: (interpreter or None, version or why not)}; an interpreter given explicitly that
    cannot import the rival's framework is a ValueError, before anything is timed."""
    finders = {"torch": (find_torch_python, "torch"), "jax": (find_jax_python, "jax, flax, optax")}
    out = {}
    for name in names:
        find, modules = finders[name]
        py, info = find(explicit.get(name))
        if py is None and explicit.get(name):
            raise ValueError(f"bench train: --{name}-python {explicit[name]} cannot import "
                             f"{modules}: {info}")
        out[name] = (py, info)
    return out


def run_rival(name: str, py: str, data_dir: Optional[str], synthetic: int,
              devices: Sequence[int], batch_size: int, lr: float, epochs: int, limit: int,
              warmup: int, threads: int, seed: int, variants: Optional[str] = None,
              env: Optional[Dict[str, str]] = None) -> Dict:
    """Runs ``{name}_rival.py`` with ``py`` (in ``env``, default this process's environment);
    returns the JSON object it prints."""
    here = os.path.dirname(os.path.abspath(__file__))
    args = ["--batch-size", str(batch_size), "--lr", repr(lr),
            "--devices", ",".join(str(k) for k in devices), "--epochs", str(epochs),
            "--limit-batches", str(limit), "--warmup", str(warmup), "--threads", str(threads),
            "--seed", str(seed)]
    args += ["--synthetic", str(synthetic)] if synthetic else ["--data-dir", data_dir]
    if variants:
        args += ["--variants", variants]
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(rival_command(py, os.path.join(here, f"{name}_rival.py")) + args,
                           capture_output=True, text=True, cwd=cwd, env=env)
    what = FRAMEWORK[name]
    if r.returncode != 0:
        raise RuntimeError(f"bench train: the {what} run ({py}) failed:\n"
                           f"{r.stderr.strip()[-2000:]}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"bench train: the {what} run ({py}) printed no JSON result:\n"
                           f"{r.stdout.strip()[-2000:]}") from None


def rival_command(py: str, script: str) -> List[str]:
    """The command that runs a rival script with ``py``: by path, from the caller's (empty)
    directory, so the package's own modules (random.py, data.py) cannot shadow the standard
    library's in that interpreter and mgpu is never imported; rival_common.py, next to the
    script, is loaded first as the top-level module the script imports."""
    boot = ("import importlib.util, os, runpy, sys; p = sys.argv[1]; sys.argv = sys.argv[1:]; "
            "s = importlib.util.spec_from_file_location('rival_common', "
            "os.path.join(os.path.dirname(p), 'rival_common.py')); "
            "m = sys.modules['rival_common'] = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m); runpy.run_path(p, run_name='__main__')")
    return [py, "-c", boot, script]


def rival_entry(name: str, r: Dict) -> Dict:
    """A rival's LeNet result with the bench's statistics; impl is e.g. 'torch chapter'."""
    per_step = summarize([t / r["steps_per_epoch"] for t in r["epoch_times"]])
    impl = name + " " + {"chapter": "chapter", "loader": "chapter + loader"}.get(
        r["variant"], "idiomatic")
    out = dict(r)
    out.update(impl=impl, sec_per_step=per_step,
               sec_per_epoch=per_step["median"] * r["full_batches"],
               images_per_sec=r["global_batch"] / per_step["median"])
    return out


def package_root() -> str:
    """The directory holding this mgpu package, so a side process imports the same build."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
