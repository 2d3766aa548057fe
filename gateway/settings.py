"""Gateway settings: TOML file + ``QUICSERVE_SECTION__KEY`` env vars + CLI flags.

This module only collects: each package owns its section (``[api]`` in ``api/config.py``,
``[workers]`` in ``workers/config.py``, ``[admission]`` in ``admission/config.py``, ...) and no
gateway module imports this one but the entry points (``cli.py``, ``serve.py``;
tests/gateway/test_layout.py checks it).

How it works: the defaults live in the sections' dataclasses (and are documented,
one for one, in ``config/default.toml``). :func:`load_settings` starts from an
empty mapping, merges the TOML file, then environment overrides, then CLI
overrides (later wins), checks every key against the dataclass fields
(unknown key or wrong type -> :class:`SettingsError` listing *all* problems),
and builds frozen dataclasses. :func:`check_file` returns the problems
without raising, for ``quicserve config check``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .admission.config import AdmissionSettings
from .api.config import ApiSettings
from .grpc.config import GrpcSettings
from .http.config import LimitsSettings
from .http.quic_settings import QuicSettings
from .observability.config import LogSettings, ObservabilitySettings
from .observability.tracing import TraceSettings
from .routing.config import RoutingSettings
from .routing.rollout import ROLLOUT_KEYS, RolloutSettings
from .routing.rules import RuleTree, compile_rules
from .server_config import ServerSettings, ShutdownSettings
from .workers.config import MODEL_KEYS, PER_MODEL, ModelSettings, WorkersSettings, served_name_of
from .workers.discovery import DiscoverySettings

__all__ = [
    "Settings",
    "ServerSettings",
    "LimitsSettings",
    "WorkersSettings",
    "ApiSettings",
    "ShutdownSettings",
    "GrpcSettings",
    "LogSettings",
    "SettingsError",
    "load_settings",
    "check_file",
    "check_mapping",
    "assignments",
]

ENV_PREFIX = "QUICSERVE_"
# Keys that were dropped, with what replaces them (a plain "unknown key" would leave the reader guessing).
_REMOVED = {
    "workers.extra_args": "workers.extra_args: removed; worker options are typed keys of [workers] now "
                          "(e.g. max_batch = 64, kv_cache_dtype = \"int8\"; see config/default.toml)",
}


class SettingsError(ValueError):
    """Invalid configuration; ``problems`` lists every one found."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    workers: WorkersSettings = field(default_factory=WorkersSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    quic: QuicSettings = field(default_factory=QuicSettings)
    tracing: TraceSettings = field(default_factory=TraceSettings)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    log: LogSettings = field(default_factory=LogSettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)
    models: list[ModelSettings] = field(default_factory=list)  # [[models]]; empty: [workers] serves one model
    routes: list[dict[str, Any]] = field(default_factory=list)  # [[routes]]: the rule tree, as written
    rollouts: list[RolloutSettings] = field(default_factory=list)  # [[rollouts]]: gray releases

    def served_names(self) -> list[str]:
        return [m.name for m in self.served()]

    def model_names(self) -> dict[str, str]:
        """Every name a request may give a served model (names and aliases) -> the model's name."""
        return {n: m.name for m in self.served() for n in (m.name, *m.aliases)}

    def rule_tree(self) -> RuleTree | None:
        """[[routes]] compiled (None: none); only for settings that passed :func:`check_mapping`."""
        problems: list[str] = []
        tree = compile_rules(self.routes, self.model_names(), problems)
        if problems:
            raise SettingsError(problems)
        return tree

    def served(self) -> list[ModelSettings]:
        """Every model this gateway serves with its own workers: the [[models]] entries, or the one
        model of [workers] (``--model``, the one-model shortcut) when there are none."""
        if self.models:
            return self.models
        w = self.workers
        return [ModelSettings(served_name_of(w), [], w.engine, w.model, w.local, list(w.remote), w)]


_LISTS = ("models", "routes", "rollouts")  # arrays of tables, not sections
_SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Settings)[f.name] for f in dataclasses.fields(Settings)
                              if f.name not in _LISTS}
_WORKER_KEYS = typing.get_type_hints(WorkersSettings)
_MODEL_HINTS = typing.get_type_hints(ModelSettings)


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is list:
        return f"list of {typing.get_args(t)[0].__name__}"
    return getattr(t, "__name__", str(t))


