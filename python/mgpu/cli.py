"""The ``mgpu`` command (also ``python -m mgpu``): train the chapters' LeNet or ResNet-18 from a
shell, show what this build contains (``mgpu info``, ``mgpu info --env``), benchmark, and predict
scaling. ``main(argv)`` returns the exit status: 0, 2 for a user error (one line on stderr, no
traceback), 130 after Ctrl-C, and 128 + the signal after SIGTERM or SIGUSR1 stopped ``train``
(143, 138: the run's line says where its checkpoint is; see ``mgpu.loop``)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _train(args) -> int:
    if args.trace:
        from .trace import profile
        with profile(args.trace) as p:
            code = _train_run(args)
        print(f"timeline written to {', '.join(p.written)}", file=sys.stderr)
        return code
    return _train_run(args)


def _train_run(args) -> int:
    from .chapter import train_op_by_op
    from .train import train
    kw = dict(data_dir=args.data_dir, limit_batches=args.limit_batches, seed=args.seed,
              checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
              resume=args.resume, log=args.log, tensorboard=args.tensorboard)
    if args.model == "resnet18":
        # Sec. 12.6: modules, nn.DataParallel and the book's loop through autograd.
        from . import chapter, models, nn
        if args.op_by_op:
            raise ValueError("--op-by-op is for LeNet's chapter step; ResNet-18 always trains "
                             "through nn.DataParallel and autograd")
        if not args.check_finite:
            raise ValueError("--no-check-finite is for LeNet's train; ResNet-18's loop (the "
                             "book's, through autograd) does not check its losses")
        # Seeded first: the default init of the biases draws from mgpu.random too, so --seed
        # fixes the whole initial network (train_concise re-draws only the weights).
        from . import random
        random.seed(args.seed)
        net = models.resnet18(10, 1)
        if args.sync_bn:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        chapter.train_concise(net, args.num_gpus, args.batch_size, args.lr, args.epochs,
                              fused=args.fused, deterministic=args.deterministic,
                              optimizer=args.optimizer, weight_decay=args.weight_decay,
                              schedule=args.schedule, warmup_epochs=args.warmup_epochs,
                              clip_grad_norm=args.clip_grad_norm, precision=args.precision,
                              accumulate=args.accumulate, comm_dtype=args.comm_dtype, **kw)
        return 0
    if args.comm_dtype != "float32":
        raise ValueError("--comm-dtype bf16 needs --model resnet18 --fused for now (LeNet's "
                         "fused step all-reduces float32)")
    if args.sync_bn or args.fused:
        raise ValueError("--sync-bn and --fused need --model resnet18 (LeNet's step is fused "
                         "already and has no batch norm)")
    if (args.optimizer, args.weight_decay, args.clip_grad_norm) != ("sgd", None, None):
        raise ValueError("--optimizer, --weight-decay and --clip-grad-norm need --model "
                         "resnet18 (LeNet's step is the chapter's plain SGD, p -= lr / batch * g; "
                         "--schedule and --warmup-epochs work with it)")
    kw.update(check_finite=args.check_finite, schedule=args.schedule,
              warmup_epochs=args.warmup_epochs)
    if args.accumulate != 1:
        kw["accumulate"] = args.accumulate
    if args.deterministic:
        kw["deterministic"] = True
    if args.precision != "float32":
        kw["precision"] = args.precision
    if args.op_by_op:
        train_op_by_op(args.num_gpus, args.batch_size, args.lr, args.epochs, **kw)
    else:
        train(args.num_gpus, args.batch_size, args.lr, args.epochs, **kw)
    return 0


def _trace_merge(args) -> int:
    from .trace import merge
    print(f"merged {len(args.inputs)} traces into {merge(args.inputs, args.out)}")
    return 0


def _advise(args) -> int:
    from . import advisor
    return advisor.main(args)


def _advise_parser(sub) -> None:
    a = sub.add_parser("advise", help="measure this machine's step parts and predict the speed-up "
                                      "of more devices, other batch sizes or another machine")
    a.add_argument("--model", choices=["lenet", "resnet18"], default="lenet")
    a.add_argument("--batch-size", type=_ints, default=[256],
                   help="global batch size(s) to predict for, e.g. 64,256,1024")
    a.add_argument("--devices", type=int, default=None,
                   help="predict for 1..N devices (default: 8 for a described machine, else 2)")
    a.add_argument("--machine", metavar="FILE.json", default=None,
                   help="predict for a described machine (not measured): device FLOP/s, memory "
                        "and link bandwidth, link latency; see mgpu.advisor.EXAMPLE_MACHINES")
    a.add_argument("--epoch-examples", type=int, default=60000,
                   help="examples per epoch for the epoch-time column")
    a.add_argument("--plot", metavar="PATH.png", default=None, help="draw speed-up vs batch size")
    a.add_argument("--json", metavar="PATH", default=None,
                   help="write measurements and predictions")
    a.add_argument("--quick", action="store_true",
                   help="fewer, shorter measurements: 2 small batches and the shards asked for, "
                        "2 traced steps above them")
    a.add_argument("--validate", action="store_true",
                   help="also time real runs (1..N devices, each batch size; with --ranks, MPI "
                        "runs through mpirun) and report the prediction error")
    a.add_argument("--ranks", type=_ints, default=None,
                   help="with --validate: also predict and time these MPI process counts (one "
                        "device each), e.g. 2,3; needs mpirun")
    a.add_argument("--rounds", type=int, default=3,
                   help="with --validate: rounds of (measure the model's inputs, time the real "
                        "runs), interleaved so both see the same load; medians are reported")
    a.add_argument("--limit-batches", type=int, default=None,
                   help="with --validate: steps per timed run (default 8, 3 with --quick)")
    a.add_argument("--from-json", metavar="PATH", default=None,
                   help="reuse the measurements of an earlier --json instead of measuring")
    a.set_defaults(run=_advise)


def info_lines() -> List[str]:
    """The lines of ``python -m mgpu info``: version, CPU and kernel path, BLAS, the optional
    parts, devices, the data set. Each part that is missing says so in its line."""
    import os
    import platform

    from . import _startup
    from .engine import core as _core
    b = dict(_core.build_info())
    _, model = _startup.cpu_flags_and_model()
    np_version = "?"
    try:
        import numpy
        np_version = numpy.__version__
    except ImportError:
        pass
    lines = [f"mgpu {b['version']} (Python {platform.python_version()}, NumPy {np_version}, "
             f"{platform.system()} {platform.machine()})",
             f"CPU: {model or b['cpu_model'] or 'unknown'}; {os.cpu_count()} logical cores, mgpu "
             f"uses {b['cpu_threads']} threads",
             f"CPU kernels: {b['cpu_isa']}, {b['cpu_isa_reason']}; compiled for "
             f"{', '.join(b['cpu_isas_built'])}; set MGPU_ISA=auto|avx2|avx512|avx512_bf16 to "
             f"choose; bf16 products: {b['cpu_bf16']}",
             f"engine compiled for: {b['cpu_baseline']}",
             f"BLAS: {b['blas']}",
             f"CUDA: {b['cuda']}",
             f"cuDNN: {b['cudnn']}",
             f"NCCL: {b['nccl']}",
             f"MPI: {b['mpi']}",
             f"GPU tensors across processes: {b['dist_gpu_transport']}"]
    gpus = _core.num_gpus()
    devices = ["cpu(0), cpu(1), ... (virtual CPU devices)"] + [f"gpu({i})" for i in range(gpus)]
    lines.append(f"devices: {', '.join(devices)}" + _no_gpu_why(b, gpus))
    try:
        lines.append(f"data: Fashion-MNIST found in {_core.find_fashion_mnist('')}")
    except Exception as e:  # FileNotFoundError names every place searched and how to get it
        lines.append("data: " + str(e).replace("\n", "\n  "))
    return lines


def _no_gpu_why(b: dict, gpus: int) -> str:
    """The end of the devices line: what the GPUs are, or why there are none."""
    emulated = bool(b.get("cuda_emulation"))
    if gpus:
        return " (emulated on the CPU: MGPU_EMULATED_GPUS sets how many)" if emulated else ""
    if not emulated and not b["cuda"].startswith("built"):
        return "; no GPU: the CUDA backend is not built (see the CUDA line)"
    why = b.get("gpu_query_error") or "the CUDA runtime reports 0 devices"
    hint = ("set MGPU_EMULATED_GPUS=2 for two emulated GPUs" if emulated
            else "is the NVIDIA driver installed and a GPU visible (nvidia-smi, "
                 "CUDA_VISIBLE_DEVICES)?")
    return f"; no GPU visible: {why} ({hint})"


def _info(args) -> int:
    if args.env:
        from .environment import format_table
        print("Environment variables mgpu reads (each where it acts; unset means the default):")
        print(format_table())
        return 0
    if args.json:
        from .engine import core as _core
        info = dict(_core.build_info())
        info["num_gpus"] = _core.num_gpus()
        print(json.dumps(info, indent=2))
        return 0
    print("\n".join(info_lines()))
    return 0


def _ints(text: str) -> List[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _sizes(text: str) -> List[int]:
    from .bench import parse_size
    try:
        return [parse_size(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bench(args) -> int:
    from . import bench
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.bench == "train":
        # ResNet-18 steps take seconds: shorter defaults than LeNet's (see --help).
        resnet = args.model == "resnet18"
        pick = lambda given, lenet, resnet18: (given if given is not None  # noqa: E731
                                               else resnet18 if resnet else lenet)
        parts = args.parts.split(",") if args.parts else (
            list(bench.RESNET_PARTS) if resnet else list(bench.TRAIN_PARTS))
        result = bench.bench_train(
            devices=args.devices, batch_size=args.batch_size,
            lr=pick(args.lr, 0.2, 0.1), epochs=pick(args.epochs, 3, 1),
            limit_batches=pick(args.limit_batches, 20, 5), warmup=pick(args.warmup, 3, 2),
            repeat=args.repeat, data_dir=args.data_dir, synthetic=args.synthetic,
            seed=args.seed, compare=args.compare, torch_python=args.torch_python,
            torch_threads=args.torch_threads, parts=parts, gemm_size=args.gemm_size, log=log,
            model=args.model, weak_scaling=args.weak_scaling, jax_python=args.jax_python,
            jax_threads=args.jax_threads, optimizer=args.optimizer,
            weight_decay=args.weight_decay, clip_grad_norm=args.clip_grad_norm,
            precisions=args.precision.split(","))
    elif args.bench == "ops":
        result = bench.bench_ops(batch_sizes=args.batch_sizes, warmup=args.warmup,
                                 repeat=args.repeat, log=log, device=args.device)
    elif args.bench == "checkpoint":
        result = bench.bench_checkpoint(models=args.models.split(","), momentum=args.momentum,
                                        warmup=args.warmup, repeat=args.repeat,
                                        directory=args.dir, log=log)
    elif args.bench == "conv":
        result = bench.bench_conv(batch=args.batch, algos=args.algos.split(","),
                                  rounds=args.rounds, repeat=args.repeat, warmup=args.warmup,
                                  log=log, device=args.device, onednn=args.onednn,
                                  layers=args.layers)
    elif args.bench == "isa":
        result = bench.bench_isa(rounds=args.rounds, ops_batch=args.ops_batch,
                                 batch_size=args.batch_size, limit_batches=args.limit_batches,
                                 warmup=args.warmup, repeat=args.repeat,
                                 isas=args.isas.split(",") if args.isas else None,
                                 data_dir=args.data_dir, synthetic=args.synthetic,
                                 compare=args.compare, torch_python=args.torch_python,
                                 torch_threads=args.torch_threads,
                                 builds=args.builds.split(",") if args.builds else (), log=log)
    elif args.bench == "accuracy":
        result = bench.bench_accuracy(
            model=args.model, precisions=args.precision.split(","), seeds=args.seeds,
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, num_gpus=args.num_gpus,
            limit_batches=args.limit_batches, recompute_batches=args.recompute_batches,
            data_dir=args.data_dir, synthetic=args.synthetic, checkpoint=args.checkpoint,
            log=log)
    elif args.bench == "batch_norm":
        result = bench.bench_batch_norm(shape=args.shape, warmup=args.warmup, repeat=args.repeat,
                                        log=log, device=args.device)
    else:
        result = bench.bench_allreduce(devices=args.devices,
                                       sizes=args.sizes or bench.DEFAULT_SIZES,
                                       warmup=args.warmup, repeat=args.repeat, log=log)
    print(bench.format_result(result))
    if args.json:
        bench.save(result, args.json)
        print(f"results written to {args.json}")
    if args.plot:
        bench.plot(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _bench_parser(sub) -> None:
    from .bench import CONV_ALGOS, RESNET_PARTS, TRAIN_PARTS
    b = sub.add_parser("bench", help="benchmarks: the training step, LeNet's ops, all-reduce")
    kinds = b.add_subparsers(dest="bench", required=True)

    def common(p, warmup, repeat, warmup_help="untimed calls first",
               repeat_help="timed samples (median and spread are over these)"):
        p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
        p.add_argument("--repeat", type=int, default=repeat, help=repeat_help)
        p.add_argument("--json", metavar="PATH", help="write every raw timing as JSON")
        p.add_argument("--plot", metavar="PATH.png", help="draw the results (needs matplotlib)")
        p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
        p.set_defaults(run=_bench)

    def data_args(p):
        p.add_argument("--data-dir", default=None,
                       help="directory with the Fashion-MNIST IDX files")
        p.add_argument("--synthetic", type=int, default=0, metavar="N",
                       help="train on N random images instead of Fashion-MNIST")

    def torch_args(p):
        p.add_argument("--torch-python", metavar="PATH", default=None,
                       help="interpreter with torch (default: $MGPU_TORCH_PYTHON, else "
                            "build/peers/torch/bin/python, made by `bash .ci/peers.sh torch`, "
                            "else this one, else /usr/bin/python3)")
        p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads")

    t = kinds.add_parser("train", help="sec/epoch of LeNet or ResNet-18 training: fused, op by "
                                       "op, PyTorch")
    common(t, None, 3, "untimed batches before each training configuration (default 3; "
           "resnet18: 2)", "samples of the side measurements (input pipeline, evaluation, sgemm)")
    t.add_argument("--model", choices=["lenet", "resnet18"], default="lenet",
                   help="lenet: sec. 12.5's step; resnet18: sec. 12.6's DataParallel.train_step "
                        "and book's loop, each configuration in its own process (peak RSS), "
                        "against PyTorch eager and torch.compile with --compare torch, against "
                        "the JAX chapter's Flax ResNet18 with --compare jax")
    t.add_argument("--epochs", type=int, default=None,
                   help="timed epochs per training configuration (after --warmup batches; "
                        "default 3, resnet18: 1)")
    t.add_argument("--limit-batches", type=int, default=None,
                   help="batches per timed epoch; sec/epoch is then extrapolated (0: whole "
                        "epochs; default 20, resnet18: 5)")
    t.add_argument("--devices", type=_ints, default=[1, 2], help="device counts, e.g. 1,2")
    t.add_argument("--precision", default="float32", metavar="P[,P]",
                   help="the mgpu steps' precision(s), float32 and/or bf16 (e.g. "
                        "float32,bf16); lenet: the fused part runs once per precision, the other "
                        "parts in float32; resnet18: with bf16, --compare torch adds PyTorch eager "
                        "under torch.autocast(bfloat16)")
    t.add_argument("--batch-size", type=int, default=256, help="global minibatch size")
    t.add_argument("--weak-scaling", action="store_true",
                   help="resnet18: k devices train on batches of k x --batch-size, and the "
                        "report compares ms per image with 1 device's")
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.2, resnet18: 0.1)")
    data_args(t)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--parts", default=None,
                   help="what to measure, from: " + ",".join(TRAIN_PARTS) + " (resnet18: "
                        + ",".join(RESNET_PARTS) + "; default all), or layers alone (either "
                        "model: each layer's ms, GFLOP/s and %% of this CPU's measured FMA peak, "
                        "--limit-batches traced steps)")
    t.add_argument("--gemm-size", type=int, default=1024, help="n of the n x n sgemm reference")
    t.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                   help="resnet18: mgpu's optimizer, as mgpu train's (the rivals keep SGD)")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="resnet18: the optimizer's weight decay (default: its own)")
    t.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="resnet18: clip the gradients' global norm to X before every update")
    t.add_argument("--compare", default=None, metavar="torch|jax|torch,jax",
                   help="also time the chapters' PyTorch and/or JAX code (each in another "
                        "interpreter)")
    torch_args(t)
    t.add_argument("--jax-python", metavar="PATH", default=None,
                   help="interpreter with jax, flax and optax (default: $MGPU_JAX_PYTHON, else "
                        "build/peers/jax/bin/python, made by `bash .ci/peers.sh jax`)")
    t.add_argument("--jax-threads", type=int, default=2,
                   help="CPUs, so XLA threads, the JAX process uses")
    o = kinds.add_parser("ops", help="forward/backward time of each LeNet op on one device")
    common(o, 2, 10)
    o.add_argument("--batch-sizes", type=_ints, default=[128, 256], help="e.g. 128,256")
    o.add_argument("--device", default="cpu:0", help="the device to time, e.g. cpu:0 or gpu:0")
    n = kinds.add_parser("batch_norm", help="batch norm's kernels: time and GB/s against a copy")
    common(n, 2, 10)
    n.add_argument("--shape", type=_ints, default=[256, 64, 28, 28],
                   help="x shape, e.g. 256,64,28,28")
    n.add_argument("--device", default="cpu:0", help="the device to time, e.g. cpu:0 or gpu:0")
    v = kinds.add_parser("conv", help="the CPU conv's algorithms (MGPU_CONV_ALGO) at ResNet-18's "
                         "3x3 (or stride-2, or LeNet's) layers, interleaved")
    common(v, 1, 3)
    v.add_argument("--batch", type=int, default=64, help="images per call")
    v.add_argument("--algos", default="direct,winograd",
                   help=f"from: {','.join(CONV_ALGOS)} (bf16-NAME: precision bf16 under "
                   "MGPU_CONV_ALGO=NAME; bf16-auto is what training runs)")
    v.add_argument("--rounds", type=int, default=3, help="rounds over all algorithms")
    v.add_argument("--layers", default="3x3", choices=["3x3", "stride2", "lenet"],
                   help="ResNet-18's 3x3 stride-1 layers, its stride-2 3x3 and 1x1 layers, or "
                   "LeNet's two convs")
    v.add_argument("--device", default="cpu:0", help="the CPU device to time")
    v.add_argument("--onednn", metavar="PATH", default=None,
                   help="also time oneDNN's convolution with this onednn_conv_bench (made by "
                   "`bash .ci/peers.sh onednn`: build/peers/onednn/bin/onednn_conv_bench)")
    i = kinds.add_parser("isa", help="LeNet's ops and fused step under each CPU kernel path "
                         "(MGPU_ISA), interleaved, against the avx2 / avx512 target")
    common(i, 3, 10, "untimed batches before the timed fused steps",
           "timed samples of each op in every round")
    i.add_argument("--rounds", type=int, default=3, help="rounds over all paths")
    i.add_argument("--isas", default=None,
                   help="paths to time, e.g. avx2 (default: every path this CPU runs)")
    i.add_argument("--ops-batch", type=int, default=128, help="the ops' batch size")
    i.add_argument("--batch-size", type=int, default=256, help="the fused step's batch size")
    i.add_argument("--limit-batches", type=int, default=60,
                   help="timed fused steps per round (one epoch cut there)")
    data_args(i)
    i.add_argument("--compare", default=None, choices=["torch"],
                   help="also time the chapter's PyTorch step, with its default kernels and "
                        "with ATEN_CPU_CAPABILITY=avx2")
    torch_args(i)
    i.add_argument("--builds", metavar="PYTHON[,PYTHON...]", default=None,
                   help="also time the mgpu these interpreters import (e.g. a venv with `pip "
                        "install . -C cmake.define.MGPU_NATIVE_ARCH=ON`), round by round, "
                        "against this one; portable / native against its 5%% target")
    c = kinds.add_parser("checkpoint", help="write and load time of LeNet's and ResNet-18's "
                         "training checkpoints")
    common(c, 1, 5)
    c.add_argument("--models", default="lenet,resnet18", help="from: lenet,resnet18")
    c.add_argument("--no-momentum", dest="momentum", action="store_false",
                   help="leave SGD's momentum buffers out (half the size for ResNet-18)")
    c.add_argument("--dir", default=None,
                   help="where to write (default: the system's temporary directory)")
    q = kinds.add_parser("accuracy", help="test accuracy after training in float32 and bf16 over "
                         "seeds (mgpu.bench.accuracy)")
    q.add_argument("--model", choices=["resnet18", "lenet"], default="resnet18",
                   help="resnet18: sec. 12.6's recipe, fused; lenet: sec. 12.5's")
    q.add_argument("--precision", default="float32,bf16", help="from: float32,bf16")
    q.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="e.g. 0,1,2")
    q.add_argument("--epochs", type=int, default=None, help="default: resnet18 1, lenet 10")
    q.add_argument("--lr", type=float, default=None, help="default: resnet18 0.1, lenet 0.2")
    q.add_argument("--batch-size", type=int, default=256)
    q.add_argument("--num-gpus", type=int, default=1, help="devices per run")
    q.add_argument("--limit-batches", type=int, default=0,
                   help="batches per epoch and evaluation (0: all)")
    q.add_argument("--recompute-batches", type=int, default=40,
                   help="resnet18: training batches that recompute batch norm's statistics")
    data_args(q)
    q.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="save each run's state here and resume from it (a sweep of hours "
                        "survives a kill)")
    q.add_argument("--json", metavar="PATH", help="write the results as JSON")
    q.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    q.set_defaults(run=_bench, plot=None)
    a = kinds.add_parser("allreduce", help="all-reduce time, algbw and busbw over sizes")
    common(a, 3, 10)
    a.add_argument("--devices", type=_ints, default=[2], help="device counts k, e.g. 2,3,4")
    a.add_argument("--sizes", type=_sizes, default=None,
                   help="bytes per device, e.g. 1K,64K,4M (default: 1 KiB to 64 MiB, x4 steps)")


DESCRIPTION = """\
mgpu: d2l's "Training on Multiple GPUs" (12.5) and "Concise Implementation" (12.6) on a C++/CUDA
engine. Without a GPU, cpu(0), cpu(1), ... are virtual devices with one worker thread each."""

EXAMPLES = """\
examples:
  {prog} train --num-gpus 2 --batch-size 256 --lr 0.2          the chapter's LeNet run
  {prog} train --model resnet18 --fused --num-gpus 2 --batch-size 512 --lr 0.2
  {prog} info                  version, CPU kernel path, BLAS, built parts, devices, data
  {prog} info --env            every environment variable mgpu reads
  {prog} bench train --compare torch,jax --json run.json
  {prog} advise --model resnet18 --batch-size 64,256

