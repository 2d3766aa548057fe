"""The TPU kernels, and whole model steps using them, compile with Mosaic itself (libtpu's compiler)
for compile-only TPUs of two generations.

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


def _cases(model: bool) -> int:
    gens = [mosaic_compile.prefill_cases, mosaic_compile.decode_cases, mosaic_compile.matmul_cases]
    return sum(1 for gen in gens + [mosaic_compile.model_cases] * model for _ in gen())


@pytest.mark.parametrize("topology,model", [("v5e:2x2", True), ("v6e:2x2", False)])
def test_tpu_kernels_compile_with_mosaic(topology: str, model: bool) -> None:
    """Every kernel case on two generations; the whole-model steps (~40 s of compiling) on v5e."""
    # No TPU is opened, so libtpu's one-process-per-host lockfile only gets in the way of another run.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LIBTPU), str(ROOT)]), "TPU_ACCELERATOR_TYPE": topology,
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    cmd = [sys.executable, "-m", "tests.inference.kernels.mosaic_compile", "--topology", topology]
    proc = subprocess.run(cmd + ([] if model else ["--kernels-only"]), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    ok = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "all compiled" in proc.stdout
    assert len(ok) == _cases(model) >= 15 + 4 * model
    assert not model or sum("model " in line for line in ok) == 4
