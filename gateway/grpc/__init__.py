"""gRPC and gRPC-Web for the gateway.

* ``quicserve/v1``: the service definition and its generated code (``make proto``).
* Sans-I/O cores: :mod:`.framing` (length-prefixed messages), :mod:`.web`
  (gRPC-Web bodies: binary and base64 text, trailer frame), :mod:`.compression`
  (zstd / gzip negotiation), :mod:`.status` (the one error model as gRPC
  status, ``grpc-timeout``), :mod:`.cors`.
* The service: :mod:`.backend` (the :class:`~.backend.Backend` protocol the
  pipeline binds), :mod:`.service` and :mod:`.chat` (handlers over any
  ``CallStream``), :mod:`.convert` (protobuf <-> plain types).
* Listeners: :mod:`.server` (native gRPC on grpclib, with health and
  reflection), :mod:`.web_call` and :mod:`.web_route` (gRPC-Web on the HTTP
  adapters).
"""
