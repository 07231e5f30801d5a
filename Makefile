# ucm — see README.md. `make run` and `make test` are the two entry points.
SHELL := /bin/bash
.DEFAULT_GOAL := build

CARGO      ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
UCM        := $(TARGET_DIR)/debug/ucm

# The e2e control plane: Go program built from published modules (no downloads besides the module proxy).
K8S_VERSION := v1.37.2
GO_ENV      := CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
GO_LDFLAGS  := -s -w -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
               -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 \
               -X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION) \
               -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=37
KHARNESS    := e2e/bin/kharness
KUBECTL     := e2e/bin/kubectl
HELM        := e2e/bin/helm
PROMTOOL    := e2e/bin/promtool
UPSTREAM_KEYS := e2e/bin/upstream-keys
KUBELET     := e2e/bin/kubelet
SCHEDULER   := e2e/bin/kube-scheduler
KUBEPROXY   := e2e/bin/kube-proxy
PAUSE       := e2e/bin/pause
COREDNS     := e2e/bin/coredns
LOCALPATH   := e2e/bin/local-path-provisioner
NODE_BINS   := $(KHARNESS) $(KUBECTL) $(KUBELET) $(SCHEDULER) $(KUBEPROXY) $(PAUSE) $(COREDNS) $(LOCALPATH)
HELM_VERSION = $(shell awk '$$1=="helm.sh/helm/v4"{print $$2}' e2e/tools/helm/go.mod)
GO_SOURCES  := $(shell find e2e/cmd/kharness -name '*.go' 2>/dev/null) e2e/go.mod e2e/go.sum

export GOTOOLCHAIN := local

.PHONY: build lint fmt unit crds crds-check fresh-check cluster e2e test test-deps run bench fuzz soak image node node-down node-check node-e2e \
        conformance conformance-ci storage-lab storage-lab-ci

build:
	$(CARGO) build

fmt:
	$(CARGO) fmt

# cargo-deny (docs/architecture.md, "Guard rails"), pinned, built once into the cache.
CARGO_DENY_VERSION := 0.20.2
CARGO_DENY := $(HOME)/.cache/ucm/tools/cargo-deny-$(CARGO_DENY_VERSION)/bin/cargo-deny

$(CARGO_DENY):
	@echo "building cargo-deny $(CARGO_DENY_VERSION) (once, about 5 min)"
	$(CARGO) install cargo-deny --version $(CARGO_DENY_VERSION) --locked --quiet \
	  --root $(HOME)/.cache/ucm/tools/cargo-deny-$(CARGO_DENY_VERSION) \
	  --target-dir $(HOME)/.cache/ucm/tools/target

lint: $(CARGO_DENY)
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO_DENY) check licenses bans sources
	cd e2e && $(GO_ENV) go vet ./...
	@test -z "$$(gofmt -l e2e/cmd)" || { echo "gofmt needed:"; gofmt -l e2e/cmd; exit 1; }

unit:
	$(CARGO) test --locked

# CRDs are generated from the Rust types; `make test` fails when crds/ is stale.
crds: build
	rm -rf crds && $(UCM) crds --output-dir crds

crds-check: build
	@tmp=$$(mktemp -d) && $(UCM) crds --output-dir $$tmp && \
	  if ! diff -r crds $$tmp >/dev/null 2>&1; then \
	    diff -r crds $$tmp | head -40; rm -rf $$tmp; \
	    echo "crds/ is stale: run 'make crds' and commit the result"; exit 1; fi; rm -rf $$tmp

$(KHARNESS): $(GO_SOURCES)
	cd e2e && $(GO_ENV) go build -ldflags "$(GO_LDFLAGS)" -o bin/kharness ./cmd/kharness

$(KUBECTL): e2e/go.mod e2e/go.sum
	cd e2e && $(GO_ENV) go build -ldflags "$(GO_LDFLAGS)" -o bin/kubectl k8s.io/kubernetes/cmd/kubectl

# helm from its published Go module, in its own module so its k8s libraries do not fight
# e2e/go.mod's replace block; used by the deployment tests.
$(HELM): e2e/tools/helm/go.mod e2e/tools/helm/go.sum
	cd e2e/tools/helm && $(GO_ENV) go build -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$(HELM_VERSION)" -o ../../bin/helm helm.sh/helm/v4/cmd/helm

# promtool from Prometheus's published Go module (its own module, like helm): the e2e suite
# checks the shipped alert rules (`promtool check rules`) and live scrapes (`check metrics`).
$(PROMTOOL): e2e/tools/promtool/go.mod e2e/tools/promtool/go.sum
	cd e2e/tools/promtool && $(GO_ENV) go build -ldflags "-s -w" -o ../../bin/promtool github.com/prometheus/prometheus/cmd/promtool

