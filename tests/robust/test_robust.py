"""No crash, no hang, no silent wrong answer: huge shapes, sticky failures, threads
sharing devices, the queue's byte budget, NaN, version counters, overlapping in-place ops,
DLPack order, and clear errors at the Python boundary.

Whatever could crash or hang the interpreter runs in a subprocess with a watchdog, so a
regression is reported as a failing test with the child's output, not a dead test run.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mgpu
from mgpu import parallel

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


def run_child(code: str, timeout: float = 120, env: dict = None) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (CPU devices only); fails the test on a hang."""
    full_env = dict(os.environ, MGPU_EMULATED_GPUS="0", **(env or {}))
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {timeout} s (a deadlock?); its output so far:\n"
                    f"{e.stdout}\n{e.stderr}")


def expect_raises(expr: str, kind: str, *words: str, setup: str = "") -> None:
    """``expr`` run in a child raises the Python exception ``kind`` whose message has ``words``."""
    code = f"""
        import mgpu

        {setup}
        try:
            value = {expr}
            print("NO ERROR", getattr(value, "shape", value))
        except Exception as e:
            print("RAISED", type(e).__name__, "|", e)
            print("MRO", *[c.__name__ for c in type(e).__mro__])
    """
    r = run_child(code)
    assert r.returncode == 0, f"{expr}: the child died with status {r.returncode}\n{r.stderr}"
    assert "RAISED" in r.stdout, f"{expr}: no exception, got {r.stdout!r}"
    assert f" {kind} " in r.stdout.splitlines()[-1] + " ", f"{expr}: {r.stdout}"
    for w in words:
        assert w in r.stdout, f"{expr}: {w!r} missing from {r.stdout!r}"


# --- 1. checked sizes ---------------------------------------------------------------------------

HUGE = [
    ("mgpu.ones((2**62,))", "ValueError", ["ones", "4611686018427387904", "bytes"]),
    ("mgpu.zeros((2**32, 2**32))", "ValueError", ["zeros", "4294967296", "bytes"]),
    ("mgpu.arange(16).reshape(2**62 + 4, 4)", "ValueError", ["reshape", "overflows"]),
    ("mgpu.zeros((2, 3)).reshape(-1, 2**62, 2**3)", "ValueError", ["reshape"]),
    ("mgpu.ones((2**46,))", "MemoryError", ["ones", "bytes"]),
    ("mgpu.conv2d(mgpu.ones((1, 1, 4, 4)), mgpu.ones((1, 1, 3, 3)), padding=2**31 - 1)",
     "ValueError", ["conv2d_forward", "4294967296", "bytes"]),
    ("mgpu.conv2d(mgpu.ones((1, 1, 4, 4)), mgpu.ones((1, 1, 3, 3)), padding=2**62)",
     "ValueError", ["conv2d_forward", "padding"]),
    ("mgpu.conv2d(mgpu.zeros((2**62 + 1, 0, 1, 1)), mgpu.ones((1, 0, 1, 1)))",
     "ValueError", ["conv2d_forward", "4611686018427387905"]),
    ("mgpu.avg_pool2d(mgpu.zeros((2**62 + 1, 1, 0, 2)), (1, 1), stride=(1, 1)).shape",
     "ValueError", ["avg_pool2d"]),
    ("mgpu.cross_entropy(mgpu.zeros((2**62 + 1, 0)), mgpu.zeros((3,), dtype='int64'))",
     "ValueError", ["cross_entropy"]),
    ("mgpu.mm(mgpu.zeros((2**62 + 1, 0)), mgpu.zeros((0, 2**62 + 1)))", "ValueError", ["bytes"]),
]


@pytest.mark.parametrize("expr,kind,words", HUGE, ids=[h[0][:40] for h in HUGE])
def test_huge_shapes_raise_cleanly(expr, kind, words):
    expect_raises(expr, kind, *words)


def test_memory_error_is_an_mgpu_out_of_memory_error():
    with pytest.raises(MemoryError, match=r"TiB|PiB") as info:
        mgpu.ones((2**46,))
    assert isinstance(info.value, mgpu.OutOfMemoryError)


def test_zero_sized_tensors_with_huge_leading_extents_stay_zero_sized():
    x = mgpu.zeros((2**62 + 1, 0))
    assert x.shape == (2**62 + 1, 0) and x.size == 0
    assert x.reshape(0, 5).shape == (0, 5)


# --- 2. sticky failures -------------------------------------------------------------------------

