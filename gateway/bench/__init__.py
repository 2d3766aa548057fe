"""``quicserve bench``: a serving benchmark for any OpenAI-compatible server (and quicserve's gRPC).

Modules by role: ``arrivals`` (when), ``data`` (what), ``bodies`` (request bytes), ``exchange``
(what a request is on HTTP and how its response is read: OpenAI's SSE or JSON, or ``grpc_web``),
``http1``/``http2``/``http3``/``grpc_native`` (senders), ``runner`` (the open or closed loop),
``records`` and ``stats`` (what was seen, the figures), ``results``/``report`` (the JSON
file, the text), ``plots`` and ``compare`` (pictures, two results side by side), ``procs``
(several client processes), ``cli`` (the command). No JAX anywhere.
"""
