"""JSON Schema (Draft 2020-12) validation of request bodies, compiled once per schema.

How it works: :func:`compile_schema` turns a schema into a validator with the
chosen engine and caches it under the SHA-256 of the schema's canonical JSON,
so the same schema attached to many routes or models compiles once.
:class:`SchemaRegistry` holds the built-in OpenAI request schemas (JSON files
in ``schemas/``, shipped as package data) per route plus the operator's extra
schemas per route or model, and :meth:`SchemaRegistry.validate` raises a 400
naming the JSON path and the keyword that failed.

Engine by measurement (tests/bench/bench_admission.py, one chat request):
``jsonschema-rs`` (Rust, compiled) is two orders of magnitude faster than
``jsonschema`` and several times faster than ``fastjsonschema`` (which only
speaks draft-07), so "auto" picks it whenever it is installed; ``jsonschema``
is the reference (differential tests) and the fallback. The valid case -- the
hot one -- is one ``is_valid`` call; errors are worked out only on failure.
Neither engine touches the network: remote ``$ref`` resolve only through a
retriever the caller passes (the test suite's ``remotes/`` folder).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ..errors import APIError

try:  # the fast engine is optional; jsonschema is the fallback
    import jsonschema_rs
    from jsonschema_rs import ValidationErrorKind as _Kind
except ImportError:  # pragma: no cover - exercised where jsonschema-rs is not installed
    pass

__all__ = ["Violation", "CompiledSchema", "compile_schema", "SchemaRegistry", "check_schema_entries",
           "available_engines", "default_engine", "builtin_schema", "builtin_validator", "BUILTIN_ROUTES", "json_param",
           "parse_schema_entry"]

Retrieve = Callable[[str], Any]

BUILTIN_ROUTES = {"/v1/chat/completions": "chat_completions.json", "/v1/completions": "completions.json"}


@dataclass(frozen=True, slots=True)
class Violation:
    """The first failure: where in the instance, which keyword, the engine's message."""

    path: tuple[str | int, ...]
    keyword: str
    message: str


class CompiledSchema(Protocol):
    engine: str
    fast: Callable[[Any], bool]  # the engine's own is_valid, bound: the hot path calls it directly

    def is_valid(self, instance: Any) -> bool: ...
    def first_error(self, instance: Any) -> Violation | None: ...


class _RustSchema:
    engine = "jsonschema-rs"
    __slots__ = ("_v", "fast")
    fast: Callable[[Any], bool]

    def __init__(self, schema: Any, retrieve: Retrieve | None) -> None:
        # validator_for honours a custom metaschema's $vocabulary; no $schema means 2020-12.
        _require_2020_12(schema)
        self._v = jsonschema_rs.validator_for(schema, retriever=retrieve, offline=retrieve is None)
        self.fast = self._v.is_valid

    def is_valid(self, instance: Any) -> bool:
        return bool(self._v.is_valid(instance))

    def first_error(self, instance: Any) -> Violation | None:
        for e in self._v.iter_errors(instance):
            path = tuple(e.instance_path)
            kw = str(e.schema_path[-1]) if e.schema_path else "false"
            kind = e.kind
            if isinstance(kind, _Kind.Required):
                path += (kind.property,)
            elif isinstance(kind, _Kind.AdditionalProperties) and kind.unexpected:
                path += (kind.unexpected[0],)
            return Violation(path, kw, str(e.message))
        return None


class _ReferenceSchema:
    engine = "jsonschema"
    __slots__ = ("_v", "fast")
    fast: Callable[[Any], bool]

    def __init__(self, schema: Any, retrieve: Retrieve | None) -> None:
        import jsonschema
        import referencing
        import referencing.jsonschema

        def _resource(uri: str) -> referencing.Resource[Any]:
            if retrieve is None:
                raise referencing.exceptions.NoSuchResource(uri)
            return referencing.Resource.from_contents(
                retrieve(uri), default_specification=referencing.jsonschema.DRAFT202012)

        _require_2020_12(schema)
        registry: referencing.Registry[Any] = referencing.Registry(retrieve=_resource)  # type: ignore[call-arg]
        self._v = jsonschema.Draft202012Validator(schema, registry=registry)
        self.fast = self._v.is_valid

    def is_valid(self, instance: Any) -> bool:
        return bool(self._v.is_valid(instance))

    def first_error(self, instance: Any) -> Violation | None:
        for e in self._v.iter_errors(instance):
            path = tuple(e.absolute_path)
            kw = str(e.validator) if e.validator is not None else "false"
            if kw in ("required", "additionalProperties"):
                m = _QUOTED.search(e.message)
                if m:
                    path += (m.group(1),)
            return Violation(path, kw, e.message)
        return None


