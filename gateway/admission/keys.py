"""API keys: stored as SHA-256 digests, looked up by digest, never kept or logged in clear.

How it works: a key file (TOML ``[[keys]]`` tables, or JSON lines) and/or the
config's ``id:sha256`` pairs give, per key, a non-secret id, the digest, the
models it may use, its priority, its concurrency cap and its own rate rules.
:meth:`KeyStore.authenticate` hashes the presented bearer token and finds the
record by digest; the final equality is ``hmac.compare_digest`` on the
digests. (The dict lookup itself is not constant time, but what it could leak
is the digest of an attacker-chosen string, which says nothing about any
stored key: finding a preimage is the whole point of SHA-256.) Revoking a key
is deleting its line; :meth:`KeyStore.reload` (SIGHUP) or
:meth:`KeyStore.maybe_reload` (mtime, clock passed in) picks the change up
without a restart, and a broken file keeps the previous keys and reports why.

Hashing costs a third of a microsecond per request, so the digests of valid
keys are cached by the Authorization value that carried them (a bounded dict
of short values, cleared when full and on every reload; invalid keys are
hashed every time, so garbage can neither fill nor flush it). Those values
thus stay in this process's memory a while, as the request buffers that
carried them do; they are never logged, written or exposed, and the store
itself still holds digests only. The cache maps a value to its digest and
nothing else: whether the key is valid is still decided by the current
records and ``compare_digest``, so revocation needs no purge.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import APIError
from .limits import RateRule

__all__ = ["KeyRecord", "KeyStore", "KeyFileError", "hash_key", "parse_key_entries", "auth_warning",
           "bearer_token", "DEFAULT_CHECK_INTERVAL"]

DEFAULT_CHECK_INTERVAL = 2.0  # seconds between key-file mtime checks

log = logging.getLogger("quicserve.admission")


class KeyFileError(ValueError):
    """A key file that cannot be used; ``problems`` lists every reason (never a key)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid key file:\n  " + "\n  ".join(problems))
        self.problems = problems


def hash_key(key: str | bytes) -> str:
    """The hex SHA-256 an operator puts in the key file for ``key``."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key's policy. ``digest`` is left out of repr so records can be logged."""

    id: str
    digest: bytes = field(repr=False)
    models: frozenset[str] = frozenset()  # empty: every model
    priority: int = 0  # higher is shed later
    max_concurrency: int = 0  # 0: no per-key cap
    limits: tuple[RateRule, ...] = ()

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


_RULE_KEYS = {"unit", "limit", "window", "algorithm", "slices", "burst"}
_ENTRY_KEYS = {"id", "sha256", "models", "priority", "max_concurrency", "limits"}


def _entry(raw: Any, where: str, problems: list[str]) -> KeyRecord | None:
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected a table/object, got {type(raw).__name__}")
        return None
    bad = sorted(set(raw) - _ENTRY_KEYS)
    if bad:
        problems.append(f"{where}: unknown field(s) {', '.join(bad)} (known: {', '.join(sorted(_ENTRY_KEYS))})")
    kid, digest = raw.get("id"), raw.get("sha256")
    if not isinstance(kid, str) or not kid:
        problems.append(f"{where}: 'id' must be a non-empty string")
        return None
    where = f"{where} (id {kid!r})"
    try:
        d = bytes.fromhex(digest) if isinstance(digest, str) else b""
    except ValueError:
        d = b""
    if len(d) != 32:
        problems.append(f"{where}: 'sha256' must be 64 hex digits (the SHA-256 of the key, not the key)")
        return None
    models = raw.get("models", [])
    prio, conc = raw.get("priority", 0), raw.get("max_concurrency", 0)
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        problems.append(f"{where}: 'models' must be a list of model names")
        return None
    if type(prio) is not int or type(conc) is not int or conc < 0:
        problems.append(f"{where}: 'priority' must be an integer and 'max_concurrency' an integer >= 0")
        return None
    rules = []
    for i, r in enumerate(raw.get("limits", [])):
        if not isinstance(r, Mapping) or set(r) - _RULE_KEYS:
            problems.append(f"{where}: limits[{i}]: expected a table with {', '.join(sorted(_RULE_KEYS))}")
            continue
        try:
            rules.append(RateRule(scope="key", **r))
        except (TypeError, ValueError) as e:
            problems.append(f"{where}: limits[{i}]: {e}")
    return KeyRecord(kid, d, frozenset(models), prio, conc, tuple(rules))


def parse_key_entries(entries: Iterable[Any], source: str) -> tuple[list[KeyRecord], list[str]]:
    """Records and problems from raw entries (ids and digests unique)."""
    problems: list[str] = []
    records = [r for i, e in enumerate(entries) if (r := _entry(e, f"{source}: entry {i + 1}", problems))]
    seen_id: set[str] = set()
    seen_digest: set[bytes] = set()
    for r in records:
        if r.id in seen_id:
            problems.append(f"{source}: id {r.id!r} appears twice")
        if r.digest in seen_digest:
            problems.append(f"{source}: id {r.id!r} has the same sha256 as another key")
        seen_id.add(r.id)
        seen_digest.add(r.digest)
    return records, problems


