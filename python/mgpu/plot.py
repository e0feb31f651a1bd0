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


def _load_trace(trace) -> dict:
    import json
    import os
    if isinstance(trace, dict):
        return trace
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError("timeline: trace must be a path to a Chrome trace JSON or its dict, got "
                        f"{type(trace).__name__}")
    with open(trace) as f:
        return json.load(f)


def _span_color(e: dict) -> str:
    name = e.get("name", "")
    if name.startswith("wait") or name == "queue full":
        return "0.65"
    if "allreduce" in name or name.startswith("distributed.") or "bucket" in name:
        return "C1"
    if "backward" in name:
        return "C3"
    if "forward" in name or name == "evaluate":
        return "C0"
    if name in ("copy", "split and copy batch", "load batch") or name.startswith("split"):
        return "C2"
    if "sgd" in name or "update" in name:
        return "C4"
    return "C7"


def timeline(trace, path: Optional[str] = None, window=None, ax=None, label_min: float = 0.06):
    """Draws a Chrome trace (``mgpu.profile``'s file or dict) with matplotlib: one row per track
    (process / thread), each span a bar, spans nested in another thinner on top of it. Colours:
    forward blue, backward red, all-reduce orange, copies and data green, update purple, waits
    grey. ``window=(t0_ms, t1_ms)`` shows that part (ms from the first event); spans wider than
    ``label_min`` of the window are labelled. Returns the Figure; writes it to ``path`` if given.
    """
    from matplotlib.figure import Figure
    doc = _load_trace(trace)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    names, procs, order = {}, {}, {}
    spans: dict = {}
    for e in events:
        ph, key = e.get("ph"), (e.get("pid", 0), e.get("tid", 0))
        if ph == "M" and e.get("name") == "thread_name":
            names[key] = e["args"]["name"]
        elif ph == "M" and e.get("name") == "process_name":
            procs[e.get("pid", 0)] = e["args"]["name"]
        elif ph == "M" and e.get("name") == "thread_sort_index":
            order[key] = e["args"]["sort_index"]
        elif ph == "X":
            spans.setdefault(key, []).append(e)
    if not spans:
        raise ValueError("timeline: the trace holds no spans ('X' events); record some work "
                         "inside mgpu.profile()")
    t_first = min(e["ts"] for evs in spans.values() for e in evs)
    t_last = max((e["ts"] + e["dur"] - t_first) / 1e3 for evs in spans.values() for e in evs)
    lo, hi = window if window is not None else (0.0, t_last)
    width = (hi - lo) or 1.0
    keys = sorted(spans, key=lambda k: (k[0], order.get(k, 0), k[1]))
    fig = None
    if ax is None:
        fig = Figure(figsize=(11, 0.45 * len(keys) + 1.2), layout="constrained")
        ax = fig.subplots()
    bars: dict = {}  # (row, depth, color) -> [(start, width)], drawn with one broken_barh each
    for row, key in enumerate(keys):
        stack: List[float] = []  # ends of the spans enclosing the current one
        for e in sorted(spans[key], key=lambda e: (e["ts"], -e["dur"])):
            t0 = (e["ts"] - t_first) / 1e3
            t1 = t0 + e["dur"] / 1e3
            while stack and t0 >= stack[-1]:
                stack.pop()
            depth = len(stack)
            stack.append(t1)
            if t1 < lo or t0 > hi:
                continue
            bars.setdefault((row, depth, _span_color(e)), []).append((t0, max(t1 - t0, 1e-6)))
            if depth == 0 and min(t1, hi) - max(t0, lo) > label_min * width:
                ax.text((max(t0, lo) + min(t1, hi)) / 2, row, e["name"], ha="center",
                        va="center", fontsize=6, clip_on=True)
    for (row, depth, color), xs in sorted(bars.items(), key=lambda kv: kv[0][1]):
        h = 0.8 * 0.6 ** depth
        ax.broken_barh(xs, (row - h / 2, h), facecolors=color, edgecolor="black",
                       linewidth=0.2)
    multi = len({k[0] for k in keys}) > 1
    ax.set_yticks(range(len(keys)),
                  [(f"{procs.get(k[0], k[0])}: " if multi else "") + names.get(k, str(k[1]))
                   for k in keys], fontsize=7)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("ms from the first event")
    ax.grid(True, axis="x", linewidth=0.3)
    fig = fig or ax.figure
    if path:
        fig.savefig(path, dpi=130)
    return fig
