"""The training loops' metrics log (train(log=...), train_concise(log=...), mgpu.loop): JSON lines
whose step and epoch records are the loop's own values -- the losses its steps returned, the lr
each step was given, the accuracies and losses it returns -- with every step once after a crash
and a resume; TensorBoard event files with the same values where the package is installed."""
import json
import sys

import numpy as np
import pytest

import ckpt_worker
import mgpu


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _crash_in_the_third_checkpoint(monkeypatch):
    """Raises in the third checkpoint write (checkpoint_every=2: steps 2, 4, then 5 at the
    first epoch's end) before its rename: the newest checkpoint is step 4, the log already holds
    step 5 and epoch 1, which the resumed run must drop and write again."""
    count = {"n": 0}

    def crash(point):
        count["n"] += point == "rename"
        if point == "rename" and count["n"] == 3:
            raise KeyboardInterrupt("simulated crash")
    monkeypatch.setattr(mgpu.faults, "fault", crash)


def _train(tmp_path, epochs=2, log="log.jsonl", name=None, seen=None, **kw):
    """ckpt_worker's LeNet run (5 steps per epoch, the last one short), with a cosine schedule
    so that the lr changes every step; ``seen`` collects (lr, mean loss) of each step as the
    step itself computed them."""
    def step(X, y, device_params, devs, lr):
        out = mgpu.train_batch(X, y, device_params, devs, lr)
        if seen is not None:
            seen.append((lr, sum(v.item() for v in out) / X.shape[0]))
        return out
    extra = {} if name is None else dict(checkpoint=str(tmp_path / name), checkpoint_every=2,
                                         resume=True)
    extra.update(kw)
    return mgpu.train(1, ckpt_worker.BATCH, ckpt_worker.LR, num_epochs=epochs,
                      params=mgpu.lenet_params(scale=0.1, seed=4), data=ckpt_worker.data(),
                      progress=False, step=step, schedule="cosine", log=str(tmp_path / log),
                      **extra)


def test_train_logs_each_step_and_epoch_as_the_loop_computed_them(tmp_path):
    seen = []
    result = _train(tmp_path, epochs=2, seen=seen)
    recs = _records(tmp_path / "log.jsonl")
    steps = [r for r in recs if r["kind"] == "step"]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["epoch"] for r in steps] == [1] * 5 + [2] * 5
    for r, (lr, loss) in zip(steps, seen):
        assert r["lr"] == lr  # the lr the step was given, not the schedule's next one
        assert r["loss"] == pytest.approx(loss, rel=1e-12)
        assert r["images_per_s"] > 0 and r["time"] > 1.6e9
    assert len({r["lr"] for r in steps}) == 10  # the cosine schedule moved it every step
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["step"] for r in epochs] == [5, 10]
    assert [r["test_acc"] for r in epochs] == result.test_acc
    assert [r["train_loss"] for r in epochs] == result.train_loss
    assert [r["sec_per_epoch"] for r in epochs] == result.epoch_times
    # An epoch's loss is its steps' losses weighted by their batches (the last one is short).
    sizes = [64, 64, 64, 64, 24]
    for e in range(2):
        mean = sum(r["loss"] * n for r, n in zip(steps[5 * e:5 * e + 5], sizes)) / 280
        assert mean == pytest.approx(result.train_loss[e], rel=1e-6)


def test_pandas_reads_the_log(tmp_path):
    pd = pytest.importorskip("pandas", reason="pandas is not installed in this venv")
    _train(tmp_path, epochs=1)
    frame = pd.read_json(tmp_path / "log.jsonl", lines=True)
    assert list(frame["kind"]) == ["step"] * 5 + ["epoch"]
    assert frame["loss"].iloc[:5].notna().all()


def test_train_concise_logs_its_losses_and_the_fused_step_too(tmp_path):
    nn = mgpu.nn
    for fused in (False, True):
        mgpu.random.seed(0)
        net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
        path = tmp_path / f"concise{fused}.jsonl"
        result = mgpu.chapter.train_concise(net, 2, ckpt_worker.BATCH, 0.2, 2,
                                            data=ckpt_worker.data(), progress=False,
                                            fused=fused, log=str(path))
        recs = _records(path)
        steps = [r for r in recs if r["kind"] == "step"]
        epochs = [r for r in recs if r["kind"] == "epoch"]
        assert [r["step"] for r in steps] == list(range(1, 11))
        assert all(r["lr"] == 0.2 for r in steps)
        for e in range(2):  # the loop's epoch loss is the mean of its step losses, exactly
            assert float(np.mean([r["loss"] for r in steps[5 * e:5 * e + 5]])) == \
                result.train_loss[e]
        assert [r["test_acc"] for r in epochs] == result.test_acc


def test_a_resumed_run_appends_every_step_once_with_the_uninterrupted_values(
        tmp_path, monkeypatch):
    _train(tmp_path, epochs=3, log="ref.jsonl")
    ref = _records(tmp_path / "ref.jsonl")
    _crash_in_the_third_checkpoint(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, epochs=3, name="c")
    monkeypatch.undo()
    assert [r["step"] for r in _records(tmp_path / "log.jsonl")][-2:] == [5, 5]
    with open(tmp_path / "log.jsonl", "a") as f:
        # A record past the checkpoint (written before a kill) and a line torn by a kill.
        f.write('{"kind": "step", "step": 7, "loss": 1.0}\n{"kind": "step", "step": 9, "ep')
    _train(tmp_path, epochs=3, name="c")
    got = _records(tmp_path / "log.jsonl")
    strip = ("time", "images_per_s", "sec_per_epoch")
    assert [{k: v for k, v in r.items() if k not in strip} for r in got] == \
        [{k: v for k, v in r.items() if k not in strip} for r in ref]


def test_a_fresh_run_starts_the_log_anew_and_bad_paths_are_refused(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"kind": "step", "step": 99}\n')
    _train(tmp_path, epochs=1)
    assert [r["step"] for r in _records(tmp_path / "log.jsonl")] == [1, 2, 3, 4, 5, 5]
    with pytest.raises(ValueError, match="is a directory; pass a file"):
        _train(tmp_path, epochs=1, log=".")
    with pytest.raises(TypeError, match="log must be a file path"):
        mgpu.train(1, 64, 0.1, data=ckpt_worker.data(), log=3)


def test_tensorboard_without_the_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _train(tmp_path, epochs=1, tensorboard=str(tmp_path / "tb"))
    assert not (tmp_path / "tb").exists()


def test_tensorboard_event_files_hold_the_logged_values(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional; "
                        ".ci/setup.sh installs it for the tests)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _train(tmp_path, epochs=3, log="ref.jsonl")
    ref = _records(tmp_path / "ref.jsonl")
    _crash_in_the_third_checkpoint(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, epochs=3, name="c", tensorboard=str(tmp_path / "tb"))
    monkeypatch.undo()
    _train(tmp_path, epochs=3, name="c", tensorboard=str(tmp_path / "tb"))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    # Every step once (the first session's records past its checkpoint dropped on resume).
    assert [s for s, _ in loss] == list(range(1, 16))
    want = [r["loss"] for r in ref if r["kind"] == "step"]
    assert [v for _, v in loss] == [float(np.float32(v)) for v in want]
    test_acc = [(e.step, e.value) for e in acc.Scalars("test/acc")]
    assert test_acc == [(r["step"], float(np.float32(r["test_acc"])))
                        for r in ref if r["kind"] == "epoch"]
