"""The bf16 products' CPU paths (cpp/ops/bf16.h) in child interpreters: MGPU_ISA is read at
import, so each path runs its own process."""
import os
import subprocess
import sys
from typing import Dict

BF16_PATHS = ("avx2", "avx512", "avx512_bf16")


def digests_on_every_path(code: str, **env: str) -> Dict[str, str]:
    """{path: digest} of `code` run under MGPU_ISA=path (with `env` too) on every path this CPU
    runs; the code prints ``build_info()["cpu_bf16"]`` and a digest, and the path it names must
    be the one asked for. A path the CPU lacks (no AVX-512) is left out; avx2 never is."""
    seen = {}
    for isa in BF16_PATHS:
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, MGPU_ISA=isa, **env),
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0 and "lacks AVX-512" in r.stderr:
            continue
        assert r.returncode == 0, r.stderr
        path, digest = r.stdout.split()
        assert path == isa
        seen[isa] = digest
    assert "avx2" in seen, seen
    return seen
