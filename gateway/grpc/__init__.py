"""gRPC and gRPC-Web for the gateway.

``quicserve/v1`` holds the service definition and its generated code;
:mod:`.framing`, :mod:`.web` and :mod:`.compression` are sans-I/O cores for
gRPC-Web bodies; :mod:`.status` maps the gateway's one error model to gRPC
status codes; :mod:`.service` is the grpclib service, written against the
small :class:`~gateway.grpc.backend.Backend` protocol.
"""
