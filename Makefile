# The two commands: `make run` serves the built-in tiny model; `make test` runs
# the whole suite. Both set up everything they need, idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP_RUN  := $(VENV)/.stamp-run
STAMP_TEST := $(VENV)/.stamp-test
SYSDEPS_STAMP := $(VENV)/.stamp-sysdeps
LIBTPU_DIR := $(VENV)/libtpu
LIBTPU_STAMP := $(VENV)/.stamp-libtpu
ARGS ?=

.PHONY: run test venv sysdeps lint bench clean proto

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP_RUN): $(VENV)/bin/python setup.cfg pyproject.toml
	$(PIP) install -q -e '.[worker]'
	touch $@

$(STAMP_TEST): $(STAMP_RUN)
	$(PIP) install -q -e '.[worker,test]'
	touch $@

# The libtpu wheel that matches the installed jax, into its own folder (not the venv's
# site-packages: no test process but the Mosaic compile check loads it). It lets
# tests/inference/kernels/mosaic_compile.py compile the TPU kernels for
# compile-only TPUs on this host; nothing here runs on a TPU.
$(LIBTPU_STAMP): $(STAMP_TEST)
	req=$$($(PY) -c "import importlib.metadata as m; print(next(r.split(';')[0].replace(' ', '') for r in m.requires('jax') if r.startswith('libtpu')))"); \
	$(PIP) install -q --no-deps --upgrade --target $(LIBTPU_DIR) "$$req"
	touch $@

# System packages: curl (with HTTP/2) for the curl tests; Debian's python3-pyverbs
# so the RDMA probe/fallback path runs against the real bindings (tests that need
# an RDMA device skip where none exists); g++ to build the native CPU decode
# kernel (inference/kernels/cpu_ffi.py) the worker compiles on first use; Node for the
# gRPC-Web client from npm that tests/integration/test_grpc_web_http.py runs; redis-server for the
# admission tests of Redis-shared rate limits (they start their own on a free loopback port);
# chromium, an independent HTTP/3 client (tests/integration/test_h3_chromium.py); systemd for
# systemd-analyze, which checks config/quicserve.service; podman, runc and debootstrap to
# build and run the Dockerfile's image (tests/integration/test_container.py).
APT_PKGS := curl python3-pyverbs g++ nodejs redis-server chromium systemd podman runc debootstrap prometheus
$(SYSDEPS_STAMP): $(VENV)/bin/python Makefile
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	touch $@

# The npm packages of tests/grpc_web, exactly as package-lock.json pins them. Debian's
# nodejs comes without npm (NodeSource's bundles it), hence the fallback.
NODE_STAMP := tests/grpc_web/node_modules/.stamp
$(NODE_STAMP): tests/grpc_web/package.json tests/grpc_web/package-lock.json $(SYSDEPS_STAMP)
	command -v npm >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm)
	cd tests/grpc_web && npm ci --no-audit --no-fund
	touch $@

venv: $(STAMP_RUN)

sysdeps: $(SYSDEPS_STAMP)

run: $(STAMP_RUN) $(SYSDEPS_STAMP)
	$(VENV)/bin/quicserve serve $(ARGS)

test: $(STAMP_TEST) $(SYSDEPS_STAMP) $(LIBTPU_STAMP) $(NODE_STAMP)
	$(VENV)/bin/ruff check gateway transport inference tests
	$(VENV)/bin/mypy --strict gateway transport
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 tests

lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check gateway transport inference tests
	$(VENV)/bin/mypy --strict gateway transport

bench: $(STAMP_TEST)
	for f in tests/bench/bench_*.py tests/bench/gpu_kernels.py; do m=$$(basename $$f .py); echo "== $$m"; $(PY) -m tests.bench.$$m || exit 1; done

# Regenerates the committed protobuf + grpclib code from the .proto (grpcio-tools is in
# the test extra; the generated code needs only protobuf and grpclib at run time).
PROTO := gateway/grpc/quicserve/v1/quicserve.proto
proto: $(STAMP_TEST)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
	  --plugin=protoc-gen-grpclib_python=$(VENV)/bin/protoc-gen-grpclib_python --grpclib_python_out=. $(PROTO)

clean:
	rm -rf $(VENV) build *.egg-info
