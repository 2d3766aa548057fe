"""Building the admission stage from ``[admission]`` for ``quicserve serve``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import AdmissionSettings
from .gate import Admission
from .keys import auth_warning
from .limits import local_limiter
from .schema import SchemaRegistry
from .stage import AdmissionStageAdapter

if TYPE_CHECKING:
    from .redis_limits import RedisLeases

__all__ = ["AdmissionParts", "build_admission"]

log = logging.getLogger("quicserve.admission")


@dataclass(slots=True)
class AdmissionParts:
    stage: AdmissionStageAdapter | None  # None: admission off ([admission] enabled = false)
    schemas: SchemaRegistry | None  # None: the built-in schemas only (params.py checks them itself)
    leases: RedisLeases | None  # run() as a task while serving; close() at shutdown
    warning: str | None  # say it loudly at startup


def build_admission(s: AdmissionSettings, host: str) -> AdmissionParts:
    if not s.enabled:
        return AdmissionParts(None, None, None, auth_warning(host, False))
    leases = None
    if s.redis_url:
        from .redis_limits import RedisLeases  # the redis package only where limits are shared

        leases = RedisLeases.from_settings(s)
    admission = Admission.from_settings(s, make=leases.make if leases is not None else local_limiter)
    stage = AdmissionStageAdapter(admission)  # load shedding is always on (queue_limit >= 1)
    return AdmissionParts(stage, SchemaRegistry(s.schemas, s.schema_engine), leases,
                          auth_warning(host, bool(s.keys or s.keys_file) and s.auth != "off"))
