"""How mgpu shares the CUDA libraries with the peers, without a peer: _startup reads _core's
DT_NEEDED names itself (checked against readelf) and loads the copy an NVIDIA wheel on sys.path
holds before _core, so a later lookup of that soname (_core's, then PyTorch's) gets that copy.
A stand-in wheel holding a copy of zlib (which every _core links to) shows it in a child."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import mgpu
from mgpu import _startup

CORE = next(os.path.join(os.path.dirname(mgpu.__file__), f)
            for f in os.listdir(os.path.dirname(mgpu.__file__)) if f.startswith("_core"))


def test_the_needed_libraries_are_read_as_readelf_reads_them():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    r = subprocess.run([readelf, "-d", CORE], capture_output=True, text=True, check=True)
    want = [line.split("[", 1)[1].rstrip("]") for line in r.stdout.splitlines()
            if "(NEEDED)" in line]
    assert want and _startup.elf_needed(CORE) == want
    assert _startup.elf_needed(__file__) == []  # not an ELF file


def _system_libz():
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        if os.path.exists(os.path.join(d, "libz.so.1")):
            return os.path.realpath(os.path.join(d, "libz.so.1"))
    pytest.skip("no libz.so.1 in the usual directories")


CHILD = '''
import importlib.util, json, os, sys
site, startup, core = sys.argv[1:4]
sys.path.insert(0, site)
spec = importlib.util.spec_from_file_location("startup_under_test", startup)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)


def mapped():
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if line.rstrip().endswith("/libz.so.1")})


out = {"before": mapped(), "loaded": mod.preload_cuda_wheels(core)}
out["after"] = mapped()
out["again"] = mod.preload_cuda_wheels(core)  # already in the process: left alone
import ctypes
ctypes.CDLL("libz.so.1")  # a lookup by soname, as _core's DT_NEEDED and PyTorch's are
out["by_soname"] = mapped()
print(json.dumps(out))
'''


def test_a_wheel_copy_is_loaded_first_and_then_serves_every_lookup_of_its_soname(tmp_path):
    if "libz.so.1" not in _startup.elf_needed(CORE):
        pytest.skip("this _core does not link zlib")
    lib = tmp_path / "site" / "nvidia" / "standin" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(_system_libz(), lib / "libz.so.1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "site"),
                        _startup.__file__, CORE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["before"]:
        pytest.skip(f"this interpreter has zlib loaded from the start: {out['before']}")
    fake = str(lib / "libz.so.1")
    assert out["loaded"] == [fake]
    assert out["after"] == [fake] and out["again"] == []
    assert out["by_soname"] == [fake]  # one copy: the soname's lookups all get the wheel's