def _failed_loss(device):
    logits = mgpu.zeros((4, 3), device=device)
    labels = mgpu.array(np.array([0, 1, 7, 2]), device=device)  # 7 is out of range
    return mgpu.cross_entropy(logits, labels)


def test_a_failed_result_raises_on_every_read():
    loss = _failed_loss(C0)
    for _ in range(3):
        with pytest.raises(IndexError, match="label"):
            loss.numpy()
    with pytest.raises(IndexError, match="label"):
        loss[2].item()  # a view of it
    mgpu.waitall()


def test_a_failed_result_poisons_what_is_computed_from_it():
    loss = _failed_loss(C0)
    with pytest.raises(IndexError, match="label"):
        mgpu.waitall()
    with pytest.raises(IndexError, match="cross_entropy"):
        (loss * 2.0).numpy()  # computed after the failure was reported once
    # computed before the failure is known, on another device: the copy carries it over
    loss2 = _failed_loss(C0)
    moved = loss2.to(C1)
    with pytest.raises(IndexError, match="label"):
        mgpu.relu(moved).numpy()
    with pytest.raises(IndexError, match="label"):
        moved.numpy()
    with pytest.raises(IndexError):
        mgpu.waitall()
    # good tensors on the same devices stay readable
    assert mgpu.ones((2,), device=C0).numpy().tolist() == [1.0, 1.0]


# --- 3. threads sharing devices -----------------------------------------------------------------

# Steps from host threads on shared devices are serialised by the collective lock the fused steps
# hold (collective_submission_mutex, taken in bind_train.cpp). The tests below run with a queue
# budget of one byte: every enqueue then waits until the device has drained, so one step's
# enqueueing is spread over its whole run time and two threads' steps, if nothing serialised
# them, would interleave on every device (a forward reading parameters another step is about to
# update, gradients summed twice), which no serial order gives.
SERIAL_ENV = {"MGPU_QUEUE_MAX_BYTES": "1"}


def test_two_threads_train_on_the_same_devices_without_deadlock():
    """Each step is the same map p -> p - lr * grad(p) on one batch, so 2 x 10 steps from two
    threads must give exactly the parameters of 20 steps from one, if steps are serialised."""
    code = """
        import threading, numpy as np, mgpu
        from mgpu import parallel
        devs = [mgpu.cpu(0), mgpu.cpu(1)]
        rng = np.random.default_rng(0)
        X = mgpu.array(rng.random((32, 1, 28, 28), dtype=np.float32))
        y = mgpu.array(rng.integers(0, 10, 32))
        def replicas():
            return [parallel.get_params(mgpu.lenet_params(scale=0.1, seed=0), d) for d in devs]
        shared, alone = replicas(), replicas()
        start = threading.Barrier(2)
        def work():
            start.wait()
            for _ in range(10):
                parallel.train_batch(X, y, shared, devs, 0.1)
        threads = [threading.Thread(target=work) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for _ in range(20):
            parallel.train_batch(X, y, alone, devs, 0.1)
        same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(shared[0], alone[0]))
        replicas_agree = all(np.array_equal(a.numpy(), b.numpy())
                             for a, b in zip(shared[0], shared[1]))
        print("SAME", same, replicas_agree)
    """
    r = run_child(code, timeout=120, env=SERIAL_ENV)
    assert r.returncode == 0, r.stderr
    assert "SAME True True" in r.stdout, r.stdout + r.stderr


def test_two_threads_allreduce_on_the_same_devices_without_deadlock():
    code = """
        import threading, numpy as np, mgpu
        def work(seed):
            for i in range(200):
                ts = [mgpu.full((1000,), float(d + 1), device=mgpu.cpu(d)) for d in range(3)]
                mgpu.allreduce(ts)
                assert all((t.numpy() == 6.0).all() for t in ts)
        threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("DONE")
    """
    r = run_child(code, timeout=90)
    assert r.returncode == 0 and "DONE" in r.stdout, r.stdout + r.stderr


# --- 4. back-pressure by memory -----------------------------------------------------------------

