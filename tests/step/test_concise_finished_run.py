"""train_concise resumed from the checkpoint of a run that has finished all its epochs: it trains
nothing, changes no parameter, and prints the finished run's line (test accuracy and sec/epoch
over every epoch, those of the earlier session included) -- how the concise notebook shows a run
trained elsewhere."""
import re

import numpy as np

import ckpt_worker
import mgpu
from mgpu import nn
from mgpu.chapter import Timer


def _net():
    mgpu.random.seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))


def _run(tmp_path, epochs):
    net = _net()
    result = mgpu.chapter.train_concise(net, 2, ckpt_worker.BATCH, 0.2, epochs,
                                        data=ckpt_worker.data(), progress=False, fused=True,
                                        checkpoint=str(tmp_path / "ckpt"), checkpoint_every=3,
                                        resume=True)
    return {k: v.numpy() for k, v in net.state_dict().items()}, result


class _Timer(Timer):
    """A timer on a clock that advances 2.5 s at every reading, so the tiny epochs' times print
    as more than 0.0 and a line that averaged no times would differ."""
    clock = 0.0

    def start(self):
        _Timer.clock += 2.5
        self._start = _Timer.clock

    def stop(self):
        _Timer.clock += 2.5
        self.times.append(_Timer.clock - self._start)
        return self.times[-1]


def test_resuming_a_finished_run_prints_its_results_without_training(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(mgpu.chapter, "Timer", _Timer)
    done, first = _run(tmp_path, 2)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == f"test acc: {first.test_acc[-1]:.2f}, {np.mean(first.epoch_times):.1f} " \
                   "sec/epoch on [cpu(0), cpu(1)]"
    again, second = _run(tmp_path, 2)
    out = capsys.readouterr().out
    assert re.search(r"^resuming from .*ckpt-\d+\.mgpu \(epoch 3, step \d+\)$", out, re.M), out
    assert "has finished its 2 epochs: its results, nothing trained" in out
    assert out.strip().splitlines()[-1] == line  # the first session's figures, not 0.0 sec
    assert np.mean(first.epoch_times) >= 2.5
    for name in (f.name for f in first.__dataclass_fields__.values() if f.name != "devices"):
        assert getattr(second, name) == getattr(first, name), name
    for k in done:
        np.testing.assert_array_equal(again[k], done[k], err_msg=k)
