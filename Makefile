# Entry points. `make demo` brings up the local cluster, the operator and a CPU EmbeddingService;
# `make test` runs every test (CI calls it through .ci/run).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup host-packages cluster-binaries demo-binaries test demo demo-down e2e-kind bench lint images

setup:
	./scripts/setup.sh

# Debian packages for the images and the real node (podman, containerd, runc, CNI plugins, debootstrap, ...).
host-packages:
	./scripts/host-packages.sh

# Control plane and real-node binaries (kube-apiserver, controller-manager, scheduler, kubelet, kube-proxy,
# kwok, etcd, CoreDNS, helm, kstatus, Flux), built or fetched once per version into ~/.cache/embedops.
cluster-binaries:
	./tests/cluster/build.sh

# What the demo runs, and nothing it does not (no Flux controllers, no kstatus CLI).
demo-binaries:
	./tests/cluster/build.sh k8s kwok etcd coredns crds

# The images are built (cached) by the tests that run them; see `images` below.
test: setup host-packages cluster-binaries
	$(PY) -m pytest $(PYTEST_ARGS)

# The server (CPU) and operator images, built with podman from a debootstrap base and a host wheelhouse,
# cached in ~/.cache/embedops/images (docs/images.md); prints the refs and containerd archives as JSON.
images: setup host-packages
	$(PY) -m tests.cluster.images build server operator

demo: setup host-packages demo-binaries
	./scripts/demo.sh up

demo-down:
	./scripts/demo.sh down

e2e-kind:
	./tests/e2e/kind.sh

bench: setup
	$(PY) -m bench $(BENCH_ARGS)
