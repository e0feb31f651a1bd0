"""Checkpoints (mgpu.checkpoint): the file format, its refusals, atomic writes, and training that
resumes to the very bits of an uninterrupted run -- after an exception, after SIGKILL at chosen
and random points (also while a checkpoint is being written), and under mpirun after a rank is
killed. Training runs are small LeNets on synthetic data (tests/ckpt_worker.py)."""
import errno
import json
import os
import random as pyrandom
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import ckpt_worker
import mgpu
from conftest import crash_at_step, requires_fashion_mnist
from mgpu import checkpoint as ck
from mgpu.data import array_loader

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nested():
    return {"w": mgpu.array(np.arange(12, dtype=np.float32).reshape(3, 4) / 7),
            "count": mgpu.array(np.array(5, dtype=np.int64)),
            "raw": np.arange(6, dtype=np.uint8).reshape(2, 3),
            "state": {0: {"momentum_buffer": mgpu.array(np.full(3, -0.1, np.float32))}},
            "pair": (1, "two", None, True), "nan": float("nan"), "inf": -float("inf"),
            "big": 2**100 + 1, "f": 0.1, "empty": np.zeros((0, 4), np.float32)}


def test_save_load_round_trip_is_exact_and_keeps_kinds(tmp_path):
    path = tmp_path / "a.mgpu"
    obj = _nested()
    mgpu.save(obj, path)
    got = mgpu.load(path)
    assert isinstance(got["w"], mgpu.Tensor) and isinstance(got["raw"], np.ndarray)
    assert np.array_equal(got["w"].numpy(), obj["w"].numpy())
    assert got["count"].dtype == np.int64 and int(got["count"].item()) == 5
    assert np.array_equal(got["raw"], obj["raw"]) and got["raw"].dtype == np.uint8
    assert list(got["state"]) == [0]  # an int key stays an int (SGD.state_dict)
    assert np.array_equal(got["state"][0]["momentum_buffer"].numpy(), np.full(3, -0.1, np.float32))
    assert got["pair"] == (1, "two", None, True)
    assert np.isnan(got["nan"]) and got["inf"] == -float("inf")
    assert got["big"] == 2**100 + 1 and got["f"] == 0.1
    assert got["empty"].shape == (0, 4)
    # A safetensors file: u64 header length, JSON header, contiguous little-endian tensor bytes.
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert header["__metadata__"]["format"] == "mgpu.checkpoint"
    assert header["__metadata__"]["version"] == "1"
    entries = sorted((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__")
    assert entries[0][0][0] == 0 and entries[-1][0][1] == len(data) - 8 - n
    for (a, b), (c, _), in zip([e[0] for e in entries], [e[0] for e in entries[1:]]):
        assert b == c  # no gaps, no overlaps
    w = header["w"]
    assert w["dtype"] == "F32" and w["shape"] == [3, 4]
    start = 8 + n + w["data_offsets"][0]
    assert np.array_equal(np.frombuffer(data[start:start + 48], "<f4").reshape(3, 4),
                          obj["w"].numpy())


def test_save_refuses_objects_a_checkpoint_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match=r"state\.f is a builtin_function.*no pickle"):
        mgpu.save({"state": {"f": len}}, tmp_path / "x.mgpu")
    with pytest.raises(TypeError, match="dtype complex64"):
        mgpu.save([np.zeros(2, np.complex64)], tmp_path / "x.mgpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mgpu.save([1], tmp_path / "no" / "x.mgpu")
    assert os.listdir(tmp_path) == []


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.mgpu"
    mgpu.save(_nested(), path)
    return path


def _refused(path, pattern):
    with pytest.raises(ck.CheckpointError, match=pattern) as e:
        mgpu.load(path)
    assert str(path) in str(e.value)  # names the file
    assert isinstance(e.value, ValueError)


def test_a_flipped_byte_anywhere_is_refused(good, tmp_path):
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    rng = np.random.default_rng(0)
    # The length, the JSON header (its checksum included), and the tensor bytes.
    spots = [0, 3, 8, 20, data.index(b"sha256:") + 10, 8 + n // 2, 8 + n - 1, 8 + n,
             len(data) - 1, *rng.integers(8, len(data), size=12)]
    for i in spots:
        bad = bytearray(data)
        bad[i] ^= 1 << int(rng.integers(0, 8))
        p = tmp_path / f"flip{i}.mgpu"
        p.write_bytes(bytes(bad))
        _refused(p, "corrupt|truncated|not an mgpu checkpoint|not valid JSON")


def test_a_truncated_file_is_refused(good, tmp_path):
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for size in (0, 5, 8, 8 + n // 2, 8 + n, len(data) - 1):
        p = tmp_path / f"cut{size}.mgpu"
        p.write_bytes(data[:size])
        _refused(p, "truncated")


def test_other_versions_and_files_that_are_not_checkpoints_are_refused(good, tmp_path):
    data = good.read_bytes()
    p = tmp_path / "v2.mgpu"
    p.write_bytes(data.replace(b'"version":"1"', b'"version":"2"', 1))
    _refused(p, "format version '2'; this mgpu reads version 1")
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "PWNED"),))
    p = tmp_path / "evil.pkl"
    p.write_bytes(pickle.dumps(Boom()))
    _refused(p, "truncated, or not an mgpu checkpoint")
    assert not (tmp_path / "PWNED").exists()  # loading never runs code
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a checkpoint at all\n")
    _refused(p, "not an mgpu checkpoint")
    header = json.dumps({"__metadata__": {"format": "pt"}, "x": {
        "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    p = tmp_path / "other.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    other = mgpu.load(p)  # another program's safetensors file: its tensors by name
    assert list(other) == ["x"] and np.array_equal(other["x"].numpy(), np.zeros(1, np.float32))
    with pytest.raises(ck.CheckpointError, match="not an mgpu checkpoint"):
        ck.read_meta(p)  # but it has no mgpu structure to read
    _refused(tmp_path, "is a directory")


def test_a_failed_write_never_touches_the_last_good_file(good, tmp_path, monkeypatch):
    before = good.read_bytes()
    real_write = os.write
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 2:  # the header went out; the disk fills during the tensor bytes
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match=r"writing .*good\.mgpu failed.*previous file is unchanged") \
            as e:
        mgpu.save({"w": np.ones(1000, np.float32), "v": np.ones(10, np.float32)}, good)
    assert e.value.errno == errno.ENOSPC
    assert good.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["good.mgpu"]  # no temporary file left behind
    calls.clear()
    with pytest.raises(OSError, match="nothing was written"):
        mgpu.save({"w": np.ones(1000, np.float32), "v": np.ones(10, np.float32)},
                  tmp_path / "new.mgpu")
    assert sorted(os.listdir(tmp_path)) == ["good.mgpu"]


def test_a_real_file_size_limit_fails_the_write_cleanly(good, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the write (EFBIG), as a full disk would (ENOSPC)."""
    before = good.read_bytes()
    code = (
        "import resource, signal, numpy as np, mgpu\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        f"mgpu.save({{'w': np.ones(100000, np.float32)}}, {str(good)!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "File too large" in proc.stderr and "previous file is unchanged" in proc.stderr
    assert good.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["good.mgpu"]


def test_the_bytes_are_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        return real_fsync(fd)

    def replace(a, b):
        events.append("rename")
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    mgpu.save([np.ones(3, np.float32)], tmp_path / "x.mgpu")
    assert events == ["fsync-file", "rename", "fsync-dir"]


# --- the data loader's position --------------------------------------------------------------

def _labels_of(loader, epochs=None):
    return [y.numpy().tolist() for _, y in loader]


def test_a_data_loader_resumes_mid_epoch_with_the_same_batches():
    images = np.arange(100 * 4, dtype=np.uint8).reshape(100, 2, 2)
    labels = (np.arange(100) % 256).astype(np.uint8)
    a = array_loader(images, labels, 16, shuffle=True, seed=3)
    first = _labels_of(a)
    it = iter(a)
    head = [next(it)[1].numpy().tolist() for _ in range(3)]
    state = a.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 3)
    rest = [y.numpy().tolist() for _, y in it]
    after = _labels_of(a)
    b = array_loader(images, labels, 16, shuffle=True, seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert _labels_of(b) == rest and _labels_of(b) == after
    assert head + rest != first  # epochs are shuffled differently
    c = array_loader(images, labels, 16, shuffle=True, seed=4)
    with pytest.raises(ValueError, match=r"another data order: seed 3 \(this loader: 4\)"):
        c.load_state_dict(state)
    assert c.state_dict()["epoch"] == -1  # unchanged
    assert a.state_dict()["epoch"] == 3 and a.state_dict()["batch"] == 0  # iteration ended
    d = array_loader(images, labels, 16, shuffle=True, seed=3)
    d.load_state_dict(dict(state, batch=len(d)))  # after the last batch: the rest is empty
    assert _labels_of(d) == [] and _labels_of(d) == after


# --- training resumes bit for bit --------------------------------------------------------------

def _run(tmp_path, name, epochs, crash_at=None, devices=1, every=2, monkeypatch=None,
         **kw):
    """ckpt_worker's training in this process; crash_at=k raises after the k-th step."""
    seen = {"n": 0}

    def step(X, y, device_params, devs, lr):
        out = mgpu.train_batch(X, y, device_params, devs, lr)
        seen["params"] = device_params
        seen["n"] += 1
        if seen["n"] == crash_at:
            raise KeyboardInterrupt("simulated crash")
        return out
    ckdir = None if name is None else str(tmp_path / name)
    extra = {} if ckdir is None else dict(checkpoint=ckdir, checkpoint_every=every, resume=True)
    extra.update(kw)
    result = mgpu.train(devices, ckpt_worker.BATCH, ckpt_worker.LR, num_epochs=epochs,
                        params=mgpu.lenet_params(scale=0.1, seed=4), data=ckpt_worker.data(),
                        progress=False, step=step, **extra)
    return [p.numpy() for p in seen["params"][0]], result


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("crash_at, every", [(7, 3), (2, 1), (10, None)])
def test_train_resumed_after_a_crash_ends_bitwise_like_an_uninterrupted_run(
        tmp_path, crash_at, every):
    mgpu.random.seed(5)
    ref, ref_result = _run(tmp_path, None, 3)
    ref_rng = mgpu.random.get_state()
    mgpu.random.seed(5)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "c", 3, crash_at=crash_at, every=every)
    mgpu.random.seed(6)  # the resumed run takes the generator's state from the checkpoint
    got, result = _run(tmp_path, "c", 3, every=every)
    assert _same(got, ref)
    assert result.train_loss == ref_result.train_loss
    assert result.test_acc == ref_result.test_acc
    assert mgpu.random.get_state() == ref_rng


@pytest.mark.parametrize("point, n", [("prune", 6), ("rename", 7), ("step", 10)])
def test_train_resumed_after_a_crash_inside_a_checkpoint_write_ends_bitwise(
        tmp_path, monkeypatch, point, n):
    """Writes with every=2 over 3 epochs of 5 steps: steps 2, 4, 5 (epoch end), 6, 8, 10 (after
    the epoch's last step, before its evaluation), 10 (epoch end)...: prune@6 resumes from the
    file of an epoch whose batches are all done but which is not yet evaluated."""
    ref, ref_result = _run(tmp_path, None, 3)
    count = {"n": 0}

    def crash(where):
        count["n"] += where == point
        if where == point and count["n"] == n:
            raise KeyboardInterrupt(f"simulated crash at {point}@{n}")
    monkeypatch.setattr(mgpu.faults, "fault", crash)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "c", 3)
    monkeypatch.undo()
    got, result = _run(tmp_path, "c", 3)
    assert _same(got, ref)
    assert result.train_loss == ref_result.train_loss
    assert result.test_acc == ref_result.test_acc


def test_two_devices_resume_bitwise_and_another_device_count_is_refused(tmp_path):
    ref, _ = _run(tmp_path, None, 2, devices=2)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "c", 2, crash_at=6, devices=2)
    with pytest.raises(ck.CheckpointError, match=r"ckpt-000000005\.mgpu: was written by a run on "
                       r"2 device\(s\) x 1 process\(es\), this run has 1 x 1"):
        _run(tmp_path, "c", 2, devices=1)
    got, _ = _run(tmp_path, "c", 2, devices=2)
    assert _same(got, ref)


