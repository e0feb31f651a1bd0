"""Fashion-MNIST, as the chapter loads it: ``load_data_fashion_mnist(batch_size)``.

The IDX files (gzip or raw) are read in C++ and searched for in: an explicit ``data_dir``,
``$MGPU_DATA``, ``~/.mgpu/data``, ``/usr/share/datasets/fashion-mnist`` (Debian's package
``dataset-fashion-mnist``). Images become float32 in [0, 1] of shape (N, 1, 28, 28), labels
int64; the training set is reshuffled every epoch from a seed, and the next batch is prepared on
a background thread while the current one trains.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import numpy as np

from .engine import core as _core
from .tensor import Tensor

TEXT_LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot"]


def get_fashion_mnist_labels(labels) -> list:
    """Text names of numeric Fashion-MNIST labels."""
    return [TEXT_LABELS[int(i)] for i in np.asarray(labels).reshape(-1)]


class DataLoader:
    """Iterates (X, y) minibatches on cpu(0); a fresh epoch starts with every ``iter()``.

    Epoch e visits the examples in an order fixed by (seed, e) alone, so the loader's whole
    state is where it is: ``state_dict()`` gives it, ``load_state_dict()`` makes the next
    ``iter()`` continue from there, mid-epoch included (checkpoints, ``mgpu.save``).
    """

    def __init__(self, split: "_core.DataSplit", batch_size: int, shuffle: bool, seed: int = 0,
                 limit_batches: int = 0):
        from .random import check_seed
        from .tensor import check_int
        batch_size = check_int(batch_size, "DataLoader", "batch_size")
        if not 1 <= batch_size < 2**62:
            raise ValueError(f"DataLoader: batch_size must be >= 1, got {batch_size}")
        limit_batches = check_int(limit_batches or 0, "DataLoader", "limit_batches")
        if not 0 <= limit_batches < 2**62:
            raise ValueError(f"DataLoader: limit_batches must be >= 0 (0: no limit), got "
                             f"{limit_batches}")
        self._it = _core.BatchIterator(split, batch_size, bool(shuffle),
                                       check_seed(seed, "DataLoader"), False, limit_batches)
        self.batch_size = int(batch_size)
        self._limit_batches = limit_batches
        self._epoch = -1     # the epoch being (or last) iterated
        self._position = 0   # batches of it handed out so far
        self._finished = False  # its iteration has ended
        self._resume_at: Optional[Tuple[int, int]] = None  # (epoch, batch) for the next iter()

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor]]:
        if self._resume_at is not None:
            self._epoch, self._position = self._resume_at
            self._resume_at = None
        else:
            self._epoch, self._position = self._epoch + 1, 0
        self._finished = False
        self._it.start_epoch_at(self._epoch, self._position)
        while True:
            batch = self._it.next()
            if batch is None:
                self._finished = True
                return
            self._position += 1
            yield Tensor(batch[0]), Tensor(batch[1])

    def state_dict(self) -> dict:
        """Where the next ``iter()`` continues: the epoch under way and the batches of it handed
        out, or the next epoch at batch 0 once an epoch's iteration has ended; plus what fixes
        the order (seed, shuffle, batch size, dataset size, batch limit), checked on loading.
        After the last batch of an epoch, before its iteration ends, the position is
        ``len(loader)``: a loader restored there first gives that epoch's (empty) rest."""
        if self._resume_at is not None:
            epoch, position = self._resume_at
        elif self._finished:
            epoch, position = self._epoch + 1, 0
        else:
            epoch, position = self._epoch, self._position
        return {"epoch": int(epoch), "batch": int(position),
                "batches_per_epoch": int(len(self)), "batch_size": self.batch_size,
                "num_examples": int(self._it.num_examples), "shuffle": bool(self._it.shuffle),
                "seed": int(self._it.seed), "limit_batches": int(self._limit_batches)}

    def load_state_dict(self, state: dict) -> None:
        """Makes the next ``iter()`` continue where ``state`` (from :meth:`state_dict`) was.

        The loader must visit the same data in the same order (same dataset size, batch size,
        shuffle, seed and batch limit): ValueError names what differs, and nothing changes."""
        if not isinstance(state, dict):
            raise TypeError(f"DataLoader.load_state_dict: expected a dict from state_dict(), got "
                            f"{type(state).__name__}")
        mine = self.state_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"DataLoader.load_state_dict: the state lacks {missing}; pass a "
                             "dict from DataLoader.state_dict()")
        differ = [f"{k} {state[k]!r} (this loader: {mine[k]!r})"
                  for k in ("num_examples", "batch_size", "shuffle", "seed", "limit_batches",
                            "batches_per_epoch") if state[k] != mine[k]]
        if differ:
            raise ValueError("DataLoader.load_state_dict: the state is of a loader with another "
                             "data order: " + "; ".join(differ))
        epoch, position = state["epoch"], state["batch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < -1 or \
                isinstance(position, bool) or not isinstance(position, int) or \
                not 0 <= position <= len(self):
            raise ValueError(f"DataLoader.load_state_dict: epoch {epoch!r} and batch "
                             f"{position!r} are not a position of this loader (epoch >= -1, "
                             f"batch in [0, {len(self)}])")
        if epoch == -1:  # saved before the first epoch: start from the beginning
            self._resume_at, self._epoch, self._position = None, -1, 0
        else:
            self._resume_at = (epoch, position)
        self._finished = False

    def __len__(self) -> int:
        return self._it.num_batches

    @property
    def num_examples(self) -> int:
        """Examples one pass visits (after any limit on batches)."""
        return self._it.examples_per_epoch


def find_data_dir(data_dir: Optional[str] = None) -> str:
    """The directory holding Fashion-MNIST; ``FileNotFoundError`` says how to get it."""
    return _core.find_fashion_mnist(str(data_dir) if data_dir else "")


def load_fashion_mnist_arrays(data_dir: Optional[str] = None):
    """The raw uint8 NumPy arrays (train_images, train_labels, test_images, test_labels)."""
    train, test = _core.load_fashion_mnist(find_data_dir(data_dir))
    return train.images_numpy(), train.labels_numpy(), test.images_numpy(), test.labels_numpy()


def load_data_fashion_mnist(batch_size: int, resize=None, data_dir: Optional[str] = None,
                            seed: int = 0, limit_batches: Optional[int] = None
                            ) -> Tuple[DataLoader, DataLoader]:
    """(train_iter, test_iter) over Fashion-MNIST, as in the chapter.

    ``limit_batches`` cuts every epoch short (for quick runs); ``seed`` fixes the shuffles.
    """
    if resize is not None:
        raise ValueError("load_data_fashion_mnist: resize is not supported; the chapter's LeNet "
                         "takes the 28x28 images as they are")
    train, test = _core.load_fashion_mnist(find_data_dir(data_dir))
    return (DataLoader(train, batch_size, True, seed, limit_batches or 0),
            DataLoader(test, batch_size, False, seed, limit_batches or 0))


def array_loader(images: np.ndarray, labels: np.ndarray, batch_size: int, shuffle: bool = False,
                 seed: int = 0) -> DataLoader:
    """A DataLoader over in-memory uint8 images (N, H, W) and labels (N,), e.g. for tests."""
    split = _core.make_split(np.asarray(images, dtype=np.uint8), np.asarray(labels, dtype=np.uint8))
    return DataLoader(split, batch_size, shuffle, seed)