def test_run_ahead_is_bounded_by_bytes():
    """The host enqueues 150 ops of 1 MiB outputs nobody keeps while cpu(0) is busy: with a
    4 MiB budget the queue holds about 4 MiB, not 150 (the task count alone allowed 256)."""
    code = """
        import mgpu
        from mgpu import _core
        big = mgpu.ones((1 << 24,))
        x = mgpu.ones((1 << 18,))
        mgpu.waitall()
        _core.queue_memory(mgpu.cpu(0), True)
        for _ in range(30):
            big *= 1.0  # in place, so no bytes: keeps cpu(0) busy while the host runs ahead
        for _ in range(150):
            x * 2.0
        peak = _core.queue_memory(mgpu.cpu(0))["peak_pending_bytes"]
        mgpu.waitall()
        print("PEAK", peak, _core.queue_memory(mgpu.cpu(0))["budget"])
    """
    r = run_child(code, timeout=120, env={"MGPU_QUEUE_MAX_BYTES": str(4 << 20)})
    assert r.returncode == 0, r.stderr
    peak, budget = map(int, r.stdout.split("PEAK")[1].split())
    assert budget == 4 << 20
    assert peak <= budget, f"the queue held {peak} bytes with a {budget}-byte budget"
    assert peak >= budget // 2, f"the test did not run ahead (peak {peak}); it proves nothing"


def test_default_budget_is_documented_and_sane():
    """Without MGPU_QUEUE_MAX_BYTES a queue may run ahead by 64 MiB (or an eighth of the
    machine's memory when that is less): each byte of run-ahead is memory a step holds on top of
    its own (256 MiB per queue cost 2 devices of ResNet-18 about 400 MiB of peak)."""
    info = mgpu._core.queue_memory(C0)
    assert info["pending_bytes"] >= 0
    if "MGPU_QUEUE_MAX_BYTES" in os.environ:
        pytest.skip("MGPU_QUEUE_MAX_BYTES is set")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert info["budget"] == min(64 << 20, ram // 8)


# --- 5. NaN and bad learning rates --------------------------------------------------------------

def test_relu_propagates_nan(device):
    x = mgpu.array(np.array([np.nan, -1.0, 2.0, -np.inf, np.inf], dtype=np.float32),
                   device=device).requires_grad_()
    y = mgpu.relu(x)
    got = y.numpy()
    assert np.isnan(got[0]) and got[1:].tolist() == [0.0, 2.0, 0.0, np.inf]
    y.backward(mgpu.ones((5,), device=device))
    assert x.grad.numpy().tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # PyTorch: NaN passes dy


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), 0.0, -0.1])
def test_bad_learning_rates(lr):
    p = mgpu.ones((3,)).attach_grad()
    with pytest.raises(ValueError, match="learning rate"):
        parallel.sgd([p], lr, 4)
    X, y = mgpu.zeros((4, 1, 28, 28)), mgpu.array(np.arange(4))
    params = [parallel.get_params(mgpu.lenet_params(seed=0), C0)]
    with pytest.raises(ValueError, match="learning rate"):
        mgpu.train_batch(X, y, params, [C0], lr)
    with pytest.raises(ValueError, match="learning rate"):
        mgpu.train(1, 4, lr, 1, data=([(X, y)], [(X, y)]))


@pytest.mark.parametrize("batch_size", [0, -3])
def test_bad_batch_sizes(batch_size):
    p = mgpu.ones((3,)).attach_grad()
    before = p.numpy().copy()
    with pytest.raises(ValueError, match="batch_size"):
        parallel.sgd([p], 0.1, batch_size)
    assert np.array_equal(p.numpy(), before)
    with pytest.raises(ValueError, match="batch_size"):
        mgpu.train(1, batch_size, 0.1, 1, data=([], []))


def test_train_stops_at_a_non_finite_loss_naming_epoch_and_step():
    rng = np.random.default_rng(0)
    X = mgpu.array(rng.random((8, 1, 28, 28), dtype=np.float32))
    y = mgpu.array(rng.integers(0, 10, 8))
    data = ([(X, y)] * 3, [(X, y)])
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 2"):
        mgpu.train(1, 8, 1e30, 2, data=data, params=mgpu.lenet_params(scale=0.1, seed=0),
                   progress=False)
    result = mgpu.train(1, 8, 1e30, 1, data=data, params=mgpu.lenet_params(scale=0.1, seed=0),
                        progress=False, check_finite=False)
    assert np.isnan(result.train_loss[0])


def test_cli_refuses_a_nan_learning_rate_in_one_line():
    r = subprocess.run([sys.executable, "-m", "mgpu", "train", "--lr", "nan", "--epochs", "1"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, MGPU_EMULATED_GPUS="0"))
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "learning rate" in r.stderr, r.stderr