def _final_params(ckdir):
    newest = sorted(f for f in os.listdir(ckdir) if f.startswith("ckpt-"))[-1]
    return mgpu.load(os.path.join(ckdir, newest))["params"]


def test_deterministic_training_resumes_on_another_device_count(tmp_path, monkeypatch):
    def train(name, devices, deterministic=True):
        return mgpu.train(devices, ckpt_worker.BATCH, ckpt_worker.LR, num_epochs=2,
                          params=mgpu.lenet_params(scale=0.1, seed=4), data=ckpt_worker.data(),
                          progress=False, deterministic=deterministic,
                          checkpoint=str(tmp_path / name), checkpoint_every=3, resume=True)
    train("ref", 1)
    count = {"n": 0}

    def crash(point):
        count["n"] += point == "step"
        if count["n"] == 8:
            raise KeyboardInterrupt("simulated crash")
    monkeypatch.setattr(mgpu.faults, "fault", crash)
    with pytest.raises(KeyboardInterrupt):
        train("c", 2)
    monkeypatch.undo()
    with pytest.raises(ck.CheckpointError, match="written with deterministic=8 .*this run has "
                       "deterministic=False"):
        train("c", 3, deterministic=False)
    train("c", 3)  # 3 devices continue what 2 started: the bits of 1 device
    assert _same(_final_params(tmp_path / "c"), _final_params(tmp_path / "ref"))


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    _run(tmp_path, "c", 1)
    with pytest.raises(ValueError, match="already holds checkpoints.*resume=True"):
        _run(tmp_path, "c", 1, resume=False)
    with pytest.raises(ValueError, match="need checkpoint=DIR"):
        mgpu.train(1, 64, 0.1, resume=True, data=ckpt_worker.data())
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1"):
        _run(tmp_path, "d", 1, every=0)
    with pytest.raises(TypeError, match="must be an mgpu DataLoader"):
        mgpu.train(1, 64, 0.1, checkpoint=str(tmp_path / "e"), data=([], []))


