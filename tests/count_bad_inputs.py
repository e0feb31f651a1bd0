"""Counts the bad inputs the suites try in one run, reproducibly: the collected pytest cases of
the bad-input tests (every parametrized case counts once), the Hypothesis examples of the
bad-argument, IDX-fuzz and checkpoint-fuzz groups (each fuzz example is one mutated file), and the
fixed corrupt-file cases of the IDX tests. Run from tests/ with the package on PYTHONPATH:

    python count_bad_inputs.py [--run]

Without --run it counts what one run tries (collection only, the configured example counts);
with --run it also runs them (pytest, then each Hypothesis group in a child process as
ops/test_properties.py does) and reports crashes, hangs and failures (a refused call that changed
state fails its test: test_robust's atomic-step tests and property_suite's bad_args check it).
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Tests that feed bad inputs: whole files, and in other files tests whose names say so.
BAD_FILES = ["robust/test_errors.py", "robust/test_robust.py"]
OTHER_FILES = ["tensor/test_tensor.py", "ops/test_ops.py", "ops/test_batch_norm.py",
               "nn/test_nn.py", "step/test_fused_step.py", "nn/test_data_parallel.py",
               "step/test_train.py", "data/test_data.py", "tools/test_bench.py", "gpu/test_gpu.py",
               "step/test_chapter.py"]
BAD_NAMES = "bad or reject or refuse or invalid or raise or error or wrong or out_of_range"
BAD_GROUPS = ("bad_args", "idx_fuzz", "ckpt_fuzz")


def pytest_ids(args):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                        "-p", "no:cacheprovider", *args], capture_output=True, text=True, cwd=HERE)
    return [line for line in r.stdout.splitlines() if "::" in line]


def main():
    run = "--run" in sys.argv
    ids = pytest_ids(BAD_FILES) + pytest_ids(OTHER_FILES + ["-k", BAD_NAMES])
    ids = sorted(set(ids))
    sys.path.insert(0, os.path.join(HERE, "ops"))
    from test_properties import GROUPS  # the configured example counts
    examples = {g: GROUPS[g] for g in BAD_GROUPS}
    print(f"pytest cases with bad inputs: {len(ids)}")
    for g, n in examples.items():
        print(f"Hypothesis examples, group {g}: {n}")
    print(f"total bad inputs per run: {len(ids) + sum(examples.values())}")
    if not run:
        return 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
                       capture_output=True, text=True, cwd=HERE)
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]
    print(f"pytest: {tail}")
    ok = r.returncode == 0
    for g, n in examples.items():
        try:
            p = subprocess.run([sys.executable, os.path.join(HERE, "property_suite.py"), g, str(n)],
                               capture_output=True, text=True, timeout=900, cwd=HERE,
                               env=dict(os.environ, MGPU_EMULATED_GPUS="0"))
        except subprocess.TimeoutExpired:
            print(f"group {g}: HUNG")
            ok = False
            continue
        tried = re.search(r"TRIED (\d+)", p.stdout)
        status = "ok" if p.returncode == 0 else (f"died of signal {-p.returncode}"
                                                 if p.returncode < 0 else "FAILED")
        print(f"group {g}: {tried.group(1) if tried else '?'} examples run, {status}")
        ok = ok and p.returncode == 0
    print("none crashed, hung or changed state" if ok else "SOME FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
