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

from . import _core
from .tensor import Tensor

TEXT_LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot"]


def get_fashion_mnist_labels(labels) -> list:
    """Text names of numeric Fashion-MNIST labels."""
    return [TEXT_LABELS[int(i)] for i in np.asarray(labels).reshape(-1)]


class DataLoader:
    """Iterates (X, y) minibatches on cpu(0); a fresh epoch starts with every ``iter()``."""

    def __init__(self, split: "_core.DataSplit", batch_size: int, shuffle: bool, seed: int = 0,
                 limit_batches: int = 0):
        from .random import _seed
        from .tensor import _int
        batch_size = _int(batch_size, "DataLoader", "batch_size")
        if not 1 <= batch_size < 2**62:
            raise ValueError(f"DataLoader: batch_size must be >= 1, got {batch_size}")
        limit_batches = _int(limit_batches or 0, "DataLoader", "limit_batches")
        if not 0 <= limit_batches < 2**62:
            raise ValueError(f"DataLoader: limit_batches must be >= 0 (0: no limit), got "
                             f"{limit_batches}")
        self._it = _core.BatchIterator(split, batch_size, bool(shuffle),
                                       _seed(seed, "DataLoader"), False, limit_batches)
        self.batch_size = int(batch_size)

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor]]:
        self._it.start_epoch()
        while True:
            batch = self._it.next()
            if batch is None:
                return
            yield Tensor(batch[0]), Tensor(batch[1])

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