def test_a_mismatched_checkpoint_is_refused_and_nothing_is_loaded(tmp_path):
    _run(tmp_path, "c", 1)  # 5 steps: ckpt-000000004 and ckpt-000000005 (epoch end)
    path = tmp_path / "c" / "ckpt-000000005.mgpu"
    state = mgpu.load(path)
    loader = ckpt_worker.data()
    rng_before = mgpu.random.get_state()

    def attempt(bad, pattern):
        mgpu.save(bad, tmp_path / "c" / "ckpt-000000009.mgpu")
        loader_state = loader[0].state_dict()
        with pytest.raises(ck.CheckpointError, match=pattern):
            mgpu.train(1, ckpt_worker.BATCH, 0.1, num_epochs=2, data=loader, progress=False,
                       checkpoint=str(tmp_path / "c"), resume=True)
        assert loader[0].state_dict() == loader_state  # the loader did not move
        assert mgpu.random.get_state() == rng_before
    wrong = dict(state, params=[np.zeros((4, 4), np.float32)] + state["params"][1:])
    attempt(wrong, r"parameters 0 has shape \(4, 4\).*another network")
    attempt(dict(state, params=state["params"][:-1]), "holds 7 parameters.*another network")
    attempt(dict(state, config=dict(state["config"], batch_size=32)), "batch size 32")
    attempt(dict(state, kind="mgpu.train_concise"), "not the state of a 'mgpu.train' run")
    attempt(dict(state, loader=dict(state["loader"], seed=12)), r"seed 12 \(this loader: 11\)")
    attempt(dict(state, rng={"bit_generator": "MT19937"}), "PCG64")
    (tmp_path / "c" / "ckpt-000000009.mgpu").write_bytes(path.read_bytes()[:1000])
    loader_state = loader[0].state_dict()
    with pytest.raises(ck.CheckpointError, match=r"ckpt-000000009\.mgpu: .*truncated"):
        mgpu.train(1, ckpt_worker.BATCH, 0.1, num_epochs=2, data=loader, progress=False,
                   checkpoint=str(tmp_path / "c"), resume=True)
    assert loader[0].state_dict() == loader_state