def _native_stacks(pid: int) -> str:
    """Every thread's C++ stack of process pid by gdb where it is installed: a hang inside the
    C++ step shows there, where faulthandler shows only Python's frames."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb here for the native stacks)"
    r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                       capture_output=True, text=True, timeout=120)
    return "native stacks (gdb):\n" + r.stdout[-20000:] + r.stderr[-2000:]


def test_cli_ctrl_c_prints_one_line_and_exits_130():
    code = textwrap.dedent("""
        import faulthandler, signal, sys, numpy as np, mgpu, mgpu.train
        from mgpu.cli import main
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # the test's stack dump on a hang
        # A terminal's Ctrl-C: a test runner started as a background job of a non-interactive
        # shell passes SIGINT on ignored, and Python then never raises KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        loader = mgpu.data.array_loader(np.zeros((4096, 28, 28), "uint8"),
                                        np.zeros(4096, "uint8"), 64)
        mgpu.train.load_data_fashion_mnist = lambda *a, **k: (loader, loader)
        print("training", flush=True)
        sys.exit(main(["train", "--epochs", "100000"]))
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, MGPU_EMULATED_GPUS="0"))
    assert p.stdout.readline().strip() == "training"
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR2)  # every thread's Python stack, to stderr
        time.sleep(1)
        native = _native_stacks(p.pid)
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"the CLI did not stop within 60 s of Ctrl-C; its threads:\n{err}\n{native}")
    assert p.returncode == 130, (p.returncode, err)
    assert err.strip() == "mgpu: interrupted", err


def test_bench_refuses_a_data_set_smaller_than_one_batch():
    from mgpu import bench
    with pytest.raises(ValueError, match="fewer than one batch of 256"):
        bench.bench_train(devices=[1], batch_size=256, synthetic=1, epochs=1, limit_batches=1,
                          warmup=0, repeat=1, parts=["fused"], log=None)


# --- 6. version counters and overlapping in-place ops -------------------------------------------

def test_inplace_change_of_a_saved_tensor_refuses_backward():
    x = mgpu.array([1.0, 2.0]).requires_grad_()
    w = mgpu.array([3.0, 4.0])
    y = (x * w).sum()
    w += 10.0  # the product's backward reads w
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*saved by mul"):
        y.backward()
    assert x.grad is None  # nothing was half-applied


def test_inplace_change_through_a_view_and_nn_ops_is_noticed():
    x = mgpu.array(np.ones((2, 3), dtype=np.float32)).requires_grad_()
    h = mgpu.relu(x)
    x.detach()[1:] += 5.0  # a view of the same memory
    with pytest.raises(RuntimeError, match="saved by relu"):
        h.sum().backward()


def test_ops_that_do_not_read_their_inputs_allow_changes():
    """Like PyTorch: add and reshape save nothing, so changing an input after them is fine."""
    x = mgpu.array([1.0, 2.0]).requires_grad_()
    c = mgpu.array([5.0, 5.0])
    y = (x + c).reshape(2, 1)
    c += 1.0
    y.backward()
    assert x.grad.numpy().tolist() == [1.0, 1.0]


def test_versions_count_every_inplace_op():
    t = mgpu.zeros((3, 2))
    v = t._t.version
    t += 1.0
    t[1:] = 2.0
    t.zero_()
    t.fill_(3.0)
    t[0] = mgpu.ones((2,))
    mgpu.array([[1.0, 1.0]] * 3).copyto(t)
    p = mgpu.ones((3,)).attach_grad()
    parallel.sgd([p], 0.1, 1)
    assert t._t.version == v + 6 and p._t.version == 1


def test_fused_steps_and_allreduce_count_as_inplace_changes():
    """train_batch, allreduce and FusedModel.train_step (DataParallel's fused step) change their
    tensors in place: each moves their versions, so a graph that saved one refuses backward."""
    params = [parallel.get_params(mgpu.lenet_params(seed=0), C0)]
    x = mgpu.array(np.ones(10, dtype=np.float32)).requires_grad_()
    saved = (x * params[0][7]).sum()  # mul saves b4
    versions = [p._t.version for p in params[0]]
    X, y = mgpu.zeros((4, 1, 28, 28)), mgpu.array(np.arange(4))
    parallel.train_batch(X, y, params, [C0], 0.1)
    assert [p._t.version for p in params[0]] == [v + 1 for v in versions]
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*saved by mul"):
        saved.backward()
    ts = [mgpu.ones((3,), device=C0), mgpu.ones((3,), device=C1)]
    versions = [t._t.version for t in ts]
    parallel.allreduce(ts)
    assert [t._t.version for t in ts] == [v + 1 for v in versions]
    model, replicas = _fused([C0, C1])
    x = mgpu.array(np.ones(3, dtype=np.float32)).requires_grad_()
    saved = (x * replicas[0][3]).sum()  # the linear layer's bias on cpu(0)
    versions = [[p._t.version for p in r] for r in replicas]
    Xs = mgpu.array(np.random.default_rng(1).random((4, 1, 5, 5), dtype=np.float32))
    model.train_step(Xs, mgpu.array(np.array([0, 1, 2, 1])), 0.1)
    assert [[p._t.version for p in r] for r in replicas] == [[v + 1 for v in r] for r in versions]
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*saved by mul"):
        saved.backward()


