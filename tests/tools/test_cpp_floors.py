"""The engine's floors (cpp/): a file includes headers of its own directory or of the floors
below it, never above: cuda (the runtime seam) <- core <- ops <- comm <- train; data needs core
only; bind (the Python binding) and bench may include any. Read from the sources, nothing is
compiled."""
import os
import re

CPP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cpp")

# Bottom to top: a directory includes its own headers and those of the floors below.
FLOORS = ["cuda", "core", "ops", "comm", "train"]
BELOW = {d: set(FLOORS[:i + 1]) for i, d in enumerate(FLOORS)}
BELOW["data"] = {"cuda", "core", "data"}
TOPS = {"bind", "bench", "cmake"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)


def upward_includes(root=CPP):
    """[(file, included floor)] for every include that points up, or to an unknown folder."""
    out = []
    for d in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, d)) or d in TOPS:
            continue
        for base, _, files in os.walk(os.path.join(root, d)):
            for f in files:
                if not f.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(base, f)
                with open(path, encoding="utf-8") as src:
                    for target in INCLUDE.findall(src.read()):
                        if target not in BELOW.get(d, ()):
                            out.append((os.path.relpath(path, root), target))
    return out


def test_every_directory_has_a_floor():
    dirs = {d for d in os.listdir(CPP) if os.path.isdir(os.path.join(CPP, d))}
    assert dirs - TOPS <= set(BELOW), f"place {sorted(dirs - TOPS - set(BELOW))} on a floor"


def test_includes_point_down_only():
    assert upward_includes() == []


def test_an_upward_include_is_caught(tmp_path):
    """The check itself: comm including a train header fails it."""
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "x.cpp").write_text('#include "comm/y.h"\n#include "train/model.h"\n')
    assert upward_includes(str(tmp_path)) == [(os.path.join("comm", "x.cpp"), "train")]