# --- nn.Module + SGD (the concise chapter) ----------------------------------------------------

def _small_net():
    nn = mgpu.nn
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))


def _concise(tmp_path, name, epochs, crash_at=None, devices=1, monkeypatch=None, net=None):
    if crash_at is not None:
        crash_at_step(monkeypatch, crash_at)
    mgpu.random.seed(0)  # the default init of the biases (train_concise re-draws the weights)
    net = net or _small_net()
    kw = {} if name is None else dict(checkpoint=str(tmp_path / name), checkpoint_every=2,
                                      resume=True)
    result = mgpu.chapter.train_concise(net, devices, ckpt_worker.BATCH, 0.2, epochs,
                                        data=ckpt_worker.data(), progress=False, **kw)
    return {k: v.numpy() for k, v in net.state_dict().items()}, result


def test_train_concise_resumes_bitwise_with_batch_norm_buffers(tmp_path, monkeypatch):
    ref, ref_result = _concise(tmp_path, None, 2, devices=2)
    with pytest.raises(KeyboardInterrupt):
        _concise(tmp_path, "c", 2, crash_at=7, devices=2, monkeypatch=monkeypatch)
    monkeypatch.undo()
    got, result = _concise(tmp_path, "c", 2, devices=2)
    assert list(got) == list(ref)
    for k in ref:  # weights, BatchNorm's running statistics and its batch count
        assert np.array_equal(got[k], ref[k]), k
    assert int(got["1.num_batches_tracked"]) == 10
    assert result.train_loss == ref_result.train_loss
    nn = mgpu.nn
    other = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    before = {k: v.numpy().copy() for k, v in other.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=r"'0\.weight' has shape \(4, 1, 3, 3\), this "
                       r"network's has \(8, 1, 3, 3\)"):
        _concise(tmp_path, "c", 3, devices=2, net=other)
    # train_concise re-draws the conv and linear weights itself; nothing else may have changed.
    for k, v in other.state_dict().items():
        if k not in ("0.weight", "5.weight"):
            assert np.array_equal(v.numpy(), before[k]), k


