"""API keys: missing, bad, revoked and reloaded keys; model restrictions; keys never leak."""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest

from gateway.admission import (
    Admission,
    AdmissionContext,
    AdmissionSettings,
    auth_warning,
    hash_key,
)
from gateway.admission.keys import KeyFileError, KeyStore
from gateway.errors import APIError

KEY_A = "sk-test-alpha-0123456789abcdef"
KEY_B = "sk-test-bravo-fedcba9876543210"


def _toml(path: Path, entries: list[str]) -> None:
    path.write_text("\n".join(entries))


def _entry(kid: str, key: str, extra: str = "") -> str:
    return textwrap.dedent(f"""
        [[keys]]
        id = "{kid}"
        sha256 = "{hash_key(key)}"
        """) + extra


def _ctx(key: str | None, model: str = "tiny") -> AdmissionContext:
    auth = None if key is None else b"Bearer " + key.encode()
    return AdmissionContext(auth, "10.0.0.7", model, "/v1/chat/completions", 10, 20)


def _admission(tmp_path: Path, entries: list[str], **kw: object) -> tuple[Admission, Path]:
    f = tmp_path / "keys.toml"
    _toml(f, entries)
    return Admission.from_settings(AdmissionSettings(keys_file=str(f), **kw)), f  # type: ignore[arg-type]


def test_missing_bad_and_good_key(tmp_path: Path) -> None:
    adm, _ = _admission(tmp_path, [_entry("alpha", KEY_A)])
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(None), 0.0)
    assert e.value.status == 401 and "didn't provide an API key" in e.value.message
    for bad in (KEY_B, KEY_A[:-1], KEY_A + "x"):
        with pytest.raises(APIError) as e:
            adm.admit(_ctx(bad), 0.0)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError):  # not Bearer
        adm.admit(AdmissionContext(b"Basic " + KEY_A.encode(), None, "tiny", "/", 1, 1), 0.0)
    g = adm.admit(_ctx(KEY_A), 0.0)
    assert g.key_id == "alpha"
    g2 = adm.admit(AdmissionContext(b"bearer  " + KEY_A.encode() + b" ", None, "tiny", "/", 1, 1), 0.0)
    assert g2.key_id == "alpha"


def test_model_restriction_and_priority(tmp_path: Path) -> None:
    adm, _ = _admission(tmp_path, [_entry("alpha", KEY_A, 'models = ["tiny"]\npriority = 2\n')])
    assert adm.admit(_ctx(KEY_A, "tiny"), 0.0).priority == 2
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(KEY_A, "big"), 0.0)
    assert (e.value.status, e.value.code, e.value.param) == (403, "model_not_allowed", "model")
    lowered = AdmissionContext(b"Bearer " + KEY_A.encode(), None, "tiny", "/", 1, 1, priority=0)
    assert adm.admit(lowered, 0.0).priority == 0  # a hint lowers, never raises
    raised = AdmissionContext(b"Bearer " + KEY_A.encode(), None, "tiny", "/", 1, 1, priority=5)
    assert adm.admit(raised, 0.0).priority == 2


def test_revoke_and_add_by_reload(tmp_path: Path) -> None:
    adm, f = _admission(tmp_path, [_entry("alpha", KEY_A)], keys_check_interval=1.0)
    adm.admit(_ctx(KEY_A), 0.0)
    _toml(f, [_entry("bravo", KEY_B)])  # alpha revoked, bravo added
    os.utime(f, (1_000_000, 1_000_000))  # a distinct mtime whatever the filesystem's resolution
    adm.admit(_ctx(KEY_A), 0.5)  # not checked again before the interval
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(KEY_A), 1.5)
    assert e.value.status == 401
    assert adm.admit(_ctx(KEY_B), 1.6).key_id == "bravo"
    # SIGHUP path: explicit reload
    _toml(f, [_entry("alpha", KEY_A), _entry("bravo", KEY_B)])
    assert adm.reload_keys() == []
    assert adm.admit(_ctx(KEY_A), 1.7).key_id == "alpha"


def test_broken_reload_keeps_old_keys(tmp_path: Path) -> None:
    adm, f = _admission(tmp_path, [_entry("alpha", KEY_A)])
    f.write_text("[[keys]]\nid = 'alpha'\nsha256 = 'nothex'\n")
    problems = adm.reload_keys()
    assert problems and "64 hex digits" in problems[0]
    assert adm.admit(_ctx(KEY_A), 0.0).key_id == "alpha"


