"""Shared fixtures and the comparison helper for mgpu's Python tests.

Tests import the installed ``mgpu`` package (run them from tests/, as .ci/test.sh does), never
the source tree, so they exercise exactly what ``pip install .`` built.
"""
import os
import sys

import numpy as np
import pytest

import mgpu

# The tests stand in folders by layer (ops/, nn/, step/, comm/, gpu/, robust/, tools/, ...): the
# helpers beside this file (reference.py, dist_worker.py, ...) and the test modules a test of
# another folder imports (test_distributed's launcher, test_data_parallel's nets) are importable
# from every folder.
TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(TESTS)):
    _path = os.path.join(TESTS, _folder)
    if os.path.isdir(_path) and _folder not in ("cpp", "__pycache__") and _path not in sys.path:
        sys.path.append(_path)


def _strict_emulator():
    if os.environ.get("MGPU_EMU_STRICT") != "1" or not mgpu.build_info()["cuda_emulation"]:
        return None
    return f"MGPU_EMU_STRICT=1 MGPU_EMU_SEED={os.environ.get('MGPU_EMU_SEED', '1')}"


def pytest_report_header(config):
    strict = _strict_emulator()
    return [f"strict CUDA emulator: {strict}"] if strict else []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test on the strict emulator names the seed, so its run can be replayed."""
    outcome = yield
    report = outcome.get_result()
    strict = _strict_emulator()
    if strict and report.failed:
        report.sections.append(("strict CUDA emulator", f"replay with {strict}"))


# Tolerances, one row per kind of op, float32 results against float64 references:
#  - elementwise ops round once per element: 1e-6 relative;
#  - sums over many terms (conv, mm, pooling, softmax cross-entropy, whole LeNet steps) round once
#    per term, and float32 has a 6e-8 unit roundoff: rtol 1e-4 with atol 1e-5 for values near 0.
TOL = {
    "elementwise": dict(rtol=1e-6, atol=1e-7),
    "sum": dict(rtol=1e-4, atol=1e-5),
}


def assert_close(got, expected, kind="sum", what="", device=None):
    """Asserts float32 ``got`` matches ``expected``; on failure reports the worst element."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    label = f"{what} on {device}" if device is not None else what
    assert got.shape == expected.shape, f"{label}: shape {got.shape} != expected {expected.shape}"
    tol = TOL[kind]
    if np.allclose(got, expected, **tol):
        return
    err = np.abs(got - expected)
    bound = tol["atol"] + tol["rtol"] * np.abs(expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    rel = err / np.maximum(np.abs(expected), 1e-30)
    raise AssertionError(
        f"{label}: mismatch at index {tuple(int(i) for i in worst)}: expected "
        f"{expected[worst]!r}, got {got[worst]!r}; max abs err {err.max():.3g}, "
        f"max rel err {rel.max():.3g} (rtol {tol['rtol']}, atol {tol['atol']})")


def f32(a):
    """The float32 values an mgpu tensor will hold, as a float64 array for the reference."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def on(a, device, grad=False):
    """A float32 tensor on ``device`` holding ``a``; a leaf that requires grad if ``grad``."""
    t = mgpu.array(np.asarray(a, dtype=np.float32), device=device)
    return t.requires_grad_() if grad else t


def other_device(device):
    """A CPU device other than ``device`` (cpu(1) for cpu(0), else cpu(0)), for cross-device
    copies."""
    return mgpu.cpu(1) if device == mgpu.cpu(0) else mgpu.cpu(0)


def _devices():
    devs = [mgpu.cpu(0), mgpu.cpu(1)]
    params = [pytest.param(d, id=str(d)) for d in devs]
    if mgpu.num_gpus() > 0:
        params.append(pytest.param(mgpu.gpu(0), id="gpu(0)", marks=pytest.mark.gpu))
    else:
        params.append(pytest.param(None, id="gpu(0)", marks=[pytest.mark.gpu, pytest.mark.skip(
            reason="no GPU in this build or machine (mgpu.num_gpus() == 0)")]))
    return params


@pytest.fixture(params=_devices())
def device(request):
    """Every device an op must work on: cpu(0), cpu(1), and gpu(0) when there is one."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def fashion_mnist_available() -> bool:
    try:
        mgpu.data.find_data_dir()
        return True
    except FileNotFoundError:
        return False


requires_fashion_mnist = pytest.mark.skipif(
    not fashion_mnist_available() and not os.environ.get("CI"),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def crash_at_step(monkeypatch, n: int) -> None:
    """Makes the training loops' step hook (mgpu.faults.fault) raise KeyboardInterrupt at the
    n-th step, as a kill would end the run there (the checkpoint tests' simulated crash)."""
    count = {"n": 0}

    def fault(point):
        if point == "step":
            count["n"] += 1
            if count["n"] == n:
                raise KeyboardInterrupt("simulated crash")
    monkeypatch.setattr(mgpu.faults, "fault", fault)
