"""The persistent compilation cache (#35): the worker's ``compilation_cache`` option names a directory,
compilations land there, and a second process (a restart, another replica) loads them instead of
compiling. Each side runs in a process of its own: JAX sets its cache up once per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transport.common.worker_options import compilation_cache_dir as cache_dir

# One process: the cache as the worker enables it, then a jitted function of a small model's kind
# (compiled well under JAX's default one-second floor for caching); prints the cache events seen.
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from inference.model.compile_cache import enable
from pathlib import Path
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
enable(Path(sys.argv[1]))
f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=-1))
f(jnp.ones((4, 8)), jnp.ones((8, 8))).block_until_ready()
print(json.dumps([e for e in events if "compilation_cache" in e]))
"""


def _run(directory: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(directory)], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).resolve().parents[3])
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_cache_directory_is_written_then_read_by_the_next_process(tmp_path: Path) -> None:
    d = cache_dir("auto", "tiny", str(tmp_path))
    assert d == tmp_path / "compilation-cache" / "tiny"
    first = _run(d)
    assert "/jax/compilation_cache/cache_hits" not in first
    entries = sorted(p.name for p in d.iterdir())
    assert entries, "nothing was written to the cache directory"
    second = _run(d)
    assert "/jax/compilation_cache/cache_hits" in second  # loaded, not compiled
    assert sorted(p.name for p in d.iterdir()) == entries  # nothing new to write


def test_the_option_names_the_directory() -> None:
    assert cache_dir("", "tiny") is None
    assert cache_dir("/srv/cache", "tiny") == Path("/srv/cache")
    assert cache_dir("auto", "org/My Model", "/state") == Path("/state/compilation-cache/org_My_Model")
    assert cache_dir("auto", "tiny") == Path("~/.local/state/quicserve/compilation-cache/tiny").expanduser()
