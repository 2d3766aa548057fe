"""The TPU kernels compile with Mosaic itself (libtpu's compiler) for compile-only TPUs of two generations.

The kernels' own tests check the Pallas -> Mosaic lowering; this runs
``mosaic_compile.py`` in a subprocess with the libtpu wheel on its path
(``make test`` installs it into ``.venv/libtpu``), so Mosaic's layout and
VMEM passes see every kernel configuration there. No TPU is needed; whether
the compiled kernels are right and fast on one is for a TPU to show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inference.kernels import mosaic_compile

ROOT = Path(__file__).resolve().parents[3]
LIBTPU = Path(os.environ.get("QUICSERVE_LIBTPU_DIR", ROOT / ".venv" / "libtpu"))

pytestmark = pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(), reason=f"no libtpu wheel in {LIBTPU} (make test)")


def _cases() -> int:
    return sum(1 for gen in (mosaic_compile.prefill_cases, mosaic_compile.decode_cases,
                             mosaic_compile.matmul_cases) for _ in gen())  # fmt: skip


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_tpu_kernels_compile_with_mosaic(topology: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LIBTPU), str(ROOT)]), "TPU_ACCELERATOR_TYPE": topology}
    proc = subprocess.run([sys.executable, "-m", "tests.inference.kernels.mosaic_compile", "--topology", topology],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    ok = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "all compiled" in proc.stdout
    assert len(ok) == _cases() >= 15
