"""Settings: defaults, TOML, env overrides, CLI overrides, validation, config check."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from gateway.settings import Settings, SettingsError, check_file, load_settings

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_frozen() -> None:
    s = load_settings(environ={})
    assert s.server.port == 8080 and s.server.tls_port == 8443 and s.workers.local == 1
    assert s.workers.engine == "jax" and s.workers.model == "tiny"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.server.port = 1  # type: ignore[misc]


def test_default_toml_documents_every_setting_with_the_default_values() -> None:
    data = tomllib.loads((REPO / "config" / "default.toml").read_text())
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        section = getattr(defaults, f.name)
        assert f.name in data, f"[{f.name}] missing from config/default.toml"
        for sf in dataclasses.fields(section):
            assert sf.name in data[f.name], f"{f.name}.{sf.name} missing from config/default.toml"
            assert data[f.name][sf.name] == getattr(section, sf.name), f"{f.name}.{sf.name} differs"
        assert set(data[f.name]) == {sf.name for sf in dataclasses.fields(section)}
    assert check_file(REPO / "config" / "default.toml") == []


def test_file_env_cli_precedence(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\n[workers]\nengine = "synthetic"\nlocal = 2\n'
                 '[api]\nrequest_timeout = 5\n')
    env = {"QUICSERVE_SERVER__PORT": "9100", "QUICSERVE_WORKERS__REMOTE": "tcp://h:1, tcp://h:2",
           "QUICSERVE_SERVER__UVLOOP": "false", "QUICSERVE_LOG__LEVEL": "debug", "OTHER": "x"}
    s = load_settings(p, environ=env, overrides={"server": {"port": 9200}})
    assert s.server.port == 9200 and s.server.host == "0.0.0.0" and s.server.uvloop is False
    assert s.workers.engine == "synthetic" and s.workers.local == 2
    assert s.workers.remote == ["tcp://h:1", "tcp://h:2"]
    assert s.api.request_timeout == 5.0 and isinstance(s.api.request_timeout, float)
    assert s.log.level == "debug"
    s = load_settings(p, environ=env)
    assert s.server.port == 9100


def test_problems_are_all_reported(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('[server]\nport = "80"\nprot = 1\n[workers]\nengine = "pytorch"\n[nope]\nx = 1\n')
    problems = check_file(p)
    text = "\n".join(problems)
    assert "server.port: expected int, got str '80'" in text
    assert "server.prot: unknown key" in text
    assert "unknown section [nope]" in text
    with pytest.raises(SettingsError) as ei:
        load_settings(p, environ={})
    assert "server.prot" in str(ei.value)


def test_validation_after_types(tmp_path: Path) -> None:
    p = tmp_path / "v.toml"
    p.write_text('[server]\nport = 70000\n[workers]\nengine = "pytorch"\nremote = ["http://x"]\n'
                 '[limits]\nmax_body_bytes = 0\n')
    text = "\n".join(check_file(p))
    assert "70000" in text and "pytorch" in text and "http://x" in text and "limits.max_body_bytes" in text


def test_bad_env_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as ei:
        load_settings(environ={"QUICSERVE_SERVER__PORTT": "1"})
    assert "unknown setting server.portt" in str(ei.value)
    with pytest.raises(SettingsError) as ei:
        load_settings(environ={"QUICSERVE_SERVER__PORT": "eighty"})
    assert "server.port" in str(ei.value)
    assert "cannot read" in check_file(tmp_path / "missing.toml")[0]
    (tmp_path / "x.toml").write_text("[server\n")
    assert "not valid TOML" in check_file(tmp_path / "x.toml")[0]
    (tmp_path / "b.toml").write_text("[server]\nuvloop = 1\n")
    assert "expected bool" in check_file(tmp_path / "b.toml")[0]
