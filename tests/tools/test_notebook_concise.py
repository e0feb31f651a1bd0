"""notebooks/concise-multiple-gpus.ipynb (sec. 12.6) runs top to bottom and prints the book's lines.

Executed like the chapter's notebook (test_notebooks.py): on a copy, in a kernel of this
interpreter, shortened to one epoch of one batch per run (MGPU_NB_LIMIT_BATCHES=1), its
checkpoints in a temporary MGPU_NOTEBOOK_RUNS. The 1-device run is trained first by the command
line, as the notebook tells a reader to train the recipe, so the notebook shows a finished run it
did not train; the 2-device run is trained by the notebook; a second execution resumes both.
"""
import json
import pathlib
import re

import pytest

from mgpu import cli

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
def runs(tmp_path_factory):
    """MGPU_NOTEBOOK_RUNS, with the 1-device quick run trained by the command line."""
    runs = tmp_path_factory.mktemp("runs")
    ckpt = runs / "quick-1x1" / "d1" / "ckpt"  # where the notebook's quick run looks
    assert cli.main(["train", "--model", "resnet18", "--fused", "--num-gpus", "1",
                     "--batch-size", "256", "--lr", "0.1", "--epochs", "1", "--limit-batches",
                     "1", "--checkpoint", str(ckpt), "--checkpoint-every", "10",
                     "--resume"]) == 0
    return runs


@pytest.fixture(scope="module")
def executed(runs, tmp_path_factory):
    """The notebook after a short run; fails on any cell error."""
    return run_notebook(NOTEBOOK, {**SHORT_RUN, "MGPU_NOTEBOOK_RUNS": str(runs)},
                        tmp_path_factory)


@pytest.fixture(scope="module")
def resumed(executed, runs, tmp_path_factory):
    """The notebook executed again on the same runs: both have finished."""
    return run_notebook(NOTEBOOK, {**SHORT_RUN, "MGPU_NOTEBOOK_RUNS": str(runs)},
                        tmp_path_factory)


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


def test_a_quick_run_says_so_and_keeps_out_of_the_recipes_checkpoints(executed, runs):
    out = _stdout(_cell(executed, "setup"))
    assert out.startswith("QUICK RUN, not the recipe: 1 epoch(s), each cut to 1 batches"), out
    assert str(runs / "quick-1x1") in out
    assert not (runs / "d1").exists() and not (runs / "d2").exists()
    assert "QUICK RUN: these are not the recipe's figures" in _stdout(_cell(executed, "results"))


def _results(out):
    """{devices: (epochs, test acc, book's, sec/epoch)} from the results cell's table."""
    rows = re.findall(r"^(\d) device\(s\), batch \d+, lr [\d.]+\s+(\d+)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)$", out, re.M)
    return {int(k): (int(e), float(a), float(b), float(t)) for k, e, a, b, t in rows}


def test_the_results_stand_beside_the_books_and_name_the_cpu(executed):
    cell = _cell(executed, "results")
    out = _stdout(cell)
    assert re.search(r"^CPU: .+, \d+ threads, avx(2|512) kernels; mgpu ", out, re.M), out
    found = _results(out)
    assert set(found) == {1, 2}, out
    assert found[1][0] == found[2][0] == 1 and (found[1][2], found[2][2]) == (0.92, 0.91)
    for k in (1, 2):
        line = _stdout(_cell(executed, f"train-{k}")).strip().splitlines()[-1]
        assert line.startswith(f"test acc: {found[k][1]:.2f}, "), (line, found[k])
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for o in cell["outputs"]), "the accuracy curves were not drawn"


def test_a_run_trained_by_the_command_line_is_shown_not_retrained(executed, resumed):
    first1 = _stdout(_cell(executed, "train-1"))
    assert "resuming from " in first1 and "has finished its 1 epochs" in first1, first1
    first2 = _stdout(_cell(executed, "train-2"))
    assert "resuming from " not in first2, first2  # the notebook trained this one
    again2 = _stdout(_cell(resumed, "train-2"))
    assert "has finished its 1 epochs: its results, nothing trained" in again2, again2
    for k in (1, 2):
        before = _stdout(_cell(executed, f"train-{k}")).strip().splitlines()[-1]
        after = _stdout(_cell(resumed, f"train-{k}")).strip().splitlines()[-1]
        assert after == before
    assert _results(_stdout(_cell(resumed, "results"))) == \
        _results(_stdout(_cell(executed, "results")))


def test_committed_notebook_has_no_cut_run_passed_off_as_the_recipe():
    """The file in the repository carries either no outputs (cleared), or a run whose setup cell
    says what it was: the recipe's 10 whole epochs, or a quick run labelled as one."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        assert not [o for o in cell["outputs"] if o["output_type"] == "error"], \
            f"code cell {i} has a saved error"
    if not any(c["outputs"] for c in code):
        return  # cleared: nothing is claimed
    setup = _stdout(_cell(nb, "setup"))
    assert setup.startswith(("QUICK RUN, not the recipe", "the book's recipe: 10 whole epochs")), \
        setup
    if setup.startswith("the book's recipe"):
        found = _results(_stdout(_cell(nb, "results")))
        assert found[1][0] == found[2][0] == 10, found


def test_recomputed_statistics_evaluate_the_runs_trained_weights(executed):
    """The last section re-evaluates each run: its last and best epochs are the results' own,
    and its accuracy with batch norm's statistics recomputed is a fraction of the test set."""
    found = _results(_stdout(_cell(executed, "results")))
    out = _stdout(_cell(executed, "stats"))
    rows = re.findall(r"^(\d) device\(s\): last epoch ([\d.]+), best epoch ([\d.]+), "
                      r"statistics recomputed ([\d.]+)$", out, re.M)
    assert [int(k) for k, *_ in rows] == [1, 2], out
    for k, last, best, acc in rows:
        assert float(last) == float(best) == round(found[int(k)][1], 3), (out, found)
        assert 0.0 <= float(acc) <= 1.0, out
