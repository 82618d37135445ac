# The Go toolchain: go on PATH, else the official tarball's /usr/local/go,
# which sudo's secure_path leaves out (`sudo make run` on a fresh Debian).
ifeq ($(origin GO),undefined)
GO := $(or $(shell command -v go 2>/dev/null),$(wildcard /usr/local/go/bin/go),go)
endif
# Tests and tools run `go` themselves (tests/ builds the daemon, deptest
# lists packages): they find the same toolchain first on PATH.
GOBINDIR := $(patsubst %/,%,$(dir $(filter /%,$(GO))))
ifneq ($(GOBINDIR),)
export PATH := $(GOBINDIR):$(PATH)
endif
# Under sudo, compile as the user who ran it: bin/ and the Go caches stay
# theirs, and only what needs root (running the daemon, the privileged
# tests, apt-get) runs as root.
ifneq ($(filter-out root,$(SUDO_USER)),)
AS_USER := sudo -u $(SUDO_USER) -H --
endif
PREFIX ?= /usr/local
DESTDIR ?=
TEST_TIMEOUT ?= 15m
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/egressd/egressd/internal/cli.Version=$(VERSION)

.PHONY: all deps generate build run test bench lint install deb

all: build

# Debian packages the tests, `make generate` and `make deb` use (run as
# root). zsh, bash-completion and man-db let the completion scripts and man
# pages be tested as a host runs them; pkgconf says where units go;
# etcd-server backs the kube-apiserver the Kubernetes tests start.
deps:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		clang llvm libbpf-dev bpftool iproute2 python3 curl systemd procps \
		redis-server redis-sentinel nftables prometheus lintian dpkg-dev \
		zsh bash-completion man-db pkgconf etcd-server >/dev/null
# kubectl for the Kubernetes tests: Debian's kubernetes-client (1.20)
# only where none is installed, since it and the kubectl packages of
# Kubernetes' and Google's repositories all ship /usr/bin/kubectl.
	command -v kubectl >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends kubernetes-client >/dev/null

# Rebuilds what is generated and committed: the BPF objects and their Go
# bindings (needs clang, llvm and libbpf-dev; go build does not), and the
# enums' String methods (stringer, a tool in go.mod).
generate:
	$(GO) generate ./...

build:
	$(AS_USER) $(GO) build -ldflags "$(LDFLAGS)" -o bin/egressd ./cmd/egressd

# Runs the daemon in the foreground with the example policy, which limits
# only unused loopback ports. Ctrl-C stops it; the datapath stays pinned
# (fail-static) until `bin/egressd uninstall`.
run: build
	./bin/egressd run --policy examples/policy.yaml --state-dir /tmp/egressd-state

# Privileged tests run when this runs as root and skip, saying why, when not.
# The packages run again under the race detector; the end-to-end tests in
# tests/ drive a separately built binary, which the detector cannot see.
# The first line builds kube-apiserver for the Kubernetes tests (minutes,
# once per machine) before the packages that start it run side by side.
test:
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -run '^TestStart$$' ./internal/k8stest
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./pkg/... ./internal/...

# Runs every benchmark (privileged ones need root) and writes docs/bench.md.
bench:
	$(GO) run ./internal/tools/benchreport -o docs/bench.md

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# Installs the binary, the systemd unit and, unless one exists, the
# example policy. Then: systemctl daemon-reload && systemctl enable --now egressd
UNITDIR ?= /etc/systemd/system
install: build
	install -D -m 0755 bin/egressd $(DESTDIR)$(PREFIX)/bin/egressd
	install -d -m 0755 $(DESTDIR)$(UNITDIR) $(DESTDIR)/etc/egressd
	sed 's|/usr/local/bin/egressd|$(PREFIX)/bin/egressd|' systemd/egressd.service > $(DESTDIR)$(UNITDIR)/egressd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/egressd.service
	@if [ ! -e $(DESTDIR)/etc/egressd/policy.yaml ]; then \
		install -m 0644 examples/policy.yaml $(DESTDIR)/etc/egressd/policy.yaml; \
	else echo "keeping the existing /etc/egressd/policy.yaml"; fi

# The Debian package, build/egressd_VERSION_ARCH.deb, checked with lintian
# (packaging/deb/build says what is in it). Needs dpkg-dev (make deps).
# .ci/deb-check takes it through install, remove and purge.
DEB_LINT ?= yes
deb:
	$(AS_USER) env GO=$(GO) PATH="$(PATH)" DEB_LINT=$(DEB_LINT) packaging/deb/build build