_OTHER_DRAFTS = re.compile(r"^https?://json-schema\.org/(draft-0\d|draft/2019-09)/")


def _require_2020_12(schema: Any) -> None:
    if isinstance(schema, dict) and _OTHER_DRAFTS.match(str(schema.get("$schema", ""))):
        raise ValueError(f"schema declares {schema['$schema']!r}; admission schemas are Draft 2020-12")


_QUOTED = re.compile(r"'([^']*)'")
_ENGINES: dict[str, Callable[[Any, Retrieve | None], CompiledSchema]] = {
    "jsonschema-rs": _RustSchema, "jsonschema": _ReferenceSchema}
_MODULES = {"jsonschema-rs": "jsonschema_rs", "jsonschema": "jsonschema"}


def available_engines() -> list[str]:
    """Installed engines, fastest first."""
    import importlib.util

    return [name for name, mod in _MODULES.items() if importlib.util.find_spec(mod) is not None]


def default_engine() -> str:
    engines = available_engines()
    if not engines:
        raise RuntimeError("no JSON Schema engine installed: pip install jsonschema-rs (or jsonschema)")
    return engines[0]


_CACHE: dict[tuple[str, str], CompiledSchema] = {}


def compile_schema(schema: Any, engine: str = "auto", retrieve: Retrieve | None = None) -> CompiledSchema:
    """A validator for ``schema``; cached by (engine, SHA-256 of canonical JSON) unless ``retrieve`` is given."""
    name = default_engine() if engine == "auto" else engine
    make = _ENGINES.get(name)
    if make is None:
        raise ValueError(f"unknown schema engine {engine!r} (known: auto, {', '.join(_ENGINES)})")
    if retrieve is not None:
        return make(schema, retrieve)
    key = (name, hashlib.sha256(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)).hexdigest())
    compiled = _CACHE.get(key)
    if compiled is None:
        compiled = _CACHE[key] = make(schema, None)
    return compiled


def builtin_schema(filename: str) -> Any:
    """A schema shipped in ``gateway/admission/schemas/``."""
    return orjson.loads(importlib.resources.files(__package__).joinpath("schemas", filename).read_bytes())


def builtin_validator(route: str, engine: str = "auto") -> Callable[[Any], None]:
    """The built-in schema check of ``route``'s body: returns, or raises the 400 that names the JSON
    path and keyword. Always enforced (``gateway.api.params``), admission on or off."""
    compiled = compile_schema(builtin_schema(BUILTIN_ROUTES[route]), engine)
    fast = compiled.fast

    def check(body: Any) -> None:
        if not fast(body):
            raise _invalid(compiled, body)

    return check


def json_param(path: Sequence[str | int]) -> str | None:
    """``("messages", 0, "role")`` -> ``"messages[0].role"`` (OpenAI's ``param`` style)."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def parse_schema_entry(text: str) -> tuple[str, str, str]:
    """``"route:/v1/chat/completions=path.json"`` -> ("route", "/v1/chat/completions", "path.json")."""
    kind, sep, rest = text.partition(":")
    target, eq, path = rest.rpartition("=")
    if not sep or not eq or kind not in ("route", "model") or not target or not path:
        raise ValueError(f"{text!r}: expected 'route:<path>=<schema file>' or 'model:<name>=<schema file>'")
    return kind, target, path


def _check_schema(schema: Any, engine: str) -> str | None:
    """Why ``schema`` is not a usable 2020-12 schema, or None."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
        compile_schema(schema, engine)
    except jsonschema.SchemaError as e:
        return f"not a valid 2020-12 schema at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
    except Exception as e:  # each engine has its own compile errors (bad regex, unresolvable $ref)
        return f"does not compile: {e}"
    return None