def test_module_and_sgd_with_momentum_continue_bitwise_through_save_and_load(tmp_path):
    rng = np.random.default_rng(0)
    X = mgpu.array(rng.random((16, 1, 28, 28)).astype(np.float32))
    y = mgpu.array(rng.integers(0, 10, 16))
    loss = mgpu.nn.CrossEntropyLoss()

    def steps(net, opt, n):
        net.train()
        for _ in range(n):
            opt.zero_grad()
            loss(net(X), y).backward()
            opt.step()
    mgpu.random.seed(1)
    net = _small_net()
    opt = mgpu.optim.SGD(net.parameters(), 0.1, momentum=0.9, weight_decay=1e-3)
    steps(net, opt, 3)
    mgpu.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "m.mgpu")
    steps(net, opt, 3)
    mgpu.random.seed(2)
    net2 = _small_net()
    opt2 = mgpu.optim.SGD(net2.parameters(), 0.5)
    state = mgpu.load(tmp_path / "m.mgpu")
    net2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    assert opt2.momentum == 0.9 and len(opt2._buffers) == len(opt2.params)
    steps(net2, opt2, 3)
    for (k, a), b in zip(net.state_dict().items(), net2.state_dict().values()):
        assert np.array_equal(a.numpy(), b.numpy()), k


