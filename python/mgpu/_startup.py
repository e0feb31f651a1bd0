"""Runs before mgpu._core loads: refuses a CPU below mgpu's minimum with a clear ImportError (the
engine is compiled for x86-64-v3 and would otherwise die of an illegal instruction), and loads
PyPI's OpenBLAS (scipy-openblas32) so _core finds it wherever the two packages were installed."""
import ctypes
import os
import platform

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
