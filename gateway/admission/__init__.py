"""Admission: auth, rate limits, load shedding and schema validation, before any worker is asked.

The pipeline calls :meth:`Admission.admit` once per request and
:meth:`Admission.release` once at its end; :class:`SchemaRegistry` checks a
parsed body. Redis-shared limits live in :mod:`gateway.admission.redis_limits`
(imported only when ``redis_url`` is set).
"""

from .bucket import TokenBucketLimiter
from .check import AdmissionContext, Check, Grant
from .config import AdmissionSettings, parse_rule
from .gate import Admission
from .keys import KeyRecord, KeyStore, auth_warning, hash_key
from .limits import RateLimits, RateRule
from .shed import LoadShedder
from .window import SlidingWindowLimiter

__all__ = [
    "Admission", "AdmissionContext", "Check", "Grant", "AdmissionSettings", "parse_rule", "KeyRecord", "KeyStore",
    "auth_warning", "hash_key", "RateLimits", "RateRule", "LoadShedder", "SlidingWindowLimiter",
    "TokenBucketLimiter",
]