# The upstream Jumpstarter controller's key derivation and token minting, from the Go standard
# library and filippo.io/keygen only: the independent reference of the takeover tests
# (docs/exporter.md, "The signing key").
$(UPSTREAM_KEYS): e2e/tools/upstream-keys/main.go e2e/tools/upstream-keys/go.mod e2e/tools/upstream-keys/go.sum
	cd e2e/tools/upstream-keys && $(GO_ENV) go build -ldflags "-s -w" -o ../../bin/upstream-keys .

cluster: $(KHARNESS) $(KUBECTL) $(HELM) $(PROMTOOL) $(UPSTREAM_KEYS)

# The ucm container image as an OCI archive ($(TARGET_DIR)/ucm-image.oci.tar), built from the
# Dockerfile by buildah without Docker or a registry (hack/build/image.sh; installs buildah if missing).
image:
	hack/build/image.sh

# A real node (containerd + runc + kubelet, kube-scheduler, kube-proxy, bridge CNI, CoreDNS and
# rancher's local-path provisioner) in its own network namespace, on a control plane of its own
# (hack/node/node.sh; root). `make node-down` stops it and restores the host; `make node-check`
# runs real Pods, the add-ons and the e2e suite's platform::node tests on it, and proves that
# `down` does.
$(KUBELET) $(SCHEDULER) $(KUBEPROXY): e2e/go.mod e2e/go.sum
	cd e2e && $(GO_ENV) go build -ldflags "$(GO_LDFLAGS)" -o bin/$(notdir $@) k8s.io/kubernetes/cmd/$(notdir $@)

# The node's add-ons from their published Go modules, each in a module of its own (like helm):
# CoreDNS for Service names, the local-path provisioner so PVCs bind (hack/node/addons.yaml).
$(COREDNS): e2e/tools/coredns/go.mod e2e/tools/coredns/go.sum
	cd e2e/tools/coredns && $(GO_ENV) go build -ldflags "-s -w" -o ../../bin/coredns github.com/coredns/coredns

$(LOCALPATH): e2e/tools/local-path/go.mod e2e/tools/local-path/go.sum
	cd e2e/tools/local-path && $(GO_ENV) go build -ldflags "-s -w" -o ../../bin/local-path-provisioner github.com/rancher/local-path-provisioner

$(PAUSE): e2e/cmd/pause/main.go
	cd e2e && $(GO_ENV) go build -ldflags "-s -w" -o bin/pause ./cmd/pause

node: image $(NODE_BINS)
	hack/build/image.sh node
	hack/node/node.sh up

node-down:
	hack/node/node.sh down

node-check: image $(NODE_BINS)
	hack/build/image.sh node
	hack/node/check.sh

# `make test`'s node step: node-check with the image built from a debug build of the same source
# (hack/build/image.sh: a changed source rebuilds in about a minute; the release one takes 7–19 min),
# then `make run`'s node part with that image, its output piped into tee, whose printed jmp
# commands run unchanged from the host, ended by Ctrl-C: the host as before (hack/demo/check.sh,
# about 3 min).
TEST_IMAGE := $(TARGET_DIR)/ucm-image-dev.oci.tar
node-e2e: $(NODE_BINS)
	UCM_IMAGE_PROFILE=dev UCM_IMAGE_ARCHIVE=$(TEST_IMAGE) hack/build/image.sh
	hack/build/image.sh node
	UCM_IMAGE_ARCHIVE=$(TEST_IMAGE) hack/node/check.sh
	UCM_IMAGE_ARCHIVE=$(TEST_IMAGE) hack/demo/check.sh

# One shared control plane for the e2e suite (one test binary); tests needing their own start one.
e2e: cluster build
	hack/test/e2e.sh

# Conformance: Jumpstarter's own e2e suite v0.9.0, unmodified, from
# ../shared/conformance (read-only test data), against ucm's exporter feature and `ucm router`, with
# dex, jmp 0.9.0 (and 0.7.4 for old-client) from PyPI, in private namespaces
# (hack/conformance/run.sh; root). `make conformance LANES="core auth-logging"` picks lanes;
# `make conformance-ci` runs the lanes CI runs; CONFORMANCE_SKIP=<regexp> is -ginkgo.skip.
# Logs: .run/conformance/ (docs/conformance.md).
CONFORMANCE_SRC  ?= $(abspath ../shared/conformance)
DEX              := e2e/bin/dex
CONFORMANCE_TEST := e2e/bin/jumpstarter-e2e.test
LANES            ?= core hooks auth-logging direct-listener dut-network old-client old-controller
# What `make test` (and so CI) runs: the lanes that talk to the controller and fit CI's budget
# (cold CI at most 75 min on 2 cores). core without its two pagination specs (they create 101
# objects each through jmp admin: 7 of core's 12 min) and auth-logging (15 s). hooks (11 min, a
# 300 s client timeout inside), direct-listener and dut-network (never contact the controller)
# and old-client run in `make conformance` (docs/conformance.md).
CONFORMANCE_CI_LANES := core auth-logging
CONFORMANCE_CI_SKIP  := paginated (lease|exporter) listing returns all

