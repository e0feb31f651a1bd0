"""notebooks/multiple-gpus.ipynb runs top to bottom and prints what the chapter prints.

The notebook is executed with nbclient on a copy in a temporary directory (the committed file and
its saved outputs are never touched), in a kernel started from this interpreter, so it sees the
same installed mgpu. MGPU_NB_EPOCHS=1 and MGPU_NB_LIMIT_BATCHES=10 shorten every training run;
every cell still runs. Expected device names come from mgpu.try_gpu, so the checks hold on a
machine with GPUs as well as on virtual CPU devices.
"""
import json
import os
import pathlib
import re
import sys

import pytest

import mgpu
from conftest import fashion_mnist_available

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "multiple-gpus.ipynb"
SHORT_RUN = {"MGPU_NB_EPOCHS": "1", "MGPU_NB_LIMIT_BATCHES": "10"}
CELL_TIMEOUT = 900  # seconds; a 2-core CI machine shared with other jobs can be slow


def _cell(nb, tag):
    """The code cell tagged ``tag`` (tags mark the cells whose printouts the tests read)."""
    found = [c for c in nb["cells"] if tag in c.get("metadata", {}).get("tags", [])]
    assert len(found) == 1, \
        f"expected one cell tagged {tag!r} in {NOTEBOOK.name}, found {len(found)}"
    return found[0]


def _stdout(cell):
    """Everything the cell printed to stdout."""
    return "".join("".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                   for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _start_kernel_manager(tmp_path):
    """A kernel manager whose only kernel is this interpreter's ipykernel.

    A kernelspec written to a private directory, so neither the kernels installed on the machine
    nor PATH decide which Python (and which mgpu) runs the notebook.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kernels = tmp_path / "kernels"
    spec = kernels / "mgpu-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"mgpu test ({sys.executable})", "language": "python"}))
    return KernelManager(kernel_name="mgpu-test",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def run_notebook(path, short_run, tmp_path_factory):
    """The notebook at ``path`` after a run with ``short_run``'s environment, every cell executed
    in order on a copy; fails on any cell error. The kernel is stopped after the run (nbclient
    leaves a kernel manager it was given running)."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (see .ci/setup.sh)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (see .ci/setup.sh)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (see .ci/setup.sh)")
    if not fashion_mnist_available() and not os.environ.get("CI"):
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")

    work = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:  # start clean, so every checked output comes from this run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(
        nb, km=_start_kernel_manager(work), timeout=CELL_TIMEOUT,
        extra_arguments=["--InteractiveShell.colors=nocolor"],  # plain tracebacks in reports
        resources={"metadata": {"path": str(work)}})
    error = None
    try:
        client.execute(env={**os.environ, **short_run})
    except nbclient.exceptions.CellExecutionError as e:
        error = e
    finally:
        if client.km is not None and client.km.has_kernel:
            client.km.shutdown_kernel(now=True)
    nbformat.write(nb, str(work / path.name))
    if error is not None:
        pytest.fail(f"{path.name} failed in a cell (this run is saved in {work}):\n{error}",
                    pytrace=False)
    return nb


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The chapter's notebook after a short run."""
    return run_notebook(NOTEBOOK, SHORT_RUN, tmp_path_factory)


def _devices():
    return str(mgpu.try_gpu(0)), str(mgpu.try_gpu(1))


def test_every_cell_ran_without_error(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for i, cell in enumerate(code):
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        assert not errors, \
            f"code cell {i} raised {errors[0].get('ename')}: {errors[0].get('evalue')}"
        assert cell.execution_count is not None, f"code cell {i} did not run"


def test_get_params_prints_b1_and_its_zero_grad(executed):
    d0, _ = _devices()
    zeros = "[" + " ".join(["0."] * 20) + "]"
    out = _stdout(_cell(executed, "get-params"))
    assert f"b1 weight: {zeros} @{d0}" in out, out
    assert f"b1 grad: {zeros} @{d0}" in out, out


def test_allreduce_prints_the_sum_on_both_devices(executed):
    d0, d1 = _devices()
    out = _stdout(_cell(executed, "allreduce"))
    before, sep, after = out.partition("after allreduce:")
    assert sep, f"no 'after allreduce:' line in:\n{out}"
    assert f"[[1. 1.]] @{d0}" in before and f"[[2. 2.]] @{d1}" in before, out
    assert f"[[3. 3.]] @{d0}" in after and f"[[3. 3.]] @{d1}" in after, out


def test_split_puts_one_half_on_each_device(executed):
    d0, d1 = _devices()
    out = _stdout(_cell(executed, "split"))
    assert f"load into [{d0}, {d1}]" in out, out
    _, sep, output = out.partition("output:")
    assert sep, f"no 'output:' line in:\n{out}"
    assert f"[[0. 1. 2. 3. 4.]\n [5. 6. 7. 8. 9.]] @{d0}" in output, out
    assert f"[[10. 11. 12. 13. 14.]\n [15. 16. 17. 18. 19.]] @{d1}" in output, out
    labels = _stdout(_cell(executed, "split-batch"))
    assert f"[[0. 1.] @{d0}, [2. 3.] @{d1}]" in labels, labels


@pytest.mark.parametrize("tag,num_devices", [("train-1", 1), ("train-2", 2),
                                             ("fused-1", 1), ("fused-2", 2)])
def test_training_prints_the_chapter_line(executed, tag, num_devices):
    assert_books_training_line(_stdout(_cell(executed, tag)), num_devices)


def assert_books_training_line(out, num_devices):
    """The book's closing line of a training run on try_gpu(0..num_devices-1) is in `out`."""
    devices = ", ".join(str(mgpu.try_gpu(i)) for i in range(num_devices))
    pattern = rf"test acc: \d\.\d\d, \d+\.\d sec/epoch on \[{re.escape(devices)}\]"
    assert re.search(pattern, out), f"no line matching {pattern!r} in:\n{out}"


def test_exercise_allreduce_variants_agree(executed):
    out = _stdout(_cell(executed, "ex3"))
    rows = [line for line in out.splitlines() if line.strip().endswith("ms")]
    assert len(rows) == 4 and all(" True " in r for r in rows), out


def test_committed_notebook_keeps_the_outputs_of_a_full_run():
    """The file in the repository carries the outputs of a real run (no nbclient needed)."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        assert cell.get("execution_count") is not None, f"code cell {i} has no saved run"
        assert not [o for o in cell["outputs"] if o["output_type"] == "error"], \
            f"code cell {i} has a saved error"
    assert "[[3. 3.]]" in _stdout(_cell(nb, "allreduce"))
    assert "epochs: 10 fused" in _stdout(code[0]), \
        "the saved outputs must come from a full run with the default settings"
    for tag in ("plot-acc", "bench", "ex2"):
        assert any("image/png" in o.get("data", {}) for o in _cell(nb, tag)["outputs"]), \
            f"the cell tagged {tag!r} has no saved plot"