def _coerce(value: Any, t: Any, where: str, p: list[str]) -> Any:
    """Check ``value`` against annotation ``t``; ints are accepted for floats."""
    origin = typing.get_origin(t)
    if origin is list:
        (item,) = typing.get_args(t)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            p.append(f"{where}: expected {_type_name(t)}, got {value!r}")
            return None
        return list(value)
    if isinstance(t, types.UnionType):  # scalars only (server.processes: a count or "auto")
        if isinstance(value, typing.get_args(t)) and not isinstance(value, bool):
            return value
        p.append(f"{where}: expected {' or '.join(a.__name__ for a in typing.get_args(t))}, got {value!r}")
        return None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is int and isinstance(value, bool) or not isinstance(value, t):
        p.append(f"{where}: expected {_type_name(t)}, got {type(value).__name__} {value!r}")
        return None
    return value


def _parse_env_value(raw: str, t: Any) -> Any:
    """Env values are strings; read them as the field's type would be written in TOML."""
    if t is str:
        return raw
    if typing.get_origin(t) is list:
        raw = raw.strip()
        if raw.startswith("["):
            return tomllib.loads(f"v = {raw}")["v"]
        return [s for s in (x.strip() for x in raw.split(",")) if s]
    if t is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return raw
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _typed(section: str, key: str, raw: str, where: str, problems: list[str]) -> tuple[bool, Any]:
    """``raw`` read as the type of ``section.key``; (False, None) and a problem if there is no such key."""
    cls = _SECTIONS.get(section)
    hints = typing.get_type_hints(cls) if cls else {}
    if key not in hints:
        problems.append(f"{where}: unknown setting {section}.{key}")
        return False, None
    return True, _parse_env_value(raw, hints[key])