def test_jsonl_key_file_and_config_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys.jsonl"
    f.write_text(f'{{"id": "alpha", "sha256": "{hash_key(KEY_A)}", "models": ["tiny"]}}\n\n')
    store = KeyStore([f"bravo:{hash_key(KEY_B)}"], str(f))
    assert len(store) == 2
    assert store.authenticate(b"Bearer " + KEY_B.encode()).id == "bravo"
    assert store.authenticate(b"Bearer " + KEY_A.encode()).models == frozenset({"tiny"})


@pytest.mark.parametrize("content, needle", [
    ('[[keys]]\nid = "a"\nsha256 = "{h}"\n[[keys]]\nid = "a"\nsha256 = "{h2}"\n', "appears twice"),
    ('[[keys]]\nid = "a"\nsha256 = "{h}"\ncolour = 1\n', "unknown field"),
    ('[[keys]]\nid = "a"\nsha256 = "{h}"\n[[keys.limits]]\nunit = "bytes"\nlimit = 1\nwindow = 1\n', "unit"),
    ("[[keys]\n", "not valid TOML"),
])
def test_bad_key_files_say_why_without_the_key(tmp_path: Path, content: str, needle: str) -> None:
    f = tmp_path / "keys.toml"
    f.write_text(content.format(h=hash_key(KEY_A), h2=hash_key(KEY_B)))
    with pytest.raises(KeyFileError) as e:
        KeyStore(path=str(f))
    assert needle in str(e.value)
    assert KEY_A not in str(e.value)


def test_key_never_in_logs_or_reprs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Exercise every path with the key in hand and look for it (and its digest) everywhere."""
    caplog.set_level(logging.DEBUG)
    entry = _entry("alpha", KEY_A, 'models = ["tiny"]\nmax_concurrency = 1\n[[keys.limits]]\nunit = "requests"\n'
                   'limit = 1\nwindow = 60\n')
    adm, _ = _admission(tmp_path, [entry], limits=["key tokens 1000/1m"])
    seen: list[object] = [adm, adm.keys, adm.limits, adm.shedder, _ctx(KEY_A)]
    assert adm.keys is not None
    broken = tmp_path / "keys.toml"
    good = broken.read_text()
    broken.write_text(good.replace("[[keys.limits]]", "[[keys.limits]]\nbogus = 1"))
    seen.append(adm.reload_keys())  # a failed reload logs why ...
    broken.write_text(good)
    seen.append(adm.reload_keys())  # ... and a good one what it loaded
    assert any("not reloaded" in r.getMessage() for r in caplog.records)
    grant = adm.admit(_ctx(KEY_A), 0.0)
    seen += [grant, grant.reservation]
    assert adm.keys is not None
    seen += list(adm.keys._by_digest.values())
    for bad in (_ctx(KEY_A), _ctx(KEY_A, "big"), _ctx(KEY_A + "x"), _ctx(None)):
        with pytest.raises(APIError) as e:
            adm.admit(bad, 1.0)
        seen += [e.value, e.value.message, e.value.headers]
    secrets = (KEY_A, hash_key(KEY_A), bytes.fromhex(hash_key(KEY_A)).hex())
    texts = [repr(o) for o in seen] + [str(o) for o in seen] + [r.getMessage() for r in caplog.records]
    for text in texts:
        for s in secrets:
            assert s not in text


def test_auth_warning() -> None:
    assert auth_warning("127.0.0.1", False) is None
    assert auth_warning("::1", False) is None
    assert auth_warning("localhost", False) is None
    assert auth_warning("0.0.0.0", True) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        w = auth_warning(host, False)
        assert w is not None and "NO API KEYS" in w and host in w


def test_auth_off_admits_anonymous() -> None:
    adm = Admission.from_settings(AdmissionSettings())
    g = adm.admit(_ctx(None), 0.0)
    assert g.key_id is None and g.priority == AdmissionSettings().default_priority
    with pytest.raises(ValueError):
        Admission.from_settings(AdmissionSettings(auth="on"))


def test_digest_cache_holds_valid_short_keys_only() -> None:
    """The digest cache saves hashing for keys seen before; garbage is not cached (no flooding), long
    values are not cached (bounded memory), and a revoked key fails though its digest was cached."""
    store = KeyStore([f"good:{hash_key('sk-good')}"])
    assert store.authenticate(b"Bearer sk-good").id == "good"
    assert store.authenticate(b"Bearer sk-good").id == "good"  # from the cache
    for i in range(100):
        with pytest.raises(APIError):
            store.authenticate(b"Bearer sk-bad-%d" % i)
    assert list(store.seen) == [b"Bearer sk-good"]
    store._inline = ()  # revoke: the inline key is gone at the next reload
    store.reload()
    with pytest.raises(APIError) as e:
        store.authenticate(b"Bearer sk-good")
    assert e.value.status == 401
