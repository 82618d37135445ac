GO ?= go
PREFIX ?= /usr/local
TEST_TIMEOUT ?= 15m

.PHONY: all generate build test bench lint install

all: build

# Rebuilds the committed BPF objects and their Go bindings (needs clang,
# llvm and libbpf-dev; go build does not).
generate:
	cd pkg/loader && $(GO) generate ./...

build:
	$(GO) build ./...

# Privileged tests run when this runs as root and skip, saying why, when not.
test:
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...

bench:
	$(GO) test -count=1 -run '^$$' -bench . -benchtime 2s ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
