"""``bench train --compare jax``: the bench's handling of the JAX rival (its JSON, a broken
interpreter; its absence is in test_bench.py with PyTorch's), run against a fake interpreter that
prints a JSON result with known times; the shared rival module; and, when a JAX Python is found
($MGPU_JAX_PYTHON or build/peers/jax/bin/python), the rival's own code: the chapter's LeNet loss
and one SGD step on 1 and 2 host devices against the NumPy float64 reference, and the Flax
ResNet-18's parameter count against mgpu's resnet18(10, 1) (a mismatch means the two sides do not
do the same work).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reference as R
from mgpu import bench, cli
from mgpu.bench import rival_common, rivals
from mgpu.models import lenet_params, resnet18
from test_bench import _run

FAKE_STEPS = 2  # --limit-batches of the runs against the fake interpreter
FAKE_EPOCH_TIMES = [0.30, 0.10, 0.20]  # so the fake's median sec/step is 0.20 / FAKE_STEPS


def _fake_python(tmp_path, mode="ok"):
    """An executable standing in for the JAX venv's python: the import probe prints a version;
    the rival's launch logs its command line and prints one JSON result per --devices entry with
    FAKE_EPOCH_TIMES (mode 'fail': exits 1 with a message; 'garbage': prints no JSON)."""
    log = tmp_path / "fake_calls.jsonl"
    script = tmp_path / "fake_python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        argv = sys.argv[1:]
        if "import jax" in argv[1]:
            print("0.0-fake")
            sys.exit(0)
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps(argv[2:]) + "\\n")
        if {mode!r} == "fail":
            sys.exit("Boom: XLA is not here")
        if {mode!r} == "garbage":
            print("hello")
            sys.exit(0)
        args = dict(zip(argv[3::2], argv[4::2]))
        results = []
        for k in map(int, args["--devices"].split(",")):
            variant = args.get("--variants", "chapter")
            name = (f"jax chapter pmap_step, {{k}} dev" if variant == "chapter"
                    else f"jax Flax ResNet-18, {{k}} dev")
            results.append({{"name": name, "variant": variant, "num_devices": k,
                            "global_batch": int(args["--batch-size"]),
                            "epoch_times": {FAKE_EPOCH_TIMES!r},
                            "epoch_cpu_times": {FAKE_EPOCH_TIMES!r},
                            "steps_per_epoch": int(args["--limit-batches"]),
                            "full_batches": 10, "extrapolated": True,
                            "train_loss": [2.3, 2.2, 2.1], "peak_rss_bytes": 200 << 20,
                            "threads": 2, "host_devices": k}})
        print(json.dumps({{"jax_version": "0.0-fake", "flax_version": "f", "optax_version": "o",
                          "threads": 2, "xla_flags": "--fake", "python": sys.executable,
                          "results": results}}))
        """))
    script.chmod(0o755)
    return str(script), log


def _calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_compare_takes_torch_jax_or_both(capsys):
    parse = rivals.parse_compare
    assert parse(None) == [] and parse("jax") == ["jax"] and parse("torch") == ["torch"]
    assert parse("torch,jax") == ["torch", "jax"] and parse("jax, torch") == ["jax", "torch"]
    for bad in ("tf", "jax,jax", "", ",", "torch,tf"):
        with pytest.raises(ValueError, match="--compare takes 'torch', 'jax' or 'torch,jax'"):
            parse(bad)
    assert cli.main(["bench", "train", "--synthetic", "100", "--parts", "fused", "--compare",
                     "tensorflow"]) == 2
    assert "--compare takes 'torch', 'jax' or 'torch,jax', got 'tensorflow'" in \
        capsys.readouterr().err
    assert cli.main(["bench", "train", "--synthetic", "100", "--parts", "fused", "--compare",
                     "jax", "--jax-python", "/nonexistent/python"]) == 2
    err = capsys.readouterr().err
    assert "--jax-python /nonexistent/python cannot import jax, flax, optax" in err
    assert "/nonexistent/python (missing)" in err


def test_jax_python_defaults_to_the_environment_then_the_peers_venv(monkeypatch, tmp_path):
    monkeypatch.setenv("MGPU_JAX_PYTHON", "/somewhere/python")
    assert rivals.jax_python_candidates() == ["/somewhere/python"]
    monkeypatch.delenv("MGPU_JAX_PYTHON")
    venv = tmp_path / "build" / "peers" / "jax" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    monkeypatch.chdir(tmp_path)
    assert rivals.jax_python_candidates()[0] == str(venv / "python")
    fake, _ = _fake_python(tmp_path)
    monkeypatch.setenv("MGPU_JAX_PYTHON", fake)
    assert bench.find_jax_python() == (fake, "0.0-fake")