def test_the_chapters_step_still_runs_backward_then_sgd():
    x = mgpu.array([1.0, 2.0]).attach_grad()
    loss = (x * x).sum()
    loss.backward()
    parallel.sgd([x], 0.5, 1)
    assert x.numpy().tolist() == [0.0, 0.0]


@pytest.mark.parametrize("case", ["a += a[0]", "a[1:] += a[:-1]", "a[:-1] -= a[1:]",
                                  "a[1:] *= a[:-1]", "a[2:] /= a[:-2] + 1"])
def test_overlapping_inplace_ops_match_numpy(case, device):
    base = np.arange(1.0, 13.0, dtype=np.float32).reshape(6, 2)
    a = base.copy()
    exec(case, {}, {"a": a})
    expected = a
    a = mgpu.array(base, device=device)
    exec(case, {}, {"a": a})
    assert np.array_equal(a.numpy(), expected), case


# --- 7. DLPack keeps the device and the order ---------------------------------------------------

def test_from_dlpack_of_a_cpu1_tensor_stays_on_cpu1_and_in_order():
    src = mgpu.zeros((1 << 16,), device=C1)
    for _ in range(50):
        src += 1.0  # pending work on cpu(1)
    view = mgpu.from_dlpack(src)
    assert view.device == C1
    view += 1.0
    assert np.all(src.numpy() == 51.0)
    cap = mgpu.from_dlpack(src.__dlpack__())  # the capsule path
    assert cap.device == C1 and np.all(cap.numpy() == 51.0)


# --- 8. clear errors at the Python boundary -----------------------------------------------------

BAD_CALLS = [
    ("parallel.train_batch(np.zeros((4, 1, 28, 28), 'float32'), y, params, [C0], 0.1)",
     TypeError, "train_batch: X must be an mgpu tensor"),
    ("parallel.train_batch(X, None, params, [C0], 0.1)", TypeError, "train_batch: y"),
    ("parallel.train_batch(X, y, [[1.0] * 8], [C0], 0.1)", TypeError, r"device_params\[0\]\[0\]"),
    ("parallel.sgd([np.zeros(3)], 0.1, 1)", TypeError, r"sgd: params\[0\]"),
    ("parallel.sgd([mgpu.ones(3).attach_grad()], 0.1, 2.5)", TypeError, "batch_size"),
    ("parallel.split_batch(np.zeros((4, 2)), y, [C0])", TypeError, "split_batch: X"),
    ("parallel.split_and_load(None, [C0])", TypeError, "split_and_load: data"),
    ("mgpu.evaluate_accuracy(params, [(np.zeros((4, 1, 28, 28)), y)], [C0])", TypeError,
     "evaluate_accuracy: X"),
    ("mgpu.ones((2.7, 3))", TypeError, "integer"),
    ("mgpu.zeros('abc')", TypeError, "shape"),
    ("mgpu.ones((2, 3)).reshape(2.0, 3)", TypeError, "integer"),
    ("mgpu.arange(3.5)", TypeError, "integer"),
    ("mgpu.ones((2,)).copyto(np.zeros(2))", TypeError, "copyto"),
    ("mgpu.ones((2,)).fill_(None)", TypeError, "fill_"),
    ("mgpu.ones((2,)).__setitem__(slice(None), None)", TypeError, "None"),
    ("mgpu.random.seed(-1)", ValueError, "seed"),
    ("mgpu.random.seed(2**70)", ValueError, "seed"),
    ("mgpu.random.seed(1.5)", TypeError, "seed"),
    ("mgpu.data.array_loader(np.zeros((4, 2, 2)), np.zeros(4), 2, seed=-5)", ValueError, "seed"),
    ("mgpu.data.array_loader(np.zeros((4, 2, 2)), np.zeros(4), 2**70)", ValueError, "batch_size"),
    ("mgpu.set_num_threads(100000)", ValueError, "set_num_threads"),
    ("mgpu.set_num_threads(0)", ValueError, "set_num_threads"),
    ("mgpu.set_num_threads(2.5)", TypeError, "set_num_threads"),
    ("mgpu.ones((-1, 2))", ValueError, "negative"),
]


