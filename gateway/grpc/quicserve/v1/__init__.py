"""``quicserve.v1``: the service definition and its generated Python code.

``quicserve_pb2.py`` / ``.pyi`` (protobuf) and ``quicserve_grpc.py`` (grpclib
stubs) are generated and committed, so the gateway needs only ``protobuf``
and ``grpclib`` at run time. Regenerate after editing ``quicserve.proto``
with ``make proto``, which runs, from the repository root::

    .venv/bin/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \\
      --plugin=protoc-gen-grpclib_python=.venv/bin/protoc-gen-grpclib_python \\
      --grpclib_python_out=. gateway/grpc/quicserve/v1/quicserve.proto

The include root is the repository root so that the generated imports read
``gateway.grpc.quicserve.v1...`` and need no editing.
"""
