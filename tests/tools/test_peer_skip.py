"""The optional PyTorch cross-checks skip, never fail, when the PyTorch they find is not one they
support: a stand-in interpreter that answers every probe with PyTorch 1.13 (as Debian's
python3-torch does) is put where the lookups look, once first on PATH (the last resort after the
project's peer and this interpreter) and once as $MGPU_TORCH_PYTHON, and the peer tests run in a
child pytest. Each must be skipped with a reason that names the version found and how to get
the supported one; none may run against the stand-in (it would fail: it prints no results)."""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import mgpu

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__)))
BENCH_PEER_TESTS = ["tools/test_bench.py::test_train_compare_torch",
                    "tools/test_bench.py::test_train_resnet18_against_torch_eager",
                    "tools/test_bench.py::test_isa_compare_torch_runs_its_default_and_avx2_kernels"]


def _stand_in(directory):
    """``python3`` in ``directory``: prints PyTorch's version 1.13.1 for any -c probe, and, for
    the DLPack tests' probe (which also imports mgpu), the package root under test."""
    directory.mkdir()
    path = directory / "python3"
    path.write_text(f"#!{sys.executable}\nimport sys\nprint('1.13.1')\n"
                    f"if 'mgpu' in ' '.join(sys.argv[1:]):\n    print({PKG_ROOT!r})\n")
    path.chmod(0o755)
    return str(path)


def _run_child(tmp_path, env, nodes):
    """{test id: (outcome, message)} of a child pytest over ``nodes`` in ``env``."""
    report = tmp_path / "report.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={report}", *nodes], cwd=TESTS, env=env,
                       capture_output=True, text=True, timeout=600)
    assert report.exists(), f"the child pytest wrote no report:\n{r.stdout[-3000:]}{r.stderr}"
    out = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        found = [(child.tag, child.get("message", "")) for child in case
                 if child.tag in ("skipped", "failure", "error")]
        out[name] = found[0] if found else ("passed", "")
    assert out, r.stdout[-3000:]
    bad = {k: v for k, v in out.items() if v[0] in ("failure", "error")}
    assert not bad, f"peer tests failed instead of skipping:\n{bad}\n{r.stdout[-3000:]}"
    return out


def _child_env(**changes):
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    env.pop("MGPU_REQUIRE_PEERS", None)  # the children are meant to skip
    env.update(changes)
    return env


def _assert_skipped_for_the_version(out, names):
    for name in names:
        key = [k for k in out if k.endswith(name)]
        assert key, f"{name} did not run: {sorted(out)}"
        outcome, message = out[key[0]]
        assert outcome == "skipped", (name, outcome, message)
        assert "PyTorch '1.13.1'" in message and "bash .ci/peers.sh torch" in message, message


def test_an_old_pytorch_first_on_path_skips_the_peer_tests(tmp_path):
    # This interpreter comes before PATH's python3: with its own PyTorch the stand-in is unused.
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{sys.executable} imports torch, so python3 on PATH is never asked")
    bin_dir = tmp_path / "bin"
    _stand_in(bin_dir)
    # The project's peer hidden (a missing $MGPU_TORCH_PYTHON), so the lookup reaches PATH.
    env = _child_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                     MGPU_TORCH_PYTHON=str(tmp_path / "no-peer" / "python"))
    out = _run_child(tmp_path, env, BENCH_PEER_TESTS)
    _assert_skipped_for_the_version(out, [n.split("::")[1] for n in BENCH_PEER_TESTS])


def test_an_old_pytorch_as_the_named_peer_skips_the_peer_tests(tmp_path):
    stand_in = _stand_in(tmp_path / "bin")
    out = _run_child(tmp_path, _child_env(MGPU_TORCH_PYTHON=stand_in),
                     BENCH_PEER_TESTS + ["tensor/test_dlpack_peers.py"])
    _assert_skipped_for_the_version(out, [n.split("::")[1] for n in BENCH_PEER_TESTS])
    dlpack_torch = [k for k in out if "test_dlpack_peers::" in k and "torch" in k
                    and out[k][0] != "passed"]
    assert len(dlpack_torch) >= 5, sorted(out)
    _assert_skipped_for_the_version(out, dlpack_torch)
