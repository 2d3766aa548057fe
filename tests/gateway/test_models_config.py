"""``[[models]]``: several models in one gateway, each over ``[workers]``; problems by path."""

from __future__ import annotations

import tomllib

from gateway.settings import check_mapping
from gateway.workers.supervisor import WorkerSupervisor


def _check(text: str) -> tuple[object, list[str]]:
    return check_mapping(tomllib.loads(text))


def test_models_over_workers_defaults() -> None:
    s, problems = _check('[workers]\nmax_batch = 16\nengine = "synthetic"\n'
                         '[[models]]\nname = "a"\naliases = ["x"]\nlocal = 2\n'
                         '[[models]]\nname = "b"\nengine = "jax"\nmodel = "tiny"\nworkers = { max_batch = 4 }\n')
    assert problems == []
    a, b = s.models  # type: ignore[attr-defined]
    wa, wb = a.worker_settings(), b.worker_settings()
    assert (wa.served_name, wa.engine, wa.model, wa.local, wa.max_batch) == ("a", "synthetic", "tiny", 2, 16)
    assert (wb.served_name, wb.engine, wb.local, wb.max_batch) == ("b", "jax", 1, 4)
    assert [m.name for m in s.served()] == ["a", "b"]  # type: ignore[attr-defined]


def test_one_model_shortcut_without_models() -> None:
    s, problems = _check('[workers]\nmodel = "/m/Llama-3-8B/"\nlocal = 3\n')
    assert problems == []
    (m,) = s.served()  # type: ignore[attr-defined]
    assert (m.name, m.local) == ("Llama-3-8B", 3)


def test_every_problem_named_by_path() -> None:
    _, problems = _check('[workers]\nlocal = 2\n'
                         '[[models]]\nname = "a"\ncolour = "red"\n'
                         '[[models]]\nname = "b"\naliases = ["a"]\nlocal = -1\n'
                         '[[models]]\nname = "c d"\n'
                         '[[models]]\nname = "e"\nworkers = { model = "x", nonsense = 1 }\n')
    text = "\n".join(problems)
    for needle in ("workers.local: set per model", "models[0].colour: unknown key", "models[1]: 'a' already names 'a'",
                   "models[1].local: must be >= 0", "models[2].name", "models[3].workers.model: set it on the model",
                   "models[3].workers.nonsense: unknown [workers] option"):
        assert needle in text, (needle, problems)
    # what parses is then checked as each model's workers would run
    _, problems = _check('[[models]]\nname = "e"\nworkers = { max_batch = 0 }\n'
                         '[[models]]\nname = "f"\nremote = ["http://x"]\nlocal = 0\n')
    text = "\n".join(problems)
    for needle in ("models[0] (e): max_batch", "models[1] (f): remote"):
        assert needle in text, (needle, problems)


def test_supervisor_runs_every_models_local_workers_numbered_apart() -> None:
    s, problems = _check('[workers]\nengine = "synthetic"\nlisten = "unix:///tmp/qs-w"\ninsecure = true\n'
                         '[[models]]\nname = "a"\nlocal = 2\n[[models]]\nname = "b"\nlocal = 1\n'
                         'remote = ["tcp://10.0.0.9:7000"]\n')
    assert problems == []
    sup = WorkerSupervisor([m.worker_settings() for m in s.models], None, None, connect=lambda *a, **k: None)  # type: ignore[arg-type, attr-defined]
    names = [w.name for w in sup.workers]
    assert names == ["worker-0", "worker-1", "worker-2", "tcp://10.0.0.9:7000"]
    argvs = [" ".join(w.argv) for w in sup.workers[:3]]  # type: ignore[attr-defined]
    assert all("--served-name=a" in a for a in argvs[:2]) and "--served-name=b" in argvs[2]
    assert len({a.split("--listen=")[1].split()[0] for a in argvs}) == 3  # three unix paths