# dex from the shared source (its go.mod has a local replace, so no `go install pkg@version`).
$(DEX): $(CONFORMANCE_SRC)/dex-v2.45.1/go.mod $(CONFORMANCE_SRC)/dex-v2.45.1/go.sum
	cd $(CONFORMANCE_SRC)/dex-v2.45.1 && $(GO_ENV) go build -ldflags "-s -w" -o $(abspath $(DEX)) ./cmd/dex

# The suite's Ginkgo test binary (`go test -c` of its test/ package, its own go.mod and versions).
$(CONFORMANCE_TEST): $(wildcard $(CONFORMANCE_SRC)/jumpstarter-e2e-v0.9.0/test/*.go) $(CONFORMANCE_SRC)/jumpstarter-e2e-v0.9.0/test/go.mod
	cd $(CONFORMANCE_SRC)/jumpstarter-e2e-v0.9.0/test && $(GO_ENV) go test -c -o $(abspath $(CONFORMANCE_TEST)) .

conformance: build $(KHARNESS) $(KUBECTL) $(DEX) $(CONFORMANCE_TEST)
	UCM_CONFORMANCE_SRC=$(CONFORMANCE_SRC) UCM_CONFORMANCE_SKIP="$(CONFORMANCE_SKIP)" UCM=$(abspath $(UCM)) hack/conformance/run.sh $(LANES)

conformance-ci:
	$(MAKE) conformance LANES="$(CONFORMANCE_CI_LANES)" CONFORMANCE_SKIP="$(CONFORMANCE_CI_SKIP)"

test-deps:
	hack/build/test-deps.sh

# A second build with nothing changed compiles nothing (docs/architecture.md, "Build stamp").
fresh-check: build
	hack/build/check-fresh.sh

# The storage lab (docs/snapshot.md, "Testing"): QEMU guests with Debian's cloud kernel, real DRBD
# 9.3.3, LVM thin and ext4, the shipped agent in each guest against a local control plane
# (hack/storage-lab/lab.sh; root). Kernel, DRBD modules and initramfs are cached under
# ~/.cache/ucm/storage-lab. `storage-lab-ci`: one replicated and one unreplicated round;
# `storage-lab`: the whole lab (ROUNDS rounds with pause figures, the bare sequence, failure paths).
ROUNDS ?= 20
storage-lab-ci: build $(KHARNESS) $(KUBECTL)
	UCM=$(UCM) hack/storage-lab/lab.sh --ci

storage-lab: build $(KHARNESS) $(KUBECTL)
	UCM=$(UCM) hack/storage-lab/lab.sh --rounds $(ROUNDS)

test: test-deps lint crds-check fresh-check unit e2e node-e2e conformance-ci storage-lab-ci

# `make run`: config/default as shipped on a real local node, with a demo for every feature
# (hack/demo/run-node.sh; root). `make run LOCAL=1`, and any run without root: the manager as a local
# process on the node-less control plane (hack/demo/run.sh), for fast iteration.
# hack/demo/make-run.sh builds what is missing, one stage line each (tool output in .run/logs/).
RUN_NODE := $(if $(LOCAL),,$(shell [ "$$(id -u)" -eq 0 ] && echo 1))
run:
	@MAKE="$(MAKE)" hack/demo/make-run.sh $(if $(RUN_NODE),node,$(if $(LOCAL),local,not-root))

# The benchmark suite (issue 9): writes bench/results.md and bench/results.json. Not part of `test`.
# `UCM_BENCH_ONLY=<phase>[,<phase>] make bench` reruns some phases (see bench/results.md).
bench: $(KHARNESS)
	hack/bench/bench.sh

# Fuzzing (issue 10): the cargo-fuzz targets in fuzz/ (its own crate and lock file, so `make
# test` never builds it), each run FUZZ_SECONDS, executions per target printed at the end.
# Only stable Rust is installed and rustup cannot fetch nightly, so cargo-fuzz (installed here,
# pinned, from crates.io) runs with `--sanitizer none`: that needs no -Z flag, and libFuzzer's
# coverage instrumentation comes from stable `-C passes=sancov-module -C llvm-args=...` flags.
# Without AddressSanitizer, safe Rust still panics on every out-of-bounds access or overflow
# (cargo fuzz builds with debug assertions and overflow checks), which is what the targets check.
FUZZ_SECONDS ?= 60
CARGO_FUZZ_VERSION := 0.13.2
fuzz:
	@cargo fuzz --version 2>/dev/null | grep -qx 'cargo-fuzz $(CARGO_FUZZ_VERSION)' || \
	  $(CARGO) install cargo-fuzz --version $(CARGO_FUZZ_VERSION) --locked
	FUZZ_SECONDS=$(FUZZ_SECONDS) hack/test/fuzz.sh

# Reliability soak (not part of `make test`): every feature churned for SOAK_MINUTES (default
# 10) behind a proxy that drops the manager's connections for the first minute; prints the
# summary docs/testing.md quotes (RSS, open fds, reconcile errors).
soak: cluster build
	SOAK_MINUTES=$(or $(SOAK_MINUTES),10) hack/test/soak.sh
