# Entry points. `make demo` brings up the local cluster, the operator and a CPU EmbeddingService;
# `make test` runs every test (CI calls it through .ci/run).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# localcluster.build needs only the standard library, so it runs before (and beside) the venv's creation
HOSTPY ?= python3
PYTEST_ARGS ?=

.PHONY: setup host-packages cluster-binaries test-start-binaries demo-binaries test test-fast demo demo-down e2e-kind bench lint images

setup:
	./scripts/setup.sh

# Debian packages for the images and the real node (podman, containerd, runc, CNI plugins, debootstrap, ...).
host-packages:
	./scripts/host-packages.sh

# The local cluster's components (localcluster/components.py: kube-apiserver, controller-manager, scheduler,
# kubelet, kube-proxy, kwok, etcd, CoreDNS, helm, kstatus, Flux, upstream CRDs), built once per version into
# ~/.cache/embedops, two at a time. `$(HOSTPY) -m localcluster.build --list` prints the table.
cluster-binaries:
	$(HOSTPY) -m localcluster.build tests

# What the demo runs, and nothing it does not (no Flux controllers, no kstatus CLI, no helm).
demo-binaries:
	$(HOSTPY) -m localcluster.build demo

# The images are built (cached) by the tests that run them; see `images` below. The three prerequisites do
# not depend on each other, so they run side by side: on a new machine pip's download of torch and the apt
# packages overlap the Go builds instead of preceding them. pytest then runs in two lanes side by side
# (scripts/test-lanes.sh): the cluster's tests, and the ones that need no cluster; PYTEST_ARGS go to both.
test:
	$(MAKE) --no-print-directory -j3 setup host-packages test-start-binaries
	PY=$(PY) ./scripts/test-lanes.sh $(PYTEST_ARGS)

# What the tests need from their start (localcluster/components.py TESTS_START); test-lanes.sh builds the rest of
# the tests' set beside them.
test-start-binaries:
	$(HOSTPY) -m localcluster.build tests-start

# The developer's fast loop: the operator's unit tests and the server's quick ones (no cluster, no `slow` module:
# tests/conftest.py SLOW_MODULES), about 2 minutes on 2 cores. `make test` runs everything.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not cluster_lane" tests/unit tests/server tests/bench $(PYTEST_ARGS)

# The server (CPU) and operator images, built with podman from a debootstrap base and a host wheelhouse,
# cached in ~/.cache/embedops/images (docs/images.md); prints the refs and containerd archives as JSON.
images: setup host-packages
	$(PY) -m localcluster.images build server operator

demo:
	$(MAKE) --no-print-directory -j3 setup host-packages demo-binaries
	./scripts/demo.sh up

demo-down:
	./scripts/demo.sh down

e2e-kind:
	./tests/e2e/kind.sh

bench: setup
	$(PY) -m bench $(BENCH_ARGS)