def test_torch_python_prefers_the_peers_venv_to_this_interpreter(monkeypatch, tmp_path):
    # The rival is PyTorch 2.15 from the peers' venv, not whatever torch this Python or
    # Debian's /usr/bin/python3 has: $MGPU_TORCH_PYTHON (or build/peers/torch) comes first.
    fake = tmp_path / "torch_python"
    fake.write_text(f"#!{sys.executable}\nimport sys\n"
                    "sys.exit(0 if print('9.9-fake') is None and 'import torch' in sys.argv[2] "
                    "else 1)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MGPU_TORCH_PYTHON", str(fake))
    assert bench.find_torch_python() == (str(fake), "9.9-fake")
    monkeypatch.setenv("MGPU_TORCH_PYTHON", "/nonexistent/python")
    tried = []
    monkeypatch.setattr(rivals, "probe_python",
                        lambda candidates, code: tried.append(candidates) or (None, ["none"]))
    assert bench.find_torch_python()[0] is None
    last = shutil.which("python3") or "/usr/bin/python3"  # python3 on PATH, the last resort
    assert tried == [tuple(dict.fromkeys(("/nonexistent/python", sys.executable, last)))]


def test_lenet_rows_come_from_the_jax_rivals_json(tmp_path):
    fake, log = _fake_python(tmp_path)
    code, text, r = _run(["bench", "train", "--synthetic", "300", "--batch-size", "64",
                          "--limit-batches", str(FAKE_STEPS), "--epochs", "3", "--warmup", "1",
                          "--parts", "fused", "--devices", "1,2", "--compare", "jax",
                          "--jax-python", fake, "--jax-threads", "3"], tmp_path, "fake")
    assert code == 0
    # One process per device count, each given the bench's settings.
    calls = _calls(log)
    assert len(calls) == 2
    for k, argv in zip((1, 2), calls):
        assert argv[0].endswith("/jax_rival.py")
        args = dict(zip(argv[1::2], argv[2::2]))
        assert args["--devices"] == str(k) and args["--threads"] == "3"
        assert args["--synthetic"] == "300" and args["--batch-size"] == "64"
        assert args["--limit-batches"] == str(FAKE_STEPS) and args["--epochs"] == "3"
    assert r["jax"]["python"] == fake and r["jax"]["jax_version"] == "0.0-fake"
    assert r["settings"]["jax_threads"] == 3
    theirs = {x["num_devices"]: x for x in r["results"] if x["impl"] == "jax chapter"}
    mine = {x["num_devices"]: x for x in r["results"] if x["impl"] == "mgpu fused"}
    assert sorted(theirs) == sorted(mine) == [1, 2]
    step = 0.20 / FAKE_STEPS
    for k in (1, 2):
        x = theirs[k]
        assert x["sec_per_step"]["median"] == step
        assert x["sec_per_epoch"] == step * 10 and x["images_per_sec"] == 64 / step
    assert len(r["comparisons"]) == 2
    for c in r["comparisons"]:
        k = c["num_devices"]
        assert c["rival"] == "jax" and c["jax"] == theirs[k]["name"]
        assert c["mgpu"] == mine[k]["name"]
        assert c["jax_sec_per_step"] == step
        assert c["mgpu_sec_per_step"] == mine[k]["sec_per_step"]["median"]
        assert c["ratio"] == step / mine[k]["sec_per_step"]["median"]
        assert f"{c['ratio']:.2f}" in text
    assert "ratio = rival ms/step / mgpu ms/step" in text
    assert "jax chapter pmap_step, 2 dev" in text


def test_a_broken_jax_python_fails_with_its_message(tmp_path):
    for mode, message in (("fail", "the JAX run .* failed:\nBoom: XLA is not here"),
                          ("garbage", "the JAX run .* printed no JSON result:\nhello")):
        (tmp_path / mode).mkdir()
        fake, _ = _fake_python(tmp_path / mode, mode)
        with pytest.raises(RuntimeError, match=message):
            bench.bench_train(devices=[1], batch_size=32, epochs=1, limit_batches=1, warmup=0,
                              synthetic=64, parts=["fused"], compare="jax", jax_python=fake)