# --- the command line ----------------------------------------------------------------------------

def _cli(*args):
    env = dict(os.environ, MGPU_EMULATED_GPUS="0")
    return subprocess.run([sys.executable, "-m", "mgpu", "train", *map(str, args)], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=300)


@requires_fashion_mnist
def test_cli_checkpoints_resumes_and_refuses_a_damaged_or_foreign_checkpoint(tmp_path):
    d = tmp_path / "run"
    common = ["--batch-size", "32", "--limit-batches", "2", "--checkpoint", d]
    r = _cli(*common, "--epochs", "1", "--checkpoint-every", "1")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == ["ckpt-000000001.mgpu", "ckpt-000000002.mgpu"]
    r = _cli(*common, "--epochs", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout and "(epoch 2, step 2)" in r.stdout
    assert int(mgpu.load(d / "ckpt-000000004.mgpu")["step"]) == 4
    r = _cli(*common, "--epochs", "2")
    assert r.returncode == 2 and "already holds checkpoints" in r.stderr
    r = _cli("--model", "resnet18", *common, "--epochs", "3", "--resume")
    assert r.returncode == 2
    assert "ckpt-000000004.mgpu: holds 'mgpu.train', not the state of a 'mgpu.train_concise'" \
        in r.stderr
    newest = d / "ckpt-000000004.mgpu"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    r = _cli(*common, "--epochs", "3", "--resume")
    assert r.returncode == 2
    assert f"mgpu: error: checkpoint {newest}: checksum mismatch" in r.stderr
    assert "Traceback" not in r.stderr


# --- SIGKILL at chosen and random points -------------------------------------------------------

def _worker(ckdir, out, epochs=3, every=2, devices=1, env=None):
    full = dict(os.environ, **(env or {}))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_worker.py"), str(ckdir),
                             str(out), str(epochs), str(every), str(devices)],
                            cwd=HERE, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc, limit=120):
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the training process hung\n{out}\n{err}")
    return proc.returncode, out, err


def _arrays(path):
    with np.load(path) as z:
        return [z[k] for k in z.files]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's final parameters, losses and accuracies (no checkpoints)."""
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    rc, _, err = _finish(_worker("-", out))
    assert rc == 0, err
    return _arrays(out)


# Each entry kills one process; the run is then resumed until it finishes. "point@n" is
# MGPU_TEST_CHECKPOINT_FAULT (n counts in the killed process); "time" kills after a random delay.
KILLS = ["write@2", "rename@1", "step@3", "dirsync@2", "prune@1", "time"]


def test_sigkill_at_many_points_then_resume_gives_the_uninterrupted_bits(tmp_path, reference):
    rng = pyrandom.Random(int(os.environ.get("MGPU_KILL_SEED", "13")))
    kills = list(KILLS)
    extra = int(os.environ.get("MGPU_KILL_POINTS", "0"))  # more random points for a long soak
    points = ["write", "rename", "dirsync", "prune", "step", "time"]
    kills += [f"{p}@{rng.randint(1, 3)}" if p != "time" else p
              for p in (rng.choice(points) for _ in range(extra))]
    ckdir, out = tmp_path / "c", tmp_path / "final.npz"
    killed = 0
    for kill in kills:
        env = {} if kill == "time" else {"MGPU_TEST_CHECKPOINT_FAULT": kill}
        proc = _worker(ckdir, out, env=env)
        if kill == "time":
            time.sleep(rng.uniform(0.5, 3.0))
            proc.send_signal(signal.SIGKILL)
        rc, _, err = _finish(proc)
        if rc == 0:  # the run finished before the kill point: start over for the next kill
            assert _same(_arrays(out), reference), f"after {kill}: the final bits differ"
            for f in os.listdir(ckdir):
                os.unlink(ckdir / f)
            continue
        assert rc == -signal.SIGKILL, f"{kill}: exit {rc}\n{err}"
        killed += 1
    assert killed >= len(KILLS) - 1, f"only {killed} of {len(kills)} kills hit a running process"
    rc, _, err = _finish(_worker(ckdir, out))
    assert rc == 0, err
    assert _same(_arrays(out), reference)
    print(f"{killed} processes killed with SIGKILL, resumed to identical bits")