@pytest.mark.parametrize("expr,kind,match", BAD_CALLS, ids=[b[0][:50] for b in BAD_CALLS])
def test_bad_arguments_raise_clear_errors(expr, kind, match):
    scope = dict(mgpu=mgpu, np=np, parallel=parallel, C0=C0, X=mgpu.zeros((4, 1, 28, 28)),
                 y=mgpu.array(np.arange(4)),
                 params=[parallel.get_params(mgpu.lenet_params(seed=0), C0)])
    threads = mgpu.num_threads()
    with pytest.raises(kind, match=match) as info:
        eval(expr, scope)
    assert "incompatible function arguments" not in str(info.value)
    assert not isinstance(info.value, AttributeError)
    assert mgpu.num_threads() == threads


# --- 7. the general fused step (mgpu._core.Model) ----------------------------------------------

FUSED_SPEC = [("conv2d", {"padding": 1}), ("relu",), ("global_avg_pool",), ("flatten",),
              ("linear", {"transpose": True})]
FUSED_SHAPES = [(4, 1, 3, 3), (4,), (3, 4), (3,)]


def _fused(devices):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in FUSED_SHAPES]
    replicas = [[mgpu.array(a, device=d) for a in arrays] for d in devices]
    return parallel.FusedModel(FUSED_SPEC, replicas, [[] for _ in devices], devices), replicas


@pytest.mark.parametrize("name,value", [("lr", float("nan")), ("lr", float("inf")), ("lr", -0.1),
                                        ("momentum", float("nan")), ("momentum", -0.5),
                                        ("weight_decay", float("inf")), ("weight_decay", -1.0)])
def test_fused_model_step_refuses_bad_hyperparameters_changing_nothing(name, value):
    model, replicas = _fused([C0, C1])
    before = [p.numpy().copy() for p in replicas[0]]
    X = mgpu.array(np.random.default_rng(1).random((4, 1, 5, 5), dtype=np.float32))
    y = mgpu.array(np.array([0, 1, 2, 1]))
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
    hyper[name] = value
    # Checked once, here (the C++ step trusts it: tests/optim/test_checks_once.py).
    with pytest.raises(ValueError, match=f"^train_step: {name}"):
        model.train_step(X, y, **hyper)
    assert all(np.array_equal(p.numpy(), b) for p, b in zip(replicas[0], before))
    with pytest.raises(TypeError, match="lr must be a number"):
        model.train_step(X, y, "0.1")


def test_two_threads_step_one_fused_model_as_one_thread():
    """A step is the same map on one batch, so 2 x 10 steps from two threads on one FusedModel
    (batch norm, momentum, weight decay) equal 20 steps from one thread exactly: parameters,
    momentum buffers and batch norm's running statistics, on every replica."""
    code = """
        import threading, numpy as np, mgpu
        from mgpu import parallel
        devs = [mgpu.cpu(0), mgpu.cpu(1)]
        spec = [("conv2d", {"padding": 1}), ("batch_norm",), ("relu",), ("global_avg_pool",),
                ("flatten",), ("linear", {"transpose": True})]
        rng = np.random.default_rng(0)
        arrays = [rng.standard_normal(s).astype(np.float32)
                  for s in [(4, 1, 3, 3), (4,), (4,), (4,), (3, 4), (3,)]]
        X = mgpu.array(rng.random((16, 1, 6, 6), dtype=np.float32))
        y = mgpu.array(rng.integers(0, 3, 16))
        def model():
            reps = [[mgpu.array(a, device=d) for a in arrays] for d in devs]
            bufs = [[mgpu.zeros((4,), device=d), mgpu.ones((4,), device=d)] for d in devs]
            return parallel.FusedModel(spec, reps, bufs, devs)
        def step(m):
            m.train_step(X, y, 0.05, momentum=0.9, weight_decay=1e-3)
        def state(m):
            out = []
            for d in range(len(devs)):
                out += [t.numpy() for t in m._model.params(d) + m._model.buffers(d)]
                out += [b.numpy() for b in m.momentum_buffers(d)]
            return out
        shared, alone = model(), model()
        start = threading.Barrier(2)
        def work():
            start.wait()
            for _ in range(10):
                step(shared)
        threads = [threading.Thread(target=work) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for _ in range(20):
            step(alone)
        a, b = state(shared), state(alone)
        half = len(a) // 2
        same = len(a) == len(b) == 2 * (6 + 2 + 6) and all(
            np.array_equal(u, v) for u, v in zip(a, b))
        agree = all(np.array_equal(u, v) for u, v in zip(a[:half], a[half:]))
        print("SAME", same, agree)
    """
    r = run_child(code, timeout=120, env=SERIAL_ENV)
    assert r.returncode == 0, r.stderr
    assert "SAME True True" in r.stdout, r.stdout + r.stderr