{prog} COMMAND --help explains each command's options."""


def main(argv: Optional[List[str]] = None, prog: str = "mgpu") -> int:
    """Runs the command line ``argv`` (default: sys.argv[1:]) and returns the exit status.
    ``prog`` is the name the help and usage lines show (``python -m mgpu`` from __main__)."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     epilog=EXAMPLES.format(prog=prog),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train LeNet or ResNet-18 on Fashion-MNIST, data-parallel")
    t.add_argument("--model", choices=["lenet", "resnet18"], default="lenet",
                   help="lenet: sec. 12.5's fused step; resnet18: sec. 12.6's nn.DataParallel")
    t.add_argument("--sync-bn", action="store_true",
                   help="resnet18: batch statistics over the whole batch (nn.SyncBatchNorm)")
    t.add_argument("--fused", action="store_true",
                   help="resnet18: DataParallel.train_step (one C++ call per step) instead of "
                        "the book's loop through autograd")
    t.add_argument("--num-gpus", type=int, default=1,
                   help="devices to use: try_gpu(0..N-1), virtual CPU devices without GPUs")
    t.add_argument("--batch-size", type=int, default=256, help="global minibatch size")
    t.add_argument("--lr", type=float, default=0.2, help="learning rate")
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument("--data-dir", default=None, help="directory with the Fashion-MNIST IDX files")
    t.add_argument("--limit-batches", type=int, default=None,
                   help="stop every epoch after this many batches (quick runs)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--op-by-op", action="store_true",
                   help="use the chapter's Python train_batch instead of the fused one")
    t.add_argument("--deterministic", action="store_true",
                   help="bitwise the same parameters on any number of devices or processes "
                        "(fixed logical shards, fixed summation tree); with --op-by-op the "
                        "chapter's step in that order, the same bits again")
    t.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="keep training when the loss becomes NaN or infinite (default: stop)")
    t.add_argument("--trace", metavar="PATH.json", default=None,
                   help="write a Chrome/Perfetto timeline of the run (one file per rank under "
                        "mpirun; see trace-merge)")
    t.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="save the run's state in DIR at each epoch's end (and every K steps)")
    t.add_argument("--checkpoint-every", metavar="K", type=int, default=None,
                   help="also save a checkpoint every K steps (needs --checkpoint)")
    t.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                   help="resnet18: the optimizer (sgd: the book's, without momentum; adam and "
                        "adamw: PyTorch's rules)")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="resnet18: the optimizer's weight decay (default: its own, 0 for sgd "
                        "and adam, 0.01 for adamw)")
    t.add_argument("--schedule", choices=["none", "step", "cosine", "onecycle"], default="none",
                   help="the learning-rate schedule, stepped per batch (step: / 10 at "
                        "1/2 and 3/4 of the run; cosine: to 0 by the end; onecycle: up to --lr "
                        "and down)")
    t.add_argument("--warmup-epochs", type=int, default=0, metavar="N",
                   help="raise the lr linearly over the first N epochs (onecycle: its "
                        "rising phase)")
    t.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="resnet18: clip the gradients' global norm to X before every update")
    t.add_argument("--precision", choices=["float32", "bf16"], default="float32",
                   help="bf16 trains the convolutions and linear layers with bfloat16 "
                        "products and float32 sums (mgpu.autocast in the op-by-op and book's "
                        "loops; the fused step's precision). On CPUs the convolutions whose "
                        "float32 kernels are faster (ResNet-18's 3x3 stride-1 layers: Winograd; "
                        "LeNet's) run those on bfloat16-rounded operands: about float32's speed, "
                        "not yet faster")
    t.add_argument("--comm-dtype", choices=["float32", "bf16"], default="float32",
                   help="resnet18 --fused: bf16 all-reduces the gradients in "
                        "bfloat16, half the bytes (rounded to nearest even before the sum, "
                        "summed in float32 in the usual order; --deterministic keeps its bits "
                        "on any device count)")
    t.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="gradient accumulation: each batch as K micro-batches run one after "
                        "another (K times less activation memory), one reduction and one "
                        "update per batch; with --deterministic K must divide 8")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint DIR (a fresh run "
                        "if there is none); ends with the parameters of an uninterrupted run")
    t.add_argument("--log", metavar="PATH", default=None,
                   help="write JSON lines: per step loss, lr, images/s; per epoch test accuracy "
                        "and sec/epoch (pandas.read_json(PATH, lines=True))")
    t.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="write the same values as TensorBoard event files in DIR (needs "
                        "pip install tensorboard)")
    t.set_defaults(run=_train)
    m = sub.add_parser("trace-merge", help="join per-rank timelines into one (ranks as processes)")
    m.add_argument("out", help="the merged trace to write")
    m.add_argument("inputs", nargs="+", help="the ranks' trace files")
    m.set_defaults(run=_trace_merge)
    _advise_parser(sub)
    i = sub.add_parser("info", help="version, CPU kernel path, BLAS, built parts, devices, data")
    i.add_argument("--json", action="store_true", help="print mgpu.build_info() as JSON instead")
    i.add_argument("--env", action="store_true",
                   help="list every environment variable mgpu reads: effect and default")
    i.set_defaults(run=_info)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    from .loop import Preempted
    try:
        return args.run(args)
    except Preempted as e:
        # SIGTERM / SIGUSR1: the loop has printed its line (rank 0); the shell's status for it.
        return e.exit_status
    except KeyboardInterrupt:
        # Ctrl-C: one line, and the shell's status for SIGINT (128 + 2), no traceback.
        print("mgpu: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, IndexError, OSError, RuntimeError, MemoryError,
            ArithmeticError, ImportError) as e:  # ImportError: an optional package, named
        from . import distributed
        where = f" (rank {distributed.rank()})" if distributed.world_size() > 1 else ""
        print(f"mgpu: error{where}: {e}", file=sys.stderr)
        distributed.mark_failed()  # under mpirun: end every rank now, none waits for this one
        return 2
