"""notebooks/concise-multiple-gpus.ipynb (sec. 12.6) runs top to bottom and prints the book's lines.

Executed like the chapter's notebook (test_notebooks.py): on a copy, in a kernel of this
interpreter, shortened to one epoch of one batch per run (MGPU_NB_LIMIT_BATCHES=1).
"""
import json
import pathlib
import re

import pytest

# test_every_cell_ran_without_error runs here again, on this module's `executed` notebook.
from test_notebooks import (  # noqa: F401
    _cell,
    _stdout,
    assert_books_training_line,
    run_notebook,
    test_every_cell_ran_without_error,
)

NOTEBOOK = (pathlib.Path(__file__).resolve().parents[2] / "notebooks" /
            "concise-multiple-gpus.ipynb")
SHORT_RUN = {"MGPU_NB_EPOCHS": "1", "MGPU_NB_LIMIT_BATCHES": "1"}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a short run; fails on any cell error."""
    return run_notebook(NOTEBOOK, SHORT_RUN, tmp_path_factory)


def test_the_layers_print_the_books_shapes(executed):
    out = _stdout(_cell(executed, "shapes"))
    for shape in ("(2, 64, 28, 28)", "(2, 128, 14, 14)", "(2, 256, 7, 7)", "(2, 512, 4, 4)",
                  "(2, 512, 1, 1)", "(2, 10)"):
        assert f"output shape: {shape}" in out, out
    # ResNet-18 for one input channel and 10 classes: 11,175,818 trainable parameters (the
    # figure PyTorch's d2l model gives), and the notebook's model equals mgpu.models.resnet18.
    assert "parameters: 11175818 (the same layers as mgpu.models.resnet18: True )" in out, out


@pytest.mark.parametrize("tag,num_devices", [("train-1", 1), ("train-2", 2)])
def test_training_prints_the_books_line(executed, tag, num_devices):
    assert_books_training_line(_stdout(_cell(executed, tag)), num_devices)


def test_synchronised_batch_norm_matches_one_device(executed):
    out = _stdout(_cell(executed, "sync-bn"))
    found = dict(re.findall(r"(per-device|synchronised)\s+batch norm: .*?: (\S+)$", out, re.M))
    assert set(found) == {"per-device", "synchronised"}, out
    per_device, synced = float(found["per-device"]), float(found["synchronised"])
    # Float rounding only: the 3x3 layers run as Winograd F(4x4, 3x3) (MGPU_CONV_ALGO=auto),
    # whose rounding depends on how many images a device holds (~1e-4 after this step, ~2e-5
    # with the direct kernels); per-device statistics move the parameters by ~1e-2.
    assert synced < 1e-3, out
    assert per_device > 10 * synced, out


def test_committed_notebook_keeps_the_outputs_of_a_run():
    """The file in the repository carries the outputs of a real (shortened) run."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        assert cell.get("execution_count") is not None, f"code cell {i} has no saved run"
        assert not [o for o in cell["outputs"] if o["output_type"] == "error"], \
            f"code cell {i} has a saved error"
    assert re.search(r"epochs: \d+, each cut to \d+ batches", _stdout(code[0]))
    assert "test acc:" in _stdout(_cell(nb, "train-2"))