def test_threads_stepping_different_models_on_shared_devices_equal_sequential_steps():
    """Model.train_step holds the collective lock: without it two models' bucketed all-reduces on
    cpu(0), cpu(1) cross (a hang, caught by the watchdog) or mix gradients (wrong numbers). Two
    threads each train their own small residual net with batch norm (momentum, weight decay)
    while a third runs LeNet's train_batch, all on the same two devices; each must end bitwise
    where the same steps run one after the other end."""
    code = """
        import threading, numpy as np, mgpu
        from mgpu import nn, parallel
        from mgpu.models import Residual
        devs = [mgpu.cpu(0), mgpu.cpu(1)]
        rng = np.random.default_rng(0)
        X = mgpu.array(rng.normal(size=(16, 1, 8, 8)).astype(np.float32))
        y = mgpu.array(rng.integers(0, 5, 16))
        XL = mgpu.array(rng.random((16, 1, 28, 28), dtype=np.float32))
        yL = mgpu.array(rng.integers(0, 10, 16))
        def model(seed):
            mgpu.random.seed(seed)
            net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                                Residual(3, 4, use_1x1conv=True, strides=2),
                                nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(4, 5))
            return nn.DataParallel(net, device_ids=devs)._fused_model().model
        def lenet():
            return [parallel.get_params(mgpu.lenet_params(scale=0.1, seed=0), d) for d in devs]
        def run(m, steps=12):
            for _ in range(steps):
                m.train_step(X, y, 0.05, momentum=0.9, weight_decay=1e-3)
        def run_lenet(ps, steps=12):
            for _ in range(steps):
                parallel.train_batch(XL, yL, ps, devs, 0.1)
        def state(m):
            out = []
            for d in range(len(devs)):
                out += [t.numpy() for t in m._model.params(d) + m._model.buffers(d)]
            return out
        shared = [model(1), model(2)]
        shared_lenet = lenet()
        threads = [threading.Thread(target=run, args=(m,)) for m in shared]
        threads.append(threading.Thread(target=run_lenet, args=(shared_lenet,)))
        [t.start() for t in threads]
        [t.join() for t in threads]
        alone = [model(1), model(2)]
        alone_lenet = lenet()
        for m in alone:
            run(m)
        run_lenet(alone_lenet)
        same = all(all(np.array_equal(a, b) for a, b in zip(state(s), state(a)))
                   for s, a in zip(shared, alone))
        same_lenet = all(np.array_equal(a.numpy(), b.numpy())
                         for a, b in zip(shared_lenet[1], alone_lenet[1]))
        print("SAME", same, same_lenet)
    """
    r = run_child(code, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "SAME True True" in r.stdout, r.stdout + r.stderr

# --- 8. atomic fused steps: a bad label changes nothing -----------------------------------------

NUM_GPUS = mgpu.num_gpus()
gpus2 = [pytest.mark.gpu, pytest.mark.skipif(
    NUM_GPUS < 2, reason="needs gpu(0), gpu(1): the emulated build (build/dev) has them")]
KINDS = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=gpus2)]


def _kind_devices(kind):
    return [mgpu.cpu(0), mgpu.cpu(1)] if kind == "cpu" else [mgpu.gpu(0), mgpu.gpu(1)]


def _labels(values, where, devices):
    """Labels the host can read (a NumPy array's copy) or labels written by a queued task on the
    first device (the step must then check them there, without waiting)."""
    values = np.asarray(values, dtype=np.int64)
    if where == "host":
        return mgpu.array(values)
    return mgpu.array(values, device=mgpu.cpu(1)).to(devices[0])


def _snapshot(tensors):
    return [t.numpy().copy() for t in tensors]


