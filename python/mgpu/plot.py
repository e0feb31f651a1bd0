"""Plots for the chapter: an accuracy curve that updates in place in a notebook (d2l's Animator)."""
from __future__ import annotations

from typing import List, Optional, Sequence


class Animator:
    """Adds points epoch by epoch and redraws the figure in a Jupyter notebook."""

    def __init__(self, xlabel: str = "epoch", ylabel: str = "",
                 legend: Optional[Sequence[str]] = None,
                 xlim=None, ylim=None, figsize=(3.5, 2.5)):
        import matplotlib.pyplot as plt
        self.fig, self.ax = plt.subplots(figsize=figsize)
        self.xlabel, self.ylabel, self.legend = xlabel, ylabel, legend
        self.xlim, self.ylim = xlim, ylim
        self.X: List[List[float]] = []
        self.Y: List[List[float]] = []
        self._handle = None  # the notebook output this figure lives in, updated in place
        plt.close(self.fig)  # shown through display() only, never twice

    def add(self, x: float, ys: Sequence[float]) -> None:
        if not self.X:
            self.X = [[] for _ in ys]
            self.Y = [[] for _ in ys]
        for i, y in enumerate(ys):
            self.X[i].append(x)
            self.Y[i].append(y)
        self.ax.cla()
        for xs, vals in zip(self.X, self.Y):
            self.ax.plot(xs, vals, marker="o")
        self.ax.set_xlabel(self.xlabel)
        self.ax.set_ylabel(self.ylabel)
        if self.xlim and self.xlim[0] != self.xlim[1]:  # a one-epoch run leaves xlim alone
            self.ax.set_xlim(*self.xlim)
        if self.ylim:
            self.ax.set_ylim(*self.ylim)
        if self.legend:
            self.ax.legend(self.legend)
        self.ax.grid(True)
        try:
            from IPython import display
        except ImportError:
            return
        # One output, updated in place: text printed after the loop (the chapter's summary
        # line) then appears below the final figure instead of wiping it.
        if self._handle is None:
            self._handle = display.display(self.fig, display_id=True)
        else:
            self._handle.update(self.fig)
