"""gRPC and gRPC-Web for the gateway.

* ``quicserve/v1``: the service definition and its generated code (``make proto``).
* Sans-I/O cores: :mod:`.framing` (length-prefixed messages), :mod:`.web`
  (gRPC-Web bodies: binary and base64 text, trailer frame), :mod:`.compression`
  (zstd / gzip negotiation), :mod:`.status` (the one error model as gRPC
  status, ``grpc-timeout``), :mod:`.cors`.
* The service: :mod:`.backend` (the :class:`~.backend.Backend` protocol the
  pipeline binds), :mod:`.service` and :mod:`.chat` (handlers over any
  ``CallStream``), :mod:`.convert` (protobuf <-> plain types).
* Native gRPC: :mod:`.native` (sans-I/O: headers, trailers, encodings),
  :mod:`.native_call` (the route on our HTTP/2 adapter), :mod:`.server` (the
  gRPC port, with health and reflection).
* gRPC-Web: :mod:`.web_call` (the call core both run on) and :mod:`.web_route`
  (the route on the HTTP adapters).
"""
