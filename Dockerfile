# quicserve: gateway + JAX workers (CPU JAX by default; add a GPU jax wheel for accelerators).
#   docker build -t quicserve .
#   docker run --rm -p 8080:8080 -p 8443:8443 quicserve
#   docker run --rm -p 8080:8080 quicserve serve --engine synthetic --host 0.0.0.0   # no model compute
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    QUICSERVE_SERVER__HOST=0.0.0.0 \
    QUICSERVE_SERVER__STATE_DIR=/var/lib/quicserve

# g++: the worker builds its native CPU decode kernel on first use (without it, the jnp version runs)
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --system --create-home --home-dir /opt/quicserve quicserve \
 && mkdir -p /var/lib/quicserve && chown quicserve /var/lib/quicserve

WORKDIR /opt/quicserve/src
COPY setup.cfg pyproject.toml README.md ./
COPY gateway ./gateway
COPY transport ./transport
COPY inference ./inference
COPY config ./config
RUN pip install '.[worker]'

USER quicserve
EXPOSE 8080 8443
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/readyz').status != 200)"
ENTRYPOINT ["quicserve"]
CMD ["serve", "--progress", "lines"]
