"""The ``mgpu`` command: the console script an install makes, ``python -m mgpu``, their plain-text
help, ``mgpu info`` and ``mgpu info --env``; and the table of environment variables, which must
list every MGPU_ variable the library's Python and C++ sources read (so it cannot go stale)."""
import os
import pathlib
import re
import subprocess
import sys
import sysconfig

import pytest

import mgpu
from mgpu import cli, environment

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mgpu.__file__)))


def _python_m(*args, env=None):
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = PKG_ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "mgpu", *args], capture_output=True, text=True,
                          env=e, timeout=300)


def _assert_plain(text):
    """No reStructuredText left in help meant for a terminal."""
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text


def test_python_m_mgpu_help_is_plain_text_under_its_own_name():
    r = _python_m("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m mgpu "), r.stdout
    for command in ("train", "info", "bench", "advise"):
        assert f"    {command} " in r.stdout, r.stdout
    assert "python -m mgpu info --env" in r.stdout
    _assert_plain(r.stdout)
    r = _python_m("train", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m mgpu train "), r.stdout
    _assert_plain(r.stdout)


def test_the_console_scripts_help_names_mgpu(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mgpu ") and "  mgpu train --num-gpus 2" in out, out
    _assert_plain(out)
    for sub in (["info", "--help"], ["bench", "train", "--help"], ["advise", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(sub)
        out = capsys.readouterr().out
        assert out.startswith(f"usage: mgpu {' '.join(sub[:-1])} "), out
        _assert_plain(out)


def test_a_user_error_is_one_line_and_status_2(capsys):
    assert cli.main(["train", "--num-gpus", "0", "--limit-batches", "1", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mgpu: error: ") and "Traceback" not in err, err


def test_info_names_the_build_and_the_cpu():
    r = _python_m("info")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"mgpu {mgpu.__version__} (Python "), lines[0]
    assert lines == cli.info_lines()
    for start in ("CPU: ", "CPU kernels: ", "BLAS: ", "MPI: ", "devices: cpu(0), cpu(1)",
                  "data: "):
        assert any(line.startswith(start) for line in lines), (start, lines)


def test_info_env_prints_every_variable_with_its_default(capsys):
    assert cli.main(["info", "--env"]) == 0
    out = capsys.readouterr().out
    for v in environment.VARIABLES:
        assert re.search(rf"^  {v.name}  \(default: {re.escape(v.default)}\)$", out, re.M), v.name
        assert v.effect.split()[0] in out
    assert len(environment.names()) == len(set(environment.names()))


def _installed_script():
    """The console script `pip install` put next to this interpreter, or None."""
    script = pathlib.Path(sys.executable).parent / ("mgpu.exe" if os.name == "nt" else "mgpu")
    return script if script.exists() else None


def _from_source_tree():
    """True when the mgpu under test is not the installed one (PYTHONPATH=python, a build's
    package): no console script belongs to it."""
    site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    return os.path.realpath(PKG_ROOT) not in site


def test_the_installed_mgpu_command_runs_info():
    script = _installed_script()
    if _from_source_tree():
        pytest.skip(f"mgpu is imported from {PKG_ROOT}, a source tree: no console script of "
                    "its own (`pip install .` or .ci/setup.sh installs one)")
    assert script is not None, (f"mgpu is installed in {PKG_ROOT} but {sys.executable}'s "
                                "directory has no `mgpu` script: [project.scripts] missing?")
    r = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"mgpu {mgpu.__version__} ("), r.stdout
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: mgpu "), r.stdout
    r = subprocess.run([str(script), "train", "--num-gpus", "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("mgpu: error: "), (r.returncode, r.stderr)


# --- the table of environment variables cannot go stale ----------------------------------------

SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh")
LITERAL = re.compile(r"""["'](MGPU_[A-Z0-9_]+)["']""")


def _sources():
    roots = [REPO / "python" / "mgpu", REPO / "cpp"]
    if not all(r.is_dir() for r in roots):
        pytest.skip(f"the sources are not here ({REPO} has no python/mgpu and cpp/): an "
                    "installed package without its repository")
    table = roots[0] / "environment.py"  # the table itself reads nothing
    return [p for r in roots for p in sorted(r.rglob("*"))
            if p.suffix in SOURCE_SUFFIXES and p != table]


def test_every_variable_the_sources_read_is_in_the_table():
    """A name is read through a string literal ("MGPU_ISA" given to getenv, os.environ, or a
    helper); one built at run time (f"MGPU_{x}") would hide from this scan, so there is none."""
    read = {}
    for path in _sources():
        text = path.read_text(errors="replace")
        assert not re.search(r"""f["'][^"'\n]*MGPU_\{""", text), \
            f"{path}: an MGPU_ variable named by a format string; spell the name out"
        for name in LITERAL.findall(text):
            read.setdefault(name, path.relative_to(REPO))
    assert len(read) >= 25, read  # the scan found the reads (27 names today)
    missing = {n: str(p) for n, p in read.items() if n not in environment.names()}
    assert not missing, f"read but not in mgpu.environment.VARIABLES: {missing}"


def test_every_variable_in_the_table_is_read_somewhere():
    texts = [p.read_text(errors="replace") for p in _sources()]
    texts += [p.read_text() for p in sorted((REPO / "notebooks").glob("*.ipynb"))]
    for v in environment.VARIABLES:
        assert any(v.name in t for t in texts), f"{v.name} is in the table but read nowhere"