def env_overrides(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``QUICSERVE_SERVER__PORT=9000`` -> ``{"server": {"port": 9000}}``."""
    out: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        known, value = _typed(section, key, raw, name, problems)
        if known:
            out.setdefault(section, {})[key] = value
    return out, problems


def assignments(section: str, items: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``["max_batch=64"]`` -> ``{"max_batch": 64}`` for ``section``, values read as its env vars are."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq:
            problems.append(f"{item!r}: expected KEY=VALUE, e.g. max_batch=64")
            continue
        known, value = _typed(section, key.strip(), raw, item, problems)
        if known:
            out[key.strip()] = value
    return out, problems


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win, key by key within each section."""
    out: dict[str, Any] = {}
    for layer in layers:
        for section, values in layer.items():
            if isinstance(values, Mapping) and isinstance(out.get(section), dict):
                out[section].update(values)
            elif isinstance(values, Mapping):
                out[section] = dict(values)
            else:
                out[section] = values
    return out


def check_mapping(data: Mapping[str, Any]) -> tuple[Settings | None, list[str]]:
    """Build Settings from a merged mapping; return (settings or None, problems)."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for section, values in data.items():
        if section in _LISTS:
            continue
        cls = _SECTIONS.get(section)
        if cls is None:
            problems.append(f"unknown section [{section}] (known: {', '.join(_SECTIONS)})")
            continue
        if not isinstance(values, Mapping):
            problems.append(f"[{section}]: expected a table, got {values!r}")
            continue
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in hints:
                problems.append(_REMOVED.get(f"{section}.{key}")
                                or f"{section}.{key}: unknown key (known: {', '.join(hints)})")
                continue
            v = _coerce(value, hints[key], f"{section}.{key}", problems)
            if v is not None:
                kwargs[key] = v
        sections[section] = cls(**kwargs)
    if problems:
        return None, problems
    settings = Settings(**sections)
    models = _models(data.get("models", []), data.get("workers", {}), settings.workers, problems)
    if problems:
        return None, problems
    routes = data.get("routes", [])
    settings = dataclasses.replace(settings, models=models, routes=routes if isinstance(routes, list) else [])
    compile_rules(routes, settings.model_names(), problems)
    settings = dataclasses.replace(settings, rollouts=_rollouts(data.get("rollouts", []), settings, problems))
    for section in _SECTIONS:
        getattr(settings, section)._validate(problems)
    for i, m in enumerate(models):
        problems += [f"models[{i}] ({m.name}): {p.removeprefix('workers.')}" for p in _validated(m.worker_settings())]
    names = {m.name for m in models}
    for i, m in enumerate(models):
        if m.fallback and (m.fallback not in names or m.fallback == m.name):
            problems.append(f"models[{i}].fallback: {m.fallback!r} is not another served model")
    if not any(m.local or m.remote or m.worker_settings().elastic for m in settings.served()) and \
            not settings.discovery.worker_dns:  # (an elastic pool may start at zero)
        problems.append("workers: no local workers, no remote workers and no discovery.worker_dns: nothing would "
                        "serve requests")
    return (None, problems) if problems else (settings, [])


def _rollouts(raw: Any, settings: Settings, p: list[str]) -> list[RolloutSettings]:
    """``[[rollouts]]``: typed, each checked against the served models; problems by ``rollouts[i].key``."""
    if not isinstance(raw, list) or not all(isinstance(e, Mapping) for e in raw):
        p.append(f"rollouts: expected [[rollouts]] tables, got {raw!r}")
        return []
    hints, models, out, stables = typing.get_type_hints(RolloutSettings), set(settings.served_names()), [], set()
    for i, entry in enumerate(raw):
        where = f"rollouts[{i}]"
        kwargs: dict[str, Any] = {}
        for key, value in entry.items():
            if key == "steps" and isinstance(value, list):  # whole percentages are floats too
                value = [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
            if key not in ROLLOUT_KEYS:
                p.append(f"{where}.{key}: unknown key (known: {', '.join(ROLLOUT_KEYS)})")
            elif (v := _coerce(value, hints[key], f"{where}.{key}", p)) is not None:
                kwargs[key] = v
        missing = [k for k in ("name", "stable", "candidate") if k not in kwargs]
        if missing:
            p.append(f"{where}: needs {', '.join(missing)}")
            continue
        ro = RolloutSettings(**kwargs)
        p += [f"{where}.{q}" for q in ro.problems(models)]
        if ro.stable in stables:
            p.append(f"{where}.stable: {ro.stable!r} has another rollout already")
        stables.add(ro.stable)
        out.append(ro)
    return out


def _validated(ws: WorkersSettings) -> list[str]:
    p: list[str] = []
    ws._validate(p)
    return p


def _models(raw: Any, workers_raw: Any, workers: WorkersSettings, p: list[str]) -> list[ModelSettings]:
    """``[[models]]`` entries, each over ``[workers]`` (``workers``); problems by ``models[i].key``."""
    if not isinstance(raw, list) or not all(isinstance(e, Mapping) for e in raw):
        p.append(f"models: expected [[models]] tables, got {raw!r}")
        return []
    if raw and isinstance(workers_raw, Mapping):
        for key in PER_MODEL:
            if key in workers_raw:
                p.append(f"workers.{key}: set per model in [[models]] (name, model, local, remote) when there are any")
    out: list[ModelSettings] = []
    names: dict[str, str] = {}
    for i, entry in enumerate(raw):
        where = f"models[{i}]"
        kwargs: dict[str, Any] = {}
        for key, value in entry.items():
            if key not in MODEL_KEYS:
                p.append(f"{where}.{key}: unknown key (known: {', '.join(MODEL_KEYS)})")
            elif key == "workers":
                kwargs[key] = _model_workers(value, workers, f"{where}.workers", p)
            elif (v := _coerce(value, _MODEL_HINTS[key], f"{where}.{key}", p)) is not None:
                kwargs[key] = v
        name = kwargs.get("name")
        if not isinstance(name, str) or not name.strip() or any(c.isspace() or c == "/" for c in name):
            p.append(f"{where}.name: a model needs a name without spaces or '/', got {name!r}")
            continue
        if kwargs.get("local", 1) < 0:
            p.append(f"{where}.local: must be >= 0")
        for n in (name, *kwargs.get("aliases", [])):
            if n in names:
                p.append(f"{where}: {n!r} already names {names[n]!r}")
            names[n] = name
        kwargs.setdefault("workers", workers)
        out.append(ModelSettings(**kwargs))
    return out


def _model_workers(value: Any, workers: WorkersSettings, where: str, p: list[str]) -> WorkersSettings:
    if not isinstance(value, Mapping):
        p.append(f"{where}: expected a table of [workers] options, got {value!r}")
        return workers
    kwargs: dict[str, Any] = {}
    for key, v in value.items():
        if key in PER_MODEL or key not in _WORKER_KEYS:
            why = "set it on the model itself" if key in PER_MODEL else "unknown [workers] option"
            p.append(f"{where}.{key}: {why}")
        elif (c := _coerce(v, _WORKER_KEYS[key], f"{where}.{key}", p)) is not None:
            kwargs[key] = c
    return dataclasses.replace(workers, **kwargs)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise SettingsError([f"{path}: cannot read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError([f"{path}: not valid TOML: {e}"]) from None


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """File, then env, then ``overrides`` (CLI flags). Raises SettingsError."""
    file_data = read_toml(path) if path else {}
    env_data, problems = env_overrides(os.environ if environ is None else environ)
    settings, more = check_mapping(merge(file_data, env_data, overrides or {}))
    problems += more
    if problems or settings is None:
        raise SettingsError(problems)
    return settings


def check_file(path: str | os.PathLike[str]) -> list[str]:
    """Every problem with a config file (no env, no flags); empty if it is fine."""
    try:
        data = read_toml(path)
    except SettingsError as e:
        return e.problems
    return check_mapping(data)[1]


def state_dir(settings: Settings) -> Path:
    return Path(os.path.expanduser(settings.server.state_dir))
