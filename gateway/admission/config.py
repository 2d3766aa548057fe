"""``[admission]`` settings: one frozen dataclass, validated like gateway/settings.py's sections.

Rules and schema attachments are short strings so the section stays within
what the settings loader reads (scalars and lists of strings):

* ``limits = ["key requests 600/1m", "client tokens 100000/1m bucket burst=20000",
  "model=tiny requests 50/1s slices=50"]`` -- ``<scope>[=<value>] <unit> <limit>/<window>``
  then options; scope is key | client | model | route, unit requests | tokens,
  window a number with s, m or h.
* ``schemas = ["route:/v1/chat/completions=/etc/quicserve/chat.json", "model:tiny=tiny.json"]``
  -- a JSON Schema file checked after the built-in one for that route or model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .keys import DEFAULT_CHECK_INTERVAL
from .lease import DEFAULT_LEASE_SHARE, DEFAULT_TTL
from .limits import DEFAULT_MAX_KEYS, RateRule
from .schema import check_schema_entries
from .shed import DEFAULT_CLASSES, DEFAULT_HEADROOM, DEFAULT_PRIORITY, DEFAULT_QUEUE_LIMIT

__all__ = ["AdmissionSettings", "parse_rule"]

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _number(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    return v


def parse_rule(text: str) -> RateRule:
    """``"client tokens 100000/1m bucket burst=20000"`` -> :class:`RateRule` (ValueError says why)."""
    parts = text.split()
    if len(parts) < 3:
        raise ValueError(f"{text!r}: expected '<scope>[=<value>] <unit> <limit>/<window>' and options")
    scope, _, match = parts[0].partition("=")
    limit_s, sep, window_s = parts[2].partition("/")
    if not sep:
        raise ValueError(f"{text!r}: expected <limit>/<window>, e.g. 600/1m")
    scale = _UNITS_S.get(window_s[-1:], None)
    window = _number(window_s[:-1] if scale else window_s, "window") * (scale or 1.0)
    kwargs: dict[str, float | int | str] = {}
    for opt in parts[3:]:
        name, eq, val = opt.partition("=")
        if not eq and name in ("window", "bucket"):
            kwargs["algorithm"] = name
        elif name == "slices" and eq:
            kwargs["slices"] = int(_number(val, "slices"))
        elif name == "burst" and eq:
            kwargs["burst"] = _number(val, "burst")
        else:
            raise ValueError(f"{text!r}: unknown option {opt!r} (window, bucket, slices=N, burst=N)")
    return RateRule(scope, parts[1], _number(limit_s, "limit"), window, match=match or "*",
                    **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    enabled: bool = True  # false: no stage, no extra schemas (baselines); the built-in schemas stay on
    auth: str = "auto"  # "auto" (on when any key is configured) | "on" | "off"
    keys: list[str] = field(default_factory=list)  # "id:sha256hex" (all models, default policy)
    keys_file: str = ""  # TOML [[keys]] or JSON lines; reloaded on SIGHUP and when its mtime changes
    keys_check_interval: float = DEFAULT_CHECK_INTERVAL  # seconds between mtime checks
    limits: list[str] = field(default_factory=list)  # rate rules, see the module docstring
    limiter_max_keys: int = DEFAULT_MAX_KEYS  # limiters kept per rule (idle ones evicted first)
    redis_url: str = ""  # "redis://host:6379/0" shares the limits across gateways; "" = local only
    redis_fail: str = "open"  # Redis unreachable: "open" (admit, counted) | "closed" (503)
    redis_lease_ttl: float = DEFAULT_TTL  # seconds a leased quota may be spent
    redis_lease_share: float = DEFAULT_LEASE_SHARE  # most of a limit one lease takes at once
    queue_limit: int = DEFAULT_QUEUE_LIMIT  # outstanding requests per model pool
    priority_classes: int = DEFAULT_CLASSES  # 0 (lowest, shed first) .. classes-1
    priority_headroom: float = DEFAULT_HEADROOM  # share of queue_limit each higher class keeps for itself
    default_priority: int = DEFAULT_PRIORITY  # requests without a key (auth off)
    key_max_concurrency: int = 0  # per key when its record sets none; 0 = no cap
    schemas: list[str] = field(default_factory=list)  # extra schemas per route/model, see above
    schema_engine: str = "auto"  # "auto" (fastest installed) | "jsonschema-rs" | "jsonschema"

    def _validate(self, p: list[str]) -> None:
        if self.auth not in ("auto", "on", "off"):
            p.append(f"admission.auth: {self.auth!r} is not one of auto, on, off")
        if self.auth == "on" and not self.keys and not self.keys_file:
            p.append("admission.auth: 'on' but no keys and no keys_file")
        for i, text in enumerate(self.limits):
            try:
                parse_rule(text)
            except ValueError as e:
                p.append(f"admission.limits[{i}]: {e}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            p.append(f"admission.redis_url: {self.redis_url!r} is not a redis://, rediss:// or unix:// URL")
        if self.redis_fail not in ("open", "closed"):
            p.append(f"admission.redis_fail: {self.redis_fail!r} is not one of open, closed")
        if not 0.0 < self.redis_lease_share <= 1.0:
            p.append("admission.redis_lease_share: must be in (0, 1]")
        for name in ("keys_check_interval", "redis_lease_ttl"):
            if getattr(self, name) <= 0:
                p.append(f"admission.{name}: must be > 0")
        for name in ("limiter_max_keys", "queue_limit", "priority_classes"):
            if getattr(self, name) < 1:
                p.append(f"admission.{name}: must be >= 1")
        if not 0.0 <= self.priority_headroom * (self.priority_classes - 1) < 1.0:
            p.append("admission.priority_headroom: the higher classes' shares leave nothing to the lowest")
        if not 0 <= self.default_priority < max(self.priority_classes, 1):
            p.append("admission.default_priority: must be a class in 0 .. priority_classes-1")
        if self.key_max_concurrency < 0:
            p.append("admission.key_max_concurrency: must be >= 0")
        if self.schema_engine not in ("auto", "jsonschema-rs", "jsonschema"):
            p.append(f"admission.schema_engine: {self.schema_engine!r} is not one of auto, jsonschema-rs, jsonschema")
        p.extend(f"admission.schemas: {msg}" for msg in check_schema_entries(self.schemas, self.schema_engine))