def test_resnet18_pairs_a_jax_run_on_k_devices_with_mgpu_on_k(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EMULATED_GPUS", "0")
    fake, log = _fake_python(tmp_path)
    r = bench.bench_train_resnet18(devices=[1, 2], batch_size=2, epochs=1,
                                   limit_batches=FAKE_STEPS, warmup=1, synthetic=8,
                                   compare="jax", parts=["fused"], jax_python=fake,
                                   weak_scaling=True)
    calls = _calls(log)
    assert [dict(zip(a[1::2], a[2::2]))["--devices"] for a in calls] == ["1", "2"]
    assert [dict(zip(a[1::2], a[2::2]))["--batch-size"] for a in calls] == ["2", "4"]
    assert all(dict(zip(a[1::2], a[2::2]))["--variants"] == "resnet18" for a in calls)
    mine = {x["num_devices"]: x for x in r["results"] if x["impl"] == "mgpu fused"}
    theirs = {x["num_devices"]: x for x in r["results"] if x["impl"] == "jax flax"}
    assert sorted(mine) == sorted(theirs) == [1, 2]
    flops = bench.resnet18_step_flops(2)
    for k, x in theirs.items():
        assert x["global_batch"] == 2 * k
        assert x["sec_per_step"]["median"] == 0.20 / FAKE_STEPS
        assert x["gflops"] == pytest.approx(flops * k / (0.20 / FAKE_STEPS) / 1e9)
    # jax on 1 device against both mgpu runs, jax on 2 devices against mgpu on 2 only.
    pairs = sorted((c["jax"], c["mgpu"]) for c in r["comparisons"])
    assert pairs == sorted([(theirs[1]["name"], mine[1]["name"]),
                            (theirs[1]["name"], mine[2]["name"]),
                            (theirs[2]["name"], mine[2]["name"])])
    for c in r["comparisons"]:
        a = next(x for x in r["results"] if x["name"] == c["mgpu"])
        b = next(x for x in r["results"] if x["name"] == c["jax"])
        assert c["rival"] == "jax"
        assert c["time_ratio"] == pytest.approx(b["sec_per_image"] / a["sec_per_image"])
        assert c["memory_ratio"] == a["peak_rss_bytes"] / (200 << 20)
    text = bench.format_result(r)
    assert "jax Flax ResNet-18, 2 dev" in text and "time = rival ms/image" in text


def test_the_shared_batches_and_timing_loop():
    """Every side draws the same shuffles; run_config waits with ``finish`` once per epoch and
    sums the steps' losses (floats or lazy values) after the timing."""
    images, labels = rival_common.synthetic_split(10, 3)
    a = rival_common.Batches(images, labels, 4, 0, 7)
    b = rival_common.Batches(images, labels, 4, 0, 7, make=lambda X, y: (X * 2, y + 1))
    assert (a.full_batches, a.num_batches) == (3, 3)
    got_a, got_b = list(a.epoch()), list(b.epoch())
    order = np.random.default_rng(7).permutation(10)
    for i, ((Xa, ya), (Xb, yb)) in enumerate(zip(got_a, got_b)):
        idx = order[4 * i:4 * i + 4]
        np.testing.assert_array_equal(Xa, images[idx].reshape(-1, 1, 28, 28) / np.float32(255))
        assert Xa.dtype == np.float32 and ya.dtype == np.int64
        np.testing.assert_array_equal(ya, labels[idx])
        np.testing.assert_array_equal(Xb, 2 * Xa)
        np.testing.assert_array_equal(yb, ya + 1)

    class Lazy:
        def __init__(self, v):
            self.v = v

        def __float__(self):
            return self.v

    waits = []
    r = rival_common.run_config("x", lambda X, y: Lazy(float(y.sum())), a, 2, 1,
                                 finish=lambda outs: waits.append(len(outs)))
    assert waits == [1, 3, 3]  # the warm-up's one batch, then each timed epoch's three
    assert r["steps_per_epoch"] == 3 and len(r["epoch_times"]) == 2
    assert r["train_loss"] == [float(labels.sum()) / 10] * 2


# --- the rival's own code, in a JAX interpreter --------------------------------------------------

def _jax_python():
    py, info = bench.find_jax_python()
    if py is None:
        pytest.skip(info)
    return py


_DRIVER = """
import importlib.util, os, sys
import numpy as np
here = sys.argv[1]
def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(here, name + ".py"))
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
load("rival_common")
rival = load("jax_rival")
rival.configure_xla(2, 2)
import jax, optax
from jax import numpy as jnp
from flax import linen as nn
data = np.load(sys.argv[2])
params = [jnp.asarray(data[f"p{i}"]) for i in range(8)]
X, y, lr = jnp.asarray(data["X"]), jnp.asarray(data["y"]), float(data["lr"])
ch = rival.make_chapter(jax, jnp, optax)
out = {"logits": np.asarray(ch.lenet(params, X))}
for k in (1, 2):
    new, loss = ch.train_batch(ch.get_params(params, k), X, y, k, lr)
    out[f"loss{k}"] = np.asarray(loss)
    for i, p in enumerate(new):
        out[f"k{k}_p{i}"] = np.asarray(p)
model = rival.make_resnet18(nn)
variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1), jnp.float32))
out["resnet_params"] = rival.param_count(jax, variables["params"])
out["resnet_batch_stats"] = rival.param_count(jax, variables["batch_stats"])
logits = model.apply(variables, jnp.zeros((2, 28, 28, 1), jnp.float32), mutable=["batch_stats"])[0]
out["resnet_logits_shape"] = np.array(logits.shape)
np.savez(sys.argv[3], **out)
"""


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory):
    """The rival's chapter code and Flax ResNet-18, run once in the JAX interpreter."""
    py = _jax_python()
    tmp = tmp_path_factory.mktemp("jax")
    rng = np.random.default_rng(5)
    params = [p.numpy() for p in lenet_params(seed=5)]
    params = [p + (rng.standard_normal(p.shape).astype(np.float32) * 0.01 if p.ndim == 1 else 0)
              for p in params]  # non-zero biases, so their gradients' use is checked too
    X = rng.random((8, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, size=8).astype(np.int32)
    np.savez(tmp / "in.npz", X=X, y=y, lr=0.2, **{f"p{i}": p for i, p in enumerate(params)})
    here = os.path.dirname(os.path.abspath(rival_common.__file__))
    (tmp / "driver.py").write_text(_DRIVER)
    r = subprocess.run([py, str(tmp / "driver.py"), here, str(tmp / "in.npz"),
                        str(tmp / "out.npz")], capture_output=True, text=True, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    return params, X, y, dict(np.load(tmp / "out.npz"))


def test_jax_chapter_lenet_matches_the_float64_reference(jax_run):
    params, X, y, out = jax_run
    np.testing.assert_allclose(out["logits"], R.lenet_forward(X, params), rtol=1e-5, atol=1e-6)
    loss_sum, _ = R.lenet_loss_and_grads(X, y, params)
    expected = R.train_step_reference(X, y, params, lr=0.2)
    for k in (1, 2):
        # pmean of the shards' mean losses = the batch's mean loss (equal shards)
        loss = out[f"loss{k}"]
        assert loss.shape == (k,)
        np.testing.assert_allclose(loss, loss_sum / len(y), rtol=1e-5)
        for i, p in enumerate(expected):
            got = out[f"k{k}_p{i}"]
            assert got.shape == (k,) + p.shape
            for replica in got:  # every device holds the same updated parameters
                np.testing.assert_allclose(replica, p, rtol=1e-5, atol=1e-7,
                                           err_msg=f"param {i} on {k} devices")


def test_jax_resnet18_is_mgpus_resnet18(jax_run):
    """The same architecture as mgpu.models.resnet18(10, 1): the same number of trainable
    parameters (convolutions with bias, BatchNorm's scale and shift, the Dense layer), running
    statistics for every BatchNorm channel, 10 logits."""
    out = jax_run[3]
    net = resnet18(10, 1)
    count = sum(int(np.prod(p.shape)) for p in net.parameters())
    assert int(out["resnet_params"]) == count == 11_175_818
    bn_channels = 64 + 2 * (2 * 64 + 2 * 128 + 2 * 256 + 2 * 512)  # stem, 2 per Residual
    assert int(out["resnet_batch_stats"]) == 2 * bn_channels  # mean and var per channel
    assert out["resnet_logits_shape"].tolist() == [2, 10]


def test_bench_runs_the_real_jax_rival():
    """The launcher runs jax_rival.py by path in the JAX interpreter, one process per device
    count with exactly that many host devices, on the bench's batches."""
    py = _jax_python()
    r = bench.bench_train(devices=[1, 2], batch_size=32, epochs=1, limit_batches=2, warmup=1,
                          synthetic=200, parts=["fused"], compare="jax", jax_python=py)
    assert r["jax"]["python"] == py and r["jax"]["flax_version"] and r["jax"]["optax_version"]
    theirs = {x["num_devices"]: x for x in r["results"] if x["impl"] == "jax chapter"}
    assert sorted(theirs) == [1, 2]
    for k, x in theirs.items():
        assert x["host_devices"] == k and f"device_count={k}" in x["xla_flags"]
        assert x["threads"] == min(2, len(os.sched_getaffinity(0)))
        assert x["warmup_batches"] == 2 and x["steps_per_epoch"] == 2
        assert abs(x["train_loss"][0] - np.log(10)) < 0.05  # N(0, 0.01^2) init: near ln 10
    assert [c["rival"] for c in r["comparisons"]] == ["jax", "jax"]
