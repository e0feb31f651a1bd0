"""Every environment variable mgpu reads, with its effect and default: ``mgpu info --env``.

``VARIABLES`` is the one list. The library's Python and C++ code read these names and no others
(a test scans the sources, so a variable read anywhere and missing here fails it); the notebooks
add the last group. Nothing here reads the environment: each variable is read where it acts, and
this module only describes them.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple


class Variable(NamedTuple):
    name: str
    group: str
    default: str
    effect: str


def _group(group: str, rows: List[Tuple[str, str, str]]) -> List[Variable]:
    return [Variable(name, group, default, effect) for name, default, effect in rows]


VARIABLES: Tuple[Variable, ...] = tuple(
    _group("data and CPU", [
        ("MGPU_DATA", "unset", "a folder with Fashion-MNIST's four IDX files, searched after an "
         "explicit data_dir and before ~/.mgpu/data and /usr/share/datasets/fashion-mnist"),
        ("MGPU_ISA", "auto", "the CPU kernel path: auto (the widest this CPU runs), avx2, "
         "avx512 or avx512_bf16 (AVX-512 with vdpbf16ps for the bf16 products; avx512 emulates "
         "them with float32 FMAs, the same bits); read at import"),
        ("MGPU_CONV_ALGO", "auto", "CPU convolutions: auto (by the shape alone: Winograd "
         "F(4x4,3x3) for 3x3 stride-1 layers with 16+ channels in and out and outputs of 6x6 or "
         "more, or whole 4x4 tiles with 512+ channels), tune (time once per shape, keep the "
         "faster), direct (bitwise reproducible across machines), im2col or winograd; in bf16, "
         "winograd takes Winograd F(2x2,3x3) with bfloat16 products for 3x3 stride-1 layers, "
         "the others the im2col products; read at each op call, and once as the fused step's "
         "model is built (Model.conv_algorithms shows it)"),
        ("MGPU_NUM_THREADS", "the CPUs this process may run on", "threads of the CPU thread "
         "pool (under mpirun, when unset: each rank gets its share of the machine's cores)"),
        ("MGPU_QUEUE_MAX_BYTES", "64 MiB (at most 1/8 of RAM)", "how many bytes of queued work "
         "the host may run ahead of a device before an op waits"),
        ("MGPU_TRACE", "unset", "PATH: record the whole program's timeline (mgpu.profile) and "
         "write it to PATH at exit"),
    ]) + _group("fused step", [
        ("MGPU_FUSE_LAYERS", "1", "0 keeps batch norm -> ReLU and batch norm -> add -> ReLU as "
         "separate layers (the same bits; read when a model is built; tests compare both)"),
        ("MGPU_CPU_SHARED_UPDATE", "1", "0: CPU devices reduce gradients in buckets and update "
         "every replica, as GPUs and MPI ranks do, instead of one shared update (the same bits; "
         "read at every step; tests compare both)"),
        ("MGPU_CUDA_GRAPH", "1", "0: GPU steps run kernel by kernel instead of replaying CUDA "
         "graphs"),
    ]) + _group("GPUs", [
        ("MGPU_GEMM", "cublas where built, else native", "GPU matrix products: cublas or native "
         "(mgpu's tiled kernel)"),
        ("MGPU_CONV", "native", "GPU convolutions: native (mgpu's kernels) or cudnn"),
        ("MGPU_ALLREDUCE", "nccl where built", "peer: all-reduce GPUs by mgpu's reduce-scatter + "
         "all-gather over peer copies instead of NCCL"),
        ("MGPU_NCCL_TIMEOUT_S", "300", "seconds an in-process NCCL collective may take before "
         "its communicators are aborted and a DeviceError is raised"),
    ]) + _group("several processes (MPI)", [
        ("MGPU_DIST_TIMEOUT", "60", "seconds a collective across processes may wait before it "
         "raises DeviceError naming the ranks it waits for"),
        ("MGPU_DIST_CHECK", "0", "1: ranks compare every collective (operation, size, dtype, "
         "root) first and all raise at once on a mismatch"),
        ("MGPU_DIST_ALGORITHM", "ordered", "ordered (rank-ordered sums: bitwise the in-process "
         "result) or mpi (Open MPI's MPI_Iallreduce and its summation order)"),
        ("MGPU_DIST_GPU", "nccl where built", "host: GPU tensors cross processes through host "
         "memory over MPI even where NCCL is built"),
    ]) + _group("emulated GPUs (the emulated build only)", [
        ("MGPU_EMULATED_GPUS", "2", "how many emulated GPUs gpu(0..k-1) there are (0 for none)"),
        ("MGPU_EMU_STRICT", "0", "1: streams run behind the host in a seeded random order, "
         "blocks in random order, freed memory poisoned, CUDA's graph-capture and peer-access "
         "rules enforced"),
        ("MGPU_EMU_SEED", "1", "the seed of the emulator's fiber and stream orders"),
        ("MGPU_EMU_PEER_ACCESS", "1", "0 emulates GPUs without peer access"),
        ("MGPU_EMU_STACK_KIB", "64 (256 under ASan)", "each emulated CUDA thread's stack, KiB"),
        ("MGPU_EMU_NCCL_FAIL", "unset", "fault injection: CALL[:RANK],... makes those emulated "
         "NCCL calls fail; async makes a collective fail asynchronously"),
        ("MGPU_EMU_NCCL_STALL", "unset", "fault injection: RANK never joins an emulated NCCL "
         "collective (the timeout's test)"),
        ("MGPU_EMU_FAIL_CAPTURED_KERNEL", "unset", "fault injection: NAME refuses launches of "
         "kernels whose name contains NAME into a capturing stream"),
    ]) + _group("tests and benchmarks", [
        ("MGPU_TEST_CHECKPOINT_FAULT", "unset", "fault injection: POINT@N[,...] kills the "
         "process (SIGKILL) the N-th time checkpointing reaches POINT (write, rename, dirsync, "
         "prune, step)"),
        ("MGPU_TEST_CHECKPOINT_FAULT_RANK", "unset", "limits MGPU_TEST_CHECKPOINT_FAULT to "
         "this MPI rank"),
        ("MGPU_TEST_STEP_DELAY_S", "unset", "test pacing: a checkpointed loop sleeps this many "
         "seconds after every step, so a test's signal lands inside the loop on a fast machine"),
        ("MGPU_TORCH_PYTHON", "build/peers/torch/bin/python", "the interpreter with PyTorch "
         "that bench --compare torch and the peer tests use (bash .ci/peers.sh torch makes the "
         "default)"),
        ("MGPU_JAX_PYTHON", "build/peers/jax/bin/python", "the interpreter with JAX, Flax and "
         "Optax that bench --compare jax and the peer tests use (bash .ci/peers.sh jax)"),
    ]) + _group("notebooks", [
        ("MGPU_NB_EPOCHS", "the book's (10)", "epochs of every training run in the notebooks "
         "(quick runs)"),
        ("MGPU_NB_LIMIT_BATCHES", "whole epochs", "batches per epoch and per evaluation in the "
         "notebooks (quick runs)"),
        ("MGPU_NB_BENCH", "notebooks/bench", "the folder of JSON results (mgpu bench --json, "
         "mgpu advise --json) that notebooks/benchmarks.ipynb draws"),
        ("MGPU_NOTEBOOK_RUNS", "~/.mgpu/runs/concise", "where the concise notebook's two runs "
         "keep their checkpoints (DIR/d1/ckpt, DIR/d2/ckpt); a finished run resumes at its end "
         "and shows its results"),
    ]))


def names() -> List[str]:
    """The variables' names, in the table's order."""
    return [v.name for v in VARIABLES]


def format_table(width: int = 100) -> str:
    """The table as plain text: one block per group, each variable with its default and
    effect (what ``mgpu info --env`` prints)."""
    import textwrap
    out = []
    for group in dict.fromkeys(v.group for v in VARIABLES):
        out.append(f"{group}:")
        for v in VARIABLES:
            if v.group != group:
                continue
            out.append(f"  {v.name}  (default: {v.default})")
            out += textwrap.wrap(v.effect, width, initial_indent="      ",
                                 subsequent_indent="      ")
    return "\n".join(out)


__all__ = ["Variable", "VARIABLES", "names", "format_table"]