def _load_entries(entries: Sequence[str], engine: str) -> tuple[list[tuple[str, str, CompiledSchema]], list[str]]:
    loaded, problems = [], []
    for i, text in enumerate(entries):
        try:
            kind, target, path = parse_schema_entry(text)
            with open(path, "rb") as f:
                schema = orjson.loads(f.read())
        except ValueError as e:
            problems.append(f"[{i}] {e}")
            continue
        except OSError as e:
            problems.append(f"[{i}] {text!r}: cannot read the schema: {e.strerror or e}")
            continue
        why = _check_schema(schema, engine)
        if why:
            problems.append(f"[{i}] {path}: {why}")
            continue
        loaded.append((kind, target, compile_schema(schema, engine)))
    return loaded, problems


def check_schema_entries(entries: Sequence[str], engine: str = "auto") -> list[str]:
    """Problems with ``[admission] schemas`` entries, for ``config check`` (empty: all usable)."""
    if engine != "auto" and engine not in available_engines():
        return [f"schema engine {engine!r} is not installed"]
    return _load_entries(entries, engine)[1]


class SchemaRegistry:
    """Built-in schemas per route plus the operator's per route and per model."""

    __slots__ = ("engine", "_by_route", "_by_model", "_single")

    def __init__(self, entries: Sequence[str] = (), engine: str = "auto") -> None:
        self.engine = default_engine() if engine == "auto" else engine
        self._by_route: dict[str, list[CompiledSchema]] = {
            route: [compile_schema(builtin_schema(f), self.engine)] for route, f in BUILTIN_ROUTES.items()}
        self._by_model: dict[str, list[CompiledSchema]] = {}
        loaded, problems = _load_entries(entries, self.engine)
        if problems:
            raise ValueError("admission.schemas: " + "; ".join(problems))
        for kind, target, compiled in loaded:
            (self._by_route if kind == "route" else self._by_model).setdefault(target, []).append(compiled)
        # routes with one schema and no model's to add: validate calls the engine's is_valid at once
        self._single = {} if self._by_model else {
            route: schemas[0].fast for route, schemas in self._by_route.items() if len(schemas) == 1}

    def checker(self, route: str) -> Callable[[Any], bool] | None:
        """For a pipeline that binds its route once: a yes/no check of a body at the engine's own
        cost, or None when a model may add schemas (then call :meth:`validate`). On False, call
        :meth:`validate` for the 400 that says why."""
        schemas = self._by_route.get(route, ())
        if self._by_model or len(schemas) != 1:
            return None
        return schemas[0].fast

    def validate(self, route: str, model: str | None, body: Any) -> None:
        """Raise a 400 :class:`APIError` at the first schema the body fails (route's, then model's)."""
        fast = self._single.get(route)
        if fast is not None and fast(body):
            return
        for compiled in self._by_route.get(route, ()):
            if not compiled.fast(body):
                raise _invalid(compiled, body)
        if self._by_model:
            for compiled in self._by_model.get(model or "", ()):
                if not compiled.fast(body):
                    raise _invalid(compiled, body)


# The failed keyword as the error code a client can branch on (the codes params.py's own checks use)
_CODES = {"type": "invalid_type", "required": "missing_required_parameter",
          "additionalProperties": "unknown_parameter", "unevaluatedProperties": "unknown_parameter"}


def _invalid(compiled: CompiledSchema, body: Any) -> APIError:
    v = compiled.first_error(body)
    if v is None:  # an engine disagreeing with itself; still a clear error
        v = Violation((), "unknown", "the body does not match the schema")
    param = json_param(v.path)
    return APIError(400, f"Invalid request body at '{param or '$'}': {v.message} (failed keyword: {v.keyword}).",
                    "invalid_request_error", param, _CODES.get(v.keyword, "invalid_value"))
