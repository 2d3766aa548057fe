"""gRPC and gRPC-Web for the gateway. File names say which side a module serves: ``native_*``
the gRPC port, ``grpc_web*`` gRPC-Web on the HTTP listeners, the rest both.

* ``quicserve/v1``: the service definition and its generated code (``make proto``).
* Sans-I/O cores: :mod:`.framing` (length-prefixed messages), :mod:`.compression`
  (zstd / gzip negotiation), :mod:`.status` (the one error model as gRPC
  status, ``grpc-timeout``), :mod:`.grpc_web` (gRPC-Web bodies: binary and base64
  text, trailer frame; its request reader serves native calls too), :mod:`.native`
  (native calls: headers, trailers, encodings), :mod:`.cors` (gRPC-Web in browsers).
* The service: :mod:`.backend` (the :class:`~.backend.Backend` protocol the service
  is written against), :mod:`.service` and :mod:`.chat` (handlers over any
  ``CallStream``), :mod:`.convert` (protobuf <-> plain types), and
  :mod:`.pipeline_backend` (the ``Backend`` bound to the request pipeline).
* The call core both run on: :mod:`.call_core` (handler lookup, ``grpc-timeout``,
  one status per call).
* Native gRPC: :mod:`.native_route` (the route on our HTTP/2 adapter),
  :mod:`.native_generate` with :mod:`.native_frame_writer` (``Generate`` on the
  pipeline directly), :mod:`.native_server` (the gRPC port, with health and reflection).
* gRPC-Web: :mod:`.grpc_web_route` (the route on the HTTP adapters).
* :mod:`.mount`: both, started for the app.
"""