def _unchanged(tensors, before):
    return all(np.array_equal(t.numpy(), b, equal_nan=True) for t, b in zip(tensors, before))


def _expect_failed_step(call, where, match):
    """A bad step raises IndexError at once (host labels) or at the next wait (device labels),
    and its losses keep the error on every read."""
    if where == "host":
        with pytest.raises(IndexError, match=match):
            call()
        return
    losses = call()
    with pytest.raises(IndexError, match=match):
        mgpu.waitall()
    for loss in losses:
        for _ in range(2):
            with pytest.raises(IndexError, match=match):
                loss.numpy()


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("graphs", ["0", "1"])
def test_lenet_step_with_a_bad_label_leaves_every_replica_unchanged(kind, where, graphs,
                                                                     monkeypatch):
    if kind == "cpu" and graphs == "1":
        pytest.skip("CUDA graphs are a GPU path")
    monkeypatch.setenv("MGPU_CUDA_GRAPH", graphs)
    devs = _kind_devices(kind)
    rng = np.random.default_rng(3)
    X = mgpu.array(rng.random((8, 1, 28, 28), dtype=np.float32))
    good = rng.integers(0, 10, 8)
    reps = [parallel.get_params(mgpu.lenet_params(scale=0.1, seed=0), d) for d in devs]
    mgpu.train_batch(X, _labels(good, where, devs), reps, devs, 0.1)  # a step (graphs captured)
    mgpu.waitall()
    before = [_snapshot(r) for r in reps]
    bad = good.copy()
    bad[6] = 12
    _expect_failed_step(lambda: mgpu.train_batch(X, _labels(bad, where, devs), reps, devs, 0.1),
                        where, r"label 12 in row \d is out of range for 10 classes")
    for r, b in zip(reps, before):
        assert _unchanged(r, b), "a failed step changed the parameters"
    # The replicas go on as if the bad step had never been called.
    fresh = [[mgpu.array(a, device=d) for a in b] for b, d in zip(before, devs)]
    for ps in (reps, fresh):
        mgpu.train_batch(X, _labels(good, where, devs), ps, devs, 0.1)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(reps[1], fresh[1]))


def _bn_model(devs):
    from mgpu import nn
    from mgpu.models import Residual
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                        Residual(3, 4, use_1x1conv=True, strides=2),
                        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(4, 5))
    return nn.DataParallel(net, device_ids=devs)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
def test_model_step_with_a_bad_label_leaves_params_momentum_and_bn_unchanged(kind, where):
    devs = _kind_devices(kind)
    model = _bn_model(devs)
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = mgpu.nn.CrossEntropyLoss()
    rng = np.random.default_rng(5)
    X = mgpu.array(rng.normal(size=(8, 1, 6, 6)).astype(np.float32))
    good = rng.integers(0, 5, 8)
    for _ in range(2):  # momentum buffers exist from the first step on
        model.train_step(X, _labels(good, where, devs), loss, trainer)
    mgpu.waitall()
    fused = model._fused.model
    state = []
    for d in range(len(devs)):
        state += fused._model.params(d) + fused._model.buffers(d)
        state += [b for b in fused._model.momentum_buffers(d) if b is not None]
    state = [mgpu.Tensor(t) for t in state]
    assert len(state) > 2 * len(list(model.parameters())), "no momentum or BN state to check"
    before = _snapshot(state)
    bad = good.copy()
    bad[2] = -1
    _expect_failed_step(lambda: fused.train_step(X, _labels(bad, where, devs), 0.1, 0.9, 1e-3),
                        where, r"label -1 in row \d is out of range for 5 classes")
    assert _unchanged(state, before), "a failed step changed parameters, momentum or BN statistics"
    model.train_step(X, _labels(good, where, devs), loss, trainer)  # the model goes on
    mgpu.waitall()
    assert not _unchanged(state, before)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_first_momentum_step_on_device_labels_creates_no_buffers(kind):
    devs = _kind_devices(kind)
    model = _bn_model(devs)
    fused = model._fused_model().model
    params = [mgpu.Tensor(t) for t in fused._model.params(1)]
    before = _snapshot(params)
    X = mgpu.array(np.ones((4, 1, 6, 6), dtype=np.float32))
    with pytest.raises(IndexError, match="label 9 in row 3"):
        fused.train_step(X, _labels([0, 1, 2, 9], "device", devs), 0.1, momentum=0.9)
    assert fused.momentum_buffers(0) == [None] * len(params)
    assert _unchanged(params, before)
