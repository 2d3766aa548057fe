"""[workers] settings of elastic pools (#35) and the compilation cache a local worker is given."""

from __future__ import annotations

from pathlib import Path

from gateway.workers.config import WorkersSettings
from gateway.workers.process import worker_command


def _problems(ws: WorkersSettings) -> list[str]:
    p: list[str] = []
    ws._validate(p)
    return p


def test_elastic_settings_are_checked() -> None:
    assert not WorkersSettings().elastic and WorkersSettings(local=3).initial_replicas == 3
    ws = WorkersSettings(local=1, min_replicas=0, max_replicas=4)
    assert ws.elastic and ws.initial_replicas == 1 and not _problems(ws)
    assert WorkersSettings(local=9, min_replicas=2, max_replicas=4).initial_replicas == 4  # within min..max
    assert WorkersSettings(local=0, min_replicas=2, max_replicas=4).initial_replicas == 2
    assert any("min_replicas" in p for p in _problems(WorkersSettings(min_replicas=5, max_replicas=4)))
    assert any("queue_budget" in p for p in _problems(WorkersSettings(max_replicas=2, queue_budget=0)))
    assert any("waiting_room" in p for p in _problems(WorkersSettings(max_replicas=2, waiting_room=-1)))


def test_a_local_worker_caches_compilations_in_the_state_directory_per_model(tmp_path: Path) -> None:
    ws = WorkersSettings(served_name="chat-7b")
    argv = worker_command(ws, 0, str(tmp_path))
    assert f"--compilation-cache={tmp_path}/compilation-cache/chat-7b" in argv
    assert worker_command(ws, 3, str(tmp_path))[-len(argv) + 4:] == argv[4:]  # replicas share it
    assert "--compilation-cache=/srv/cc" in worker_command(WorkersSettings(compilation_cache="/srv/cc"), 0, "/x")
    assert "--compilation-cache=" in worker_command(WorkersSettings(compilation_cache=""), 0, "/x")
    assert not any(a.startswith("--compilation-cache") for a in worker_command(ws, 0))  # the worker's own default