# --- under mpirun: a rank killed mid-step, then --resume ----------------------------------------

def _mpirun(ckdir, out, env=None, limit=120, det=False):
    from test_distributed import MPIRUN, run_watched
    full = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                MGPU_DIST_TIMEOUT="10", **(env or {}))
    full.pop("MGPU_NUM_THREADS", None)
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", sys.executable,
           os.path.join(HERE, "ckpt_worker.py"), str(ckdir), str(out), "3", "2", "1",
           *(["det"] if det else [])]
    return run_watched(cmd, full, limit, "mpirun")


def _needs_mpi():
    from test_distributed import HAVE_MPI
    if not HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")


def test_a_rank_killed_mid_step_ends_the_job_naming_it_and_resume_gives_the_same_bits(tmp_path):
    _needs_mpi()
    # 2 ranks x 1 device sum in rank order: the parameters of 2 devices in one process.
    ref, ref_result = _run(tmp_path, None, 3, devices=2)
    ckdir, out = tmp_path / "c", tmp_path / "final.npz"
    rc, stdout, err, secs = _mpirun(ckdir, out, env={"MGPU_TEST_CHECKPOINT_FAULT": "step@7",
                                                     "MGPU_TEST_CHECKPOINT_FAULT_RANK": "1"})
    assert rc != 0 and not out.exists()
    assert secs < 60, f"the job took {secs:.0f} s to end after rank 1 died (timeout 10 s)"
    assert "rank 1" in err and ("signal 9" in err or "Killed" in err), err
    assert sorted(os.listdir(ckdir)) == ["ckpt-000000005.mgpu", "ckpt-000000006.mgpu"]
    rc, stdout, err, _ = _mpirun(ckdir, out)
    assert rc == 0, err
    assert stdout.count("resuming from") == 1 and "ckpt-000000006.mgpu" in stdout  # rank 0
    got = _arrays(out)
    assert _same(got[:8], ref)
    assert got[9].tolist() == ref_result.test_acc


def test_a_deterministic_run_killed_under_mpirun_resumes_in_one_process(tmp_path, monkeypatch):
    """2 ranks x 1 device, rank 1 killed mid-epoch; 1 process with 1 device then finishes the
    run, rank 0's losses of the interrupted epoch carried over: the deterministic run's bits."""
    _needs_mpi()
    ckdir = tmp_path / "c"
    rc, _, err, _ = _mpirun(ckdir, "-", det=True, env={"MGPU_TEST_CHECKPOINT_FAULT": "step@7",
                                                       "MGPU_TEST_CHECKPOINT_FAULT_RANK": "1"})
    assert rc != 0 and "rank 1" in err, err
    assert sorted(os.listdir(ckdir))[-1] == "ckpt-000000006.mgpu"

    def run(name):
        return mgpu.train(1, ckpt_worker.BATCH, ckpt_worker.LR, num_epochs=3,
                          params=mgpu.lenet_params(scale=0.1, seed=4), data=ckpt_worker.data(),
                          progress=False, deterministic=True, checkpoint=str(tmp_path / name),
                          checkpoint_every=2, resume=True)
    ref = run("ref")
    got = run("c")
    assert _same(_final_params(ckdir), _final_params(tmp_path / "ref"))
    assert got.test_acc == ref.test_acc
    assert np.allclose(got.train_loss, ref.train_loss, rtol=1e-6)  # summed in another order
