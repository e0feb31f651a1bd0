"""``python -m mgpu``: train the chapter's LeNet from a shell, or show what this build contains."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _train(args) -> int:
    from .train import train, train_op_by_op
    kw = dict(data_dir=args.data_dir, limit_batches=args.limit_batches, seed=args.seed)
    if args.op_by_op:
        train_op_by_op(args.num_gpus, args.batch_size, args.lr, args.epochs, **kw)
    else:
        train(args.num_gpus, args.batch_size, args.lr, args.epochs, **kw)
    return 0


def _info(args) -> int:
    from . import _core
    info = dict(_core.build_info())
    info["num_gpus"] = _core.num_gpus()
    print(json.dumps(info, indent=2))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train LeNet on Fashion-MNIST, data-parallel")
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
    t.set_defaults(run=_train)
    i = sub.add_parser("info", help="what this build contains (mgpu.build_info())")
    i.set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, IndexError, FileNotFoundError, RuntimeError) as e:
        print(f"mgpu: error: {e}", file=sys.stderr)
        return 2
