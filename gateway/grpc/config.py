"""``[grpc]``: the native gRPC port, gRPC-Web on the HTTP listeners, compression and message bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GrpcSettings"]


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    port: int = 50051  # native gRPC (h2c); -1 disables, 0 = any free port
    host: str = ""  # "" = server.host
    web: bool = True  # gRPC-Web on the HTTP listeners
    allowed_origins: list[str] = field(default_factory=list)  # gRPC-Web CORS; empty = any origin
    zstd_level: int = 3
    gzip_level: int = 6
    compress_min_bytes: int = 64  # smaller messages go uncompressed untried (a token's delta)
    max_message_bytes: int = 4 << 20

    def _validate(self, p: list[str]) -> None:
        if not (-1 <= self.port <= 65535):
            p.append(f"grpc.port: {self.port} is not a TCP port (0..65535, -1 = off)")
        if not (-7 <= self.zstd_level <= 22):
            p.append(f"grpc.zstd_level: {self.zstd_level} is not a zstd level (-7..22)")
        if not (0 <= self.gzip_level <= 9):
            p.append(f"grpc.gzip_level: {self.gzip_level} is not a gzip level (0..9)")
        if self.compress_min_bytes < 0:
            p.append("grpc.compress_min_bytes: must be >= 0")
        if self.max_message_bytes < 1024:
            p.append("grpc.max_message_bytes: must be >= 1024")
