"""Preemption (mgpu.loop): SIGTERM or SIGUSR1 during train / train_concise / `mgpu train` ends the
run after the current step with a checkpoint of that step, one line, mgpu.Preempted from Python
and exit status 128 + the signal from the CLI; the previous signal handlers come back; resuming
gives the bits of an uninterrupted run -- in process, for the CLI signalled at random moments,
and under mpirun with the signal sent to one rank only."""
import os
import random as pyrandom
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ckpt_worker
import mgpu
from conftest import requires_fashion_mnist

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, name, epochs=2, kill_before=None, sig=signal.SIGTERM, every=None):
    """ckpt_worker's LeNet (5 steps per epoch); ``kill_before=k`` sends ``sig`` to this process
    just before the k-th step of this session runs."""
    seen = {"n": 0}

    def step(X, y, device_params, devs, lr):
        seen["n"] += 1
        if seen["n"] == kill_before:
            os.kill(os.getpid(), sig)
        out = mgpu.train_batch(X, y, device_params, devs, lr)
        seen["params"] = device_params
        return out
    kw = {} if name is None else dict(checkpoint=str(tmp_path / name), resume=True,
                                      checkpoint_every=every)
    mgpu.train(1, ckpt_worker.BATCH, ckpt_worker.LR, num_epochs=epochs,
               params=mgpu.lenet_params(scale=0.1, seed=4), data=ckpt_worker.data(),
               progress=False, step=step, **kw)
    return seen


def _newest(ckdir):
    files = sorted(f for f in os.listdir(ckdir) if f.startswith("ckpt-"))
    return os.path.join(ckdir, files[-1])


def _params(path):
    return mgpu.load(path)["params"]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_train_stops_after_the_signalled_step_with_its_checkpoint_and_resumes_bitwise(
        tmp_path, capsys, sig):
    _train(tmp_path, "ref")
    mine = []
    previous = signal.signal(sig, lambda *a: mine.append(a))  # a handler of the caller's
    try:
        with pytest.raises(mgpu.Preempted) as e:
            _train(tmp_path, "c", kill_before=7, sig=sig, every=4)
        assert signal.getsignal(sig) is not previous and mine == []  # ours ran, not theirs
        handler = signal.getsignal(sig)
    finally:
        signal.signal(sig, previous)
    stop = e.value
    assert (stop.signal, stop.step, stop.exit_status) == (sig, 7, 128 + sig)
    assert stop.checkpoint == str(tmp_path / "c" / "ckpt-000000007.mgpu")
    assert _newest(tmp_path / "c") == stop.checkpoint
    assert int(mgpu.load(stop.checkpoint)["step"]) == 7
    name = signal.Signals(sig).name
    err = capsys.readouterr().err
    assert err.count("received") == 1
    assert f"train: {name} received: stopped after step 7; checkpoint {stop.checkpoint}; " \
           "continue with resume=True" in err
    assert callable(handler) and handler.__name__ == "<lambda>"  # the caller's, restored
    _train(tmp_path, "c")
    assert _same(_params(_newest(tmp_path / "c")), _params(_newest(tmp_path / "ref")))


def test_a_signal_during_the_evaluation_stops_at_the_epoch_end(tmp_path, monkeypatch):
    module = sys.modules["mgpu.train"]
    real = module.evaluate_accuracy
    calls = {"n": 0}

    def evaluate(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)
    monkeypatch.setattr(module, "evaluate_accuracy", evaluate)
    with pytest.raises(mgpu.Preempted) as e:
        _train(tmp_path, "c", epochs=3)
    assert e.value.step == 5 and e.value.checkpoint.endswith("ckpt-000000005.mgpu")
    assert int(mgpu.load(e.value.checkpoint)["epoch"]) == 1  # the evaluated epoch's state


