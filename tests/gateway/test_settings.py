"""Settings: defaults, TOML, env overrides, CLI overrides, validation, config check."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from gateway import cli
from gateway.settings import Settings, SettingsError, assignments, check_file, check_mapping, load_settings
from transport.common.worker_options import WorkerOptions

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
        if f.name in ("models", "routes", "rollouts"):  # arrays of tables, none by default: the commented examples are checked below
            continue
        section = getattr(defaults, f.name)
        assert f.name in data, f"[{f.name}] missing from config/default.toml"
        for sf in dataclasses.fields(section):
            assert sf.name in data[f.name], f"{f.name}.{sf.name} missing from config/default.toml"
            assert data[f.name][sf.name] == getattr(section, sf.name), f"{f.name}.{sf.name} differs"
        assert set(data[f.name]) == {sf.name for sf in dataclasses.fields(section)}
    assert check_file(REPO / "config" / "default.toml") == []


def test_default_toml_models_and_routes_examples_are_valid() -> None:
    """The commented [[models]] and [[routes]] examples of config/default.toml, uncommented, is a valid config."""
    lines = (REPO / "config" / "default.toml").read_text().splitlines()
    example = []
    for start in (lines.index("# [[models]]"), lines.index("# [[routes]]"), lines.index("# [[rollouts]]")):
        for line in lines[start:]:
            if not line.startswith("# ") or line.startswith("# --"):
                break
            example.append(line[2:])
    settings, problems = check_mapping(tomllib.loads("\n".join(example)))
    assert problems == [] and settings is not None
    assert [m.name for m in settings.models] == ["llama-8b", "tiny-chat", "echo"]
    assert settings.models[0].worker_settings().max_batch == 64
    tree = settings.rule_tree()
    assert tree is not None and tree.leaves == ("long-context", "gold", "gold-code", "gold-rest", "ab")
    assert [(r.name, r.steps) for r in settings.rollouts] == [("llama-v2", [5.0, 20.0, 50.0, 100.0])]


def test_file_env_cli_precedence(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\n[workers]\nengine = "synthetic"\nlocal = 2\n'
                 '[api]\nrequest_timeout = 5\n')
    env = {"QUICSERVE_SERVER__PORT": "9100", "QUICSERVE_WORKERS__REMOTE": "tcp://h:1, tcp://h:2",
           "QUICSERVE_WORKERS__INSECURE": "true",  # remote workers beyond loopback with no transport auth
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


def test_worker_options_are_typed_keys_of_workers_with_env_and_flag_overrides(tmp_path: Path) -> None:
    p = tmp_path / "w.toml"
    p.write_text('[workers]\nmax_batch = 64\nkv_cache_dtype = "int8"\nprefix_cache = false\n'
                 'batch_window = "fixed:2"\n')
    env = {"QUICSERVE_WORKERS__MAX_PREFILL_TOKENS": "4096", "QUICSERVE_WORKERS__DTYPE": "bfloat16",
           "QUICSERVE_WORKERS__MAX_BATCH": "48", "QUICSERVE_WORKERS__SYNTHETIC_STEP_MS": "2"}
    w = load_settings(p, environ=env).workers
    assert (w.max_batch, w.kv_cache_dtype, w.prefix_cache, w.batch_window) == (48, "int8", False, "fixed:2")
    assert (w.max_prefill_tokens, w.dtype, w.synthetic_step_ms) == (4096, "bfloat16", 2.0)
    assert w.max_prefill_batch == WorkerOptions().max_prefill_batch == 2  # untouched: the shared default
    flags, problems = assignments("workers", ["max_batch=8", "prefix_cache=true", "batch_window=adaptive"])
    assert flags == {"max_batch": 8, "prefix_cache": True, "batch_window": "adaptive"} and problems == []
    assert load_settings(p, environ=env, overrides={"workers": flags}).workers.max_batch == 8
    _, problems = assignments("workers", ["max_btach=8", "max_batch"])
    assert problems == ["max_btach=8: unknown setting workers.max_btach",
                        "'max_batch': expected KEY=VALUE, e.g. max_batch=64"]


@pytest.mark.parametrize(("toml", "message"), [
    ("max_batch = 0", "workers.max_batch: must be >= 1, got 0"),
    ('dtype = "float13"', "workers.dtype: 'float13' is not one of 'float32', 'bfloat16'"),
    ('kv_cache_dtype = "int4"', "workers.kv_cache_dtype: 'int4' is not one of 'auto', 'int8', 'fp8'"),
    ('attention = "flash"', "workers.attention: 'flash' is not one of 'auto', 'pallas', 'native', 'xla', 'reference'"),
    ('batch_window = "soon"', "workers.batch_window: bad batch window 'soon': use 'adaptive' or 'fixed:<ms>'"),
    ('batch_window = "fixed:-1"', "workers.batch_window: bad batch window 'fixed:-1': fixed:<ms> needs a finite"),
    ("max_model_len = 9000", "workers.max_model_len: 9000 tokens do not fit the KV cache (512 blocks x 16 tokens"),
    ('cpus = "3-1"', "workers.cpus: bad CPU list '3-1' (e.g. 0-3,6)"),
    ("max_prefill_tokens = 0", "workers.max_prefill_tokens: must be >= 1, got 0"),
    ("stats_interval = 0", "workers.stats_interval: must be > 0, got 0.0"),
    ('engine = "synthetic"\nmodel = "/models/llama"', "workers.model: the synthetic engine only serves"),
    ('max_batch = "64"', "workers.max_batch: expected int, got str '64'"),
    ('extra_args = ["--max-batch", "64"]', "workers.extra_args: removed; worker options are typed keys of [workers]"),
])
def test_config_check_names_the_bad_worker_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, message: str
) -> None:
    """`quicserve config check` sees what a worker would refuse, before any worker starts."""
    p = tmp_path / "bad.toml"
    p.write_text(f"[workers]\n{toml}\n")
    assert cli.main(["config", "check", str(p)]) == 1
    assert f"{p}: {message}" in capsys.readouterr().out


def test_serve_refuses_a_bad_worker_option_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--engine", "synthetic", "--worker-option", "max_batch=0"]) == 2
    assert "workers.max_batch: must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["serve", "--worker-option", "max_btach=8"]) == 2
    assert "unknown setting workers.max_btach" in capsys.readouterr().err
