"""The official JSON-Schema-Test-Suite (draft 2020-12, required tests) on the shipped engine.

Remote ``$ref`` (``http://localhost:1234/...``) resolve from the copied
``remotes/`` folder; anything else a retriever is asked for fails the test, so
nothing reaches the network. ``optional/`` is not required and not copied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.admission.schema import available_engines, compile_schema, default_engine

SUITE = Path(__file__).parent / "jsonschema_suite"
REMOTE = "http://localhost:1234/"
FILES = sorted((SUITE / "tests" / "draft2020-12").glob("*.json"))


def _retrieve(uri: str) -> Any:
    if not uri.startswith(REMOTE):
        raise LookupError(f"refusing to fetch {uri!r}: tests never use the network")
    return json.loads((SUITE / "remotes" / uri[len(REMOTE):].split("#")[0]).read_text())


def _run(path: Path, engine: str) -> tuple[int, list[str]]:
    ran, failures = 0, []
    for case in json.loads(path.read_text()):
        validator = compile_schema(case["schema"], engine, _retrieve)
        for test in case["tests"]:
            ran += 1
            got = validator.is_valid(test["data"])
            explained = validator.first_error(test["data"]) is None
            if got != test["valid"] or explained != test["valid"]:
                failures.append(f"{case['description']} / {test['description']}: expected valid={test['valid']}, "
                                f"is_valid={got}, first_error={'none' if explained else 'some'}")
    return ran, failures


def test_suite_is_complete() -> None:
    assert len(FILES) >= 45, "the 2020-12 suite was not copied in full"
    assert (SUITE / "LICENSE").is_file()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_required_2020_12_on_shipped_engine(path: Path) -> None:
    ran, failures = _run(path, default_engine())
    assert ran > 0
    assert not failures, "\n".join(failures)


# Where the fallback (python-jsonschema 4.x) falls short of the required tests: Python's ``re``
# has no ``\p{...}`` classes, and it ignores a custom metaschema's ``$vocabulary``. Strict
# xfail, so a fixed upstream shows up here.
REFERENCE_GAPS = {"pattern", "patternProperties", "vocabulary"}


@pytest.mark.skipif("jsonschema-rs" not in available_engines(), reason="checks the fallback beside the fast engine")
@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(raises=(AssertionError, Exception), strict=True,
                                            reason="known gap of the reference engine"))
    if p.stem in REFERENCE_GAPS else p for p in FILES], ids=[p.stem for p in FILES])
def test_required_2020_12_on_reference_fallback(path: Path) -> None:
    ran, failures = _run(path, "jsonschema")
    assert not failures, "\n".join(failures)
