"""``[limits]``: what the HTTP listeners allow a client (sizes, timeouts, streams, buffers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["LimitsSettings"]


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    h2_max_concurrent_streams: int = 256
    send_buffer_bytes: int = 0  # SO_SNDBUF per connection; 0 = the kernel's autotuning

    def _validate(self, p: list[str]) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0 and f.name != "send_buffer_bytes":
                p.append(f"limits.{f.name}: must be > 0")
        if self.send_buffer_bytes < 0:
            p.append("limits.send_buffer_bytes: must be >= 0")
