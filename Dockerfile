# quicserve: gateway + JAX workers (CPU JAX by default; add a GPU jax wheel for accelerators).
#   docker build -t quicserve .
#   docker run --rm -p 8080:8080 -p 8443:8443 -p 8443:8443/udp quicserve
#   docker run --rm -p 8080:8080 quicserve serve --engine synthetic   # no model compute
# podman takes the same commands (podman build --format docker keeps the HEALTHCHECK).
# Build arguments: BASE (any Debian-like image with python3 >= 3.11 and python3-venv),
# EXTRAS (pip extras, comma-separated: worker = JAX, tracing = OpenTelemetry; "" for a
# gateway-only image), RUNTIME_PKGS (apt packages of the final image; g++ lets workers build
# their native CPU decode kernel, without it the jnp version runs).
# tests/integration/test_container.py builds and runs this file.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG EXTRAS=worker,tracing
# Behind a private index or a TLS-inspecting proxy: --build-arg PIP_INDEX_URL=... and
# PIP_CERT=<a CA bundle mounted into the build with -v> (unset: pip's own index and CAs).
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_CERT
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/quicserve/venv
ENV PATH=/opt/quicserve/venv/bin:$PATH
WORKDIR /src
COPY setup.cfg ./
# Dependencies first, from setup.cfg alone: this layer is reused until setup.cfg changes.
RUN python3 -c "import configparser, sys; c = configparser.ConfigParser(); c.read('setup.cfg'); \
extras = [e for e in sys.argv[1].split(',') if e]; \
print('\n'.join(c['options']['install_requires'].split() + [r for e in extras for r in c['options.extras_require'][e].split()]))" \
    "${EXTRAS}" > /tmp/requirements.txt \
 && pip install -q -r /tmp/requirements.txt
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY transport ./transport
COPY inference ./inference
COPY config ./config
RUN pip install -q --no-deps . && quicserve config check config/default.toml

FROM ${BASE}
ARG RUNTIME_PKGS=g++
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/quicserve/venv/bin:$PATH \
    QUICSERVE_SERVER__HOST=0.0.0.0 \
    QUICSERVE_SERVER__STATE_DIR=/var/lib/quicserve \
    QUICSERVE_CACHE_DIR=/var/lib/quicserve/cache
RUN if [ -n "${RUNTIME_PKGS}" ]; then apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${RUNTIME_PKGS} \
      && rm -rf /var/lib/apt/lists/*; fi \
 && useradd --uid 10001 --user-group --home-dir /var/lib/quicserve --no-create-home --shell /usr/sbin/nologin quicserve \
 && mkdir -p /var/lib/quicserve/cache && chown -R quicserve:quicserve /var/lib/quicserve
COPY --from=build /opt/quicserve/venv /opt/quicserve/venv
COPY config/default.toml /etc/quicserve/quicserve.toml

USER quicserve
WORKDIR /var/lib/quicserve
EXPOSE 8080 8443 8443/udp
# SIGTERM drains (shutdown.drain_timeout, default 30 s): give `docker stop -t` at least 45.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/readyz').status != 200)"
ENTRYPOINT ["quicserve"]
CMD ["serve", "--config", "/etc/quicserve/quicserve.toml", "--progress", "lines"]