def test_without_a_checkpoint_directory_the_stop_says_nothing_was_saved(tmp_path):
    with pytest.raises(mgpu.Preempted, match=r"SIGTERM received: stopped after step 3; no "
                       r"checkpoint directory was set") as e:
        _train(tmp_path, None, kill_before=3)
    assert e.value.checkpoint is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_train_concise_stops_and_resumes_bitwise_in_the_book_loop_and_fused(tmp_path,
                                                                            monkeypatch):
    nn = mgpu.nn

    def run(name, fused, kill_at=None):
        count = {"n": 0}

        def fault(point):
            count["n"] += point == "step"
            if point == "step" and count["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGUSR1)
        monkeypatch.setattr(mgpu.faults, "fault", fault)
        mgpu.random.seed(0)
        net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
        mgpu.chapter.train_concise(net, 2, ckpt_worker.BATCH, 0.2, 2, data=ckpt_worker.data(),
                                   progress=False, fused=fused, resume=True,
                                   checkpoint=str(tmp_path / name))
        return {k: v.numpy() for k, v in net.state_dict().items()}
    for fused in (False, True):
        ref = run(f"ref{fused}", fused)
        with pytest.raises(mgpu.Preempted) as e:
            run(f"c{fused}", fused, kill_at=3)
        assert e.value.step == 3 and os.path.exists(e.value.checkpoint)
        got = run(f"c{fused}", fused)
        for k in ref:
            assert np.array_equal(got[k], ref[k]), (fused, k)


def test_a_loop_outside_the_main_thread_leaves_the_handlers_alone(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    out = {}

    def body():
        try:
            out["seen"] = _train(tmp_path, "t", epochs=1)
        except BaseException as e:  # signal.signal from a thread raises ValueError
            out["error"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join(120)
    assert "error" not in out, out.get("error")
    assert out["seen"]["n"] == 5
    assert signal.getsignal(signal.SIGTERM) is before


# --- the command line, signalled at random moments ---------------------------------------------

ARGS = ["--batch-size", "64", "--limit-batches", "12", "--epochs", "2"]


def _cli(tmp_path, name, *extra, launcher=(), ranks=None):
    env = dict(os.environ, MGPU_EMULATED_GPUS="0")
    if launcher:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   MGPU_DIST_TIMEOUT="10", MGPU_DIST_CHECK="1")
        env.pop("MGPU_NUM_THREADS", None)
    cmd = [*launcher, sys.executable, "-m", "mgpu", "train", *ARGS, "--checkpoint",
           str(tmp_path / name), "--log", str(tmp_path / f"{name}.jsonl"), *extra]
    return subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _session(sid: int):
    """The pids of the processes in session ``sid`` (the run started in its own session)."""
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and os.getsid(int(p)) == sid:
                yield int(p)
        except OSError:
            continue


def _kill(proc):
    for pid in _session(proc.pid):  # mpirun's ranks too, in process groups of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return proc.communicate()


def _finish(proc, limit=180):
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        out, err = _kill(proc)
        pytest.fail(f"the training process hung\n{out}\n{err}")
    return proc.returncode, out, err


def _inode(path):
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _wait_for_new(path, before, proc, limit=120):
    """Waits until the run has (re)opened its log, which it replaces whole at its start (a new
    inode): its loop has its signal handlers from then on."""
    t0 = time.monotonic()
    while _inode(path) in (None, before):
        if proc.poll() is not None or time.monotonic() - t0 > limit:
            return False
        time.sleep(0.01)
    return True


def _steps_logged(path):
    import json
    with open(path) as f:
        return [json.loads(line) for line in f]


def _check_stop(err, ckdir, sig):
    name = signal.Signals(sig).name
    m = re.findall(rf"train: {name} received: stopped after step (\d+); checkpoint (.+?); "
                   r"continue with resume=True \(mgpu train \.\.\. --resume\)", err)
    assert len(m) == 1, err  # one line (under mpirun: rank 0's only)
    step, path = int(m[0][0]), m[0][1]
    assert path == _newest(ckdir) and int(mgpu.load(path)["step"]) == step
    return step


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
    """The uninterrupted CLI run: its final checkpoint's parameters and its log."""
    d = tmp_path_factory.mktemp("ref")
    rc, _, err = _finish(_cli(d, "ref"))
    assert rc == 0, err
    return _params(_newest(d / "ref")), _steps_logged(d / "ref.jsonl")


def _same_log(got, ref):
    keep = ("kind", "step", "epoch", "loss", "lr", "test_acc", "train_loss")
    return [{k: r.get(k) for k in keep} for r in got] == [{k: r.get(k) for k in keep}
                                                          for r in ref]


@requires_fashion_mnist
def test_cli_signalled_at_random_moments_resumes_to_the_uninterrupted_bits(tmp_path,
                                                                           cli_reference):
    rng = pyrandom.Random(int(os.environ.get("MGPU_PREEMPT_SEED", "5")))
    signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM]
    ckdir, stops, last = tmp_path / "c", 0, 0
    for attempt, sig in enumerate(signals * 2):
        if stops == len(signals):
            break
        before = _inode(tmp_path / "c.jsonl")
        proc = _cli(tmp_path, "c", "--resume")
        if not _wait_for_new(tmp_path / "c.jsonl", before, proc):
            pytest.fail("the run never opened its log\n" + "\n".join(_finish(proc)[1:]))
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(sig)
        rc, out, err = _finish(proc)
        done = os.listdir(ckdir) and int(mgpu.load(_newest(ckdir))["epoch"]) == 2
        # It finished first (a signal after its loop, the handlers restored, kills it: the
        # signal's default): start over.
        if (rc == 0 or rc == -sig) and done:
            assert _same(_params(_newest(ckdir)), cli_reference[0])
            for f in os.listdir(ckdir):
                os.unlink(ckdir / f)
            last = 0
            continue
        assert rc == 128 + sig, f"{signal.Signals(sig).name}: exit {rc}\n{err}"
        if last:
            assert f"step {last})" in out, out  # it went on from the previous stop
        last = _check_stop(err, ckdir, sig)
        stops += 1
    assert stops >= 2, f"only {stops} signals reached a running loop"
    rc, out, err = _finish(_cli(tmp_path, "c", "--resume"))
    assert rc == 0, err
    assert _same(_params(_newest(ckdir)), cli_reference[0])
    assert _same_log(_steps_logged(tmp_path / "c.jsonl"), cli_reference[1])


# --- under mpirun: the signal reaches one rank ------------------------------------------------

def _rank_pid(session: int, rank: int, limit=60):
    """The pid of the training process of ``rank`` in the session ``session`` (mpirun puts
    its children in process groups of their own)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        for p in _session(session):
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
                return int(p)
        time.sleep(0.05)
    pytest.fail(f"rank {rank}'s process never appeared")


@requires_fashion_mnist
def test_under_mpirun_a_signal_to_one_rank_stops_every_rank_at_one_step(tmp_path):
    from test_distributed import HAVE_MPI, MPIRUN
    if not HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")
    launcher = (MPIRUN, "-np", "2", "--oversubscribe")
    # 2 ranks x 1 device add in rank order: the bits of 2 devices in one process.
    rc, _, err = _finish(_cli(tmp_path, "ref", "--num-gpus", "2"))
    assert rc == 0, err
    ckdir = tmp_path / "c"
    proc = _cli(tmp_path, "c", "--resume", "--checkpoint-every", "2", launcher=launcher)
    # Rank 0 writes its first records at step 2's checkpoint: both ranks are in the loop.
    t0 = time.monotonic()
    while not os.path.exists(tmp_path / "c.jsonl") or not os.path.getsize(tmp_path / "c.jsonl"):
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            pytest.fail("the run never logged a step\n" + "\n".join(_finish(proc)[1:]))
        time.sleep(0.01)
    try:
        victim = _rank_pid(proc.pid, 1)
    except BaseException:
        _kill(proc)
        raise
    time.sleep(pyrandom.Random(2).uniform(0.0, 0.5))
    os.kill(victim, signal.SIGTERM)
    t0 = time.monotonic()
    rc, out, err = _finish(proc)
    assert time.monotonic() - t0 < 60, "the ranks took long to agree (a collective timed out?)"
    assert rc == 128 + signal.SIGTERM, f"exit {rc}\n{out}\n{err}"
    assert "DeviceError" not in err and "Traceback" not in err, err
    step = _check_stop(err, ckdir, signal.SIGTERM)
    assert 1 <= step < 24
    rc, out, err = _finish(_cli(tmp_path, "c", "--resume", "--checkpoint-every", "2",
                                launcher=launcher))
    assert rc == 0, err
    assert out.count("resuming from") == 1 and f"step {step})" in out, out
    assert _same(_params(_newest(ckdir)), _params(_newest(tmp_path / "ref")))
    log = _steps_logged(tmp_path / "c.jsonl")  # rank 0 wrote it: every step once
    assert [r["step"] for r in log if r["kind"] == "step"] == list(range(1, 25))
    ref_log = _steps_logged(tmp_path / "ref.jsonl")
    assert [(r["kind"], r["step"]) for r in log] == [(r["kind"], r["step"]) for r in ref_log]
    for a, b in zip(log, ref_log):  # the losses summed over the ranks: the global batch's
        key = "loss" if a["kind"] == "step" else "train_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-5)
        assert a.get("test_acc") == b.get("test_acc")
