# Entry points. `make demo` brings up the local cluster, the operator and a CPU EmbeddingService;
# `make test` runs every test (CI calls it through .ci/run).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup cluster-binaries test demo demo-down e2e-kind bench lint images

setup:
	./scripts/setup.sh

# Control plane binaries (kube-apiserver, controller-manager, scheduler, kwok, etcd, helm),
# built or fetched once per version into ~/.cache/embedops.
cluster-binaries:
	@if [ -x tests/cluster/build.sh ]; then ./tests/cluster/build.sh; else echo "cluster-binaries: not yet available"; fi

test: setup cluster-binaries
	$(PY) -m pytest $(PYTEST_ARGS)

# The server (CPU) and operator images, built with podman from a debootstrap base and a host wheelhouse,
# cached in ~/.cache/embedops/images (docs/images.md); prints the refs and containerd archives as JSON.
images:
	$(PY) -m tests.cluster.images build server operator

demo: setup cluster-binaries
	./scripts/demo.sh up

demo-down:
	./scripts/demo.sh down

e2e-kind:
	./tests/e2e/kind.sh

bench: setup
	$(PY) -m bench $(BENCH_ARGS)