def _read_file(path: str) -> tuple[list[KeyRecord], list[str]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return [], [f"{path}: cannot read: {e.strerror or e}"]
    if path.endswith((".jsonl", ".json", ".ndjson")):
        entries, problems = [], []
        for n, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(orjson.loads(line))
                except orjson.JSONDecodeError as e:
                    problems.append(f"{path}:{n}: not valid JSON ({e.msg})")
        records, more = parse_key_entries(entries, path)
        return records, problems + more
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return [], [f"{path}: not valid TOML: {e}"]
    return parse_key_entries(doc.get("keys", []), path)


def _inline(pairs: Iterable[str]) -> tuple[list[KeyRecord], list[str]]:
    entries, problems = [], []
    for i, p in enumerate(pairs):
        kid, sep, digest = p.partition(":")
        if not sep:
            problems.append(f"admission.keys[{i}]: expected 'id:sha256hex'")
            continue
        entries.append({"id": kid, "sha256": digest})
    records, more = parse_key_entries(entries, "admission.keys")
    return records, problems + more


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


_MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
_INVALID = "Incorrect API key provided."
_sha256 = hashlib.sha256
_SEEN_MAX = 4096  # Authorization values of valid keys remembered (cleared when full and on every reload)
_CACHED_MAX_LEN = 512  # longer Authorization values are hashed every time (the cache's memory stays small)
_compare = hmac.compare_digest


class KeyStore:
    """Key records by digest; reloadable from ``path`` without a restart."""

    __slots__ = ("path", "_inline", "_by_digest", "_mtime", "_checked", "check_interval", "reloads",
                 "reload_failures", "next_check", "seen")

    def __init__(self, inline: Iterable[str] = (), path: str = "",
                 check_interval: float = DEFAULT_CHECK_INTERVAL) -> None:
        self.path = path
        self._inline = tuple(inline)
        self.check_interval = check_interval
        self._by_digest: dict[bytes, KeyRecord] = {}
        # Authorization value as sent -> its record, for valid keys only (bounded): a key seen before is
        # one dict lookup, no parsing or hashing. Cleared on every reload, so a revoked key is not in it.
        # Read directly by the admission hot path (``seen.get(value) or authenticate(value)``).
        self.seen: dict[bytes, KeyRecord] = {}
        self._mtime: float | None = None
        self._checked = -float("inf")
        self.next_check = -float("inf") if path else float("inf")  # when maybe_reload has work again
        self.reloads = self.reload_failures = 0
        problems = self.reload()
        if problems:
            raise KeyFileError(problems)

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"KeyStore(path={self.path!r}, keys={len(self._by_digest)})"

    def reload(self) -> list[str]:
        """Re-read config keys and the key file; on any problem keep the current keys and say why."""
        records, problems = _inline(self._inline)
        if self.path:
            try:
                self._mtime = os.stat(self.path).st_mtime
            except OSError:
                self._mtime = None
            more, file_problems = _read_file(self.path)
            records += more
            problems += file_problems
        if not problems:
            _, problems = parse_key_entries(
                ({"id": r.id, "sha256": r.digest.hex()} for r in records), "keys")  # ids unique across sources
        if problems:
            self.reload_failures += 1
            # problems name files, lines and ids, never a key or its digest
            log.warning("API keys not reloaded, keeping the %d current ones: %s", len(self._by_digest),
                        "; ".join(problems))
            return problems
        self._by_digest = {r.digest: r for r in records}
        self.seen.clear()
        self.reloads += 1
        log.info("API keys loaded: %d (ids: %s)", len(records), ", ".join(sorted(r.id for r in records)))
        return []

    def maybe_reload(self, now: float) -> list[str]:
        """Reload when the key file's mtime changed; stats the file at most every ``check_interval``."""
        if not self.path or now - self._checked < self.check_interval:
            return []
        self._checked = now
        self.next_check = now + self.check_interval
        try:
            mtime: float | None = os.stat(self.path).st_mtime
        except OSError:
            mtime = None
        return self.reload() if mtime != self._mtime else []

    def authenticate(self, authorization: bytes | None) -> KeyRecord:
        """The record for the bearer key in ``authorization``, or a 401 in OpenAI's shape."""
        if authorization is None:
            raise APIError(401, _MISSING, "invalid_request_error", None, None)
        rec = self.seen.get(authorization)
        if rec is not None:
            return rec
        token = bearer_token(authorization)
        if token is None:
            raise APIError(401, _MISSING, "invalid_request_error", None, None)
        digest = _sha256(token).digest()
        rec = self._by_digest.get(digest)
        if rec is None or not _compare(rec.digest, digest):
            raise APIError(401, _INVALID, "invalid_request_error", None, "invalid_api_key")
        if len(authorization) <= _CACHED_MAX_LEN:  # valid keys only, short headers only:
            if len(self.seen) >= _SEEN_MAX:  # garbage can neither fill the cache nor flush it
                self.seen.clear()
            self.seen[authorization] = rec
        return rec


    def identify(self, authorization: bytes | None) -> tuple[str | None, str | None]:
        """(key id, its tier: the priority class) of a valid key, else (None, None): what routing
        rules read (admission itself still authenticates, and refuses a bad key)."""
        try:
            rec = self.authenticate(authorization)
        except APIError:
            return None, None
        return rec.id, str(rec.priority)


def auth_warning(host: str, keys_configured: bool) -> str | None:
    """A loud startup warning when the gateway listens beyond loopback with no API keys."""
    if keys_configured:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"WARNING: serving on {host} with NO API KEYS: anyone who can reach this address can use "
            "every model. Set [admission] keys_file (or keys) to require 'Authorization: Bearer' keys.")
