"""Runs before mgpu._core loads: refuses a CPU below mgpu's minimum with a clear ImportError (the
engine is compiled for x86-64-v3 and would otherwise die of an illegal instruction), loads
PyPI's OpenBLAS (scipy-openblas32) so _core finds it wherever the two packages were installed, and
loads the NVIDIA wheels' copies of the CUDA libraries _core needs where the environment has them
(see :func:`preload_cuda_wheels`), so mgpu and PyTorch or JAX share one copy in any import order."""
import ctypes
import glob
import os
import platform
import struct
import sys
import sysconfig
from typing import Dict, List, Optional

# x86-64-v3 as Linux's /proc/cpuinfo names it (lzcnt is "abm"); the kernels need AVX2 and FMA.
_V3_FLAGS = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm")


def cpu_flags_and_model():
    """(set of flags, model name) from /proc/cpuinfo, or (None, "") where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None, ""
    flags, model = None, ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and flags is None:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    return flags, model


def check_cpu() -> None:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise ImportError(f"mgpu's engine is built for x86-64 CPUs; this machine is {machine}")
    flags, model = cpu_flags_and_model()
    if flags is None:
        return  # not Linux, or no /proc: the engine checks with cpuid when it loads
    missing = [f for f in _V3_FLAGS if f not in flags]
    if missing:
        raise ImportError(
            f"mgpu needs an x86-64-v3 CPU (AVX2, FMA, BMI1/2: Intel Haswell, AMD Zen or newer); "
            f"{model or 'this CPU'} lacks {', '.join(missing)}")


def preload_blas() -> None:
    try:
        import scipy_openblas32
    except ImportError:
        return  # a build against the system's BLAS (MGPU_BLAS=system)
    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


# --- the CUDA libraries: one copy per process, shared with the peers --------------------------

def elf_needed(path: str) -> List[str]:
    """The DT_NEEDED names (sonames) of a 64-bit little-endian ELF shared library; [] for any
    other file."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
                return []
            phoff, = struct.unpack_from("<Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", ident, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                p_type, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", table,
                                                                         i * phentsize)
                if p_type == 1:  # PT_LOAD
                    loads.append((vaddr, offset, filesz))
                elif p_type == 2:  # PT_DYNAMIC
                    dynamic = (offset, filesz)
            if dynamic is None:
                return []
            f.seek(dynamic[0])
            raw = f.read(dynamic[1])
            needed, strtab, strsz = [], None, 0
            for i in range(len(raw) // 16):
                tag, val = struct.unpack_from("<qQ", raw, i * 16)
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED: an offset into the string table
                    needed.append(val)
                elif tag == 5:  # DT_STRTAB (an address)
                    strtab = val
                elif tag == 10:  # DT_STRSZ
                    strsz = val
            where = next((off + strtab - va for va, off, size in loads
                          if strtab is not None and va <= strtab < va + size), None)
            if where is None:
                return []
            f.seek(where)
            strings = f.read(strsz)
    except (OSError, struct.error):
        return []
    return [strings[i:strings.index(b"\0", i)].decode("utf-8", "replace")
            for i in needed if i < len(strings)]


def cuda_wheel_libraries() -> Dict[str, str]:
    """soname -> path of every library the NVIDIA wheels on sys.path hold (nvidia/*/lib), the
    first entry of sys.path winning, as Python's imports do."""
    found: Dict[str, str] = {}
    for entry in sys.path:
        for path in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", "lib*.so*"))):
            found.setdefault(os.path.basename(path), path)
    return found


def _loaded(soname: str) -> bool:
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


def preload_cuda_wheels(core: Optional[str] = None) -> List[str]:
    """Loads, before _core, the NVIDIA wheels' copies of the CUDA libraries _core links to
    (NCCL, cuDNN, cuBLAS), where the environment has them; returns their paths.

    Why: glibc resolves a library's DT_NEEDED name (``libnccl.so.2``) to any library already in
    the process whose soname is that name, wherever it was loaded from and whether it was
    loaded RTLD_LOCAL or not. _core loaded first with the toolkit's NCCL 2.28 made PyTorch's
    ``libtorch_cuda.so`` bind to that NCCL instead of its wheel's 2.30 (``undefined symbol:
    ncclCommResume``). Loading the wheel's copy first gives both the same library, the one the
    peer was built for; mgpu calls only entry points every release of the same soname has (the
    soname's major is the ABI). The copies are loaded RTLD_LOCAL: nothing enters the global
    symbol scope. A library already in the process, and one no wheel holds, is left alone (the
    toolkit's, found through _core's RUNPATH, serves then)."""
    if core is None:
        core = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "_core" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    wheels = cuda_wheel_libraries()
    if not wheels:
        return []
    done: List[str] = []
    seen = set()

    def load(soname: str) -> None:
        if soname in seen or soname not in wheels:
            return
        seen.add(soname)
        if _loaded(soname):
            return
        path = wheels[soname]
        for dep in elf_needed(path):  # its own wheel-held dependencies first (cuBLASLt)
            load(dep)
        try:
            ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError:
            return  # an unusable copy: _core's RUNPATH finds the toolkit's
        done.append(path)

    for soname in elf_needed(core):
        load(soname)
    return done
