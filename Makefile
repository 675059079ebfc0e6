# pgrl developer targets. `make help` lists them.

SQLC_VERSION := v1.31.1
GOBIN := $(shell go env GOPATH)/bin
SQLC ?= $(shell command -v sqlc 2>/dev/null || echo $(GOBIN)/sqlc)

.PHONY: help generate check-generated sqlc test vet build

help:
	@echo "make generate         rewrite gen/ from sql/ with sqlc $(SQLC_VERSION)"
	@echo "make check-generated  fail when gen/ is stale"
	@echo "make test             run every test (starts a local PostgreSQL if needed)"
	@echo "make vet              go vet ./..."
	@echo "make build            build the commands into bin/"

# sqlc checks that the pinned sqlc is installed.
sqlc:
	@v=$$($(SQLC) version 2>/dev/null); if [ "$$v" != "$(SQLC_VERSION)" ]; then \
		echo "need sqlc $(SQLC_VERSION) (found: $${v:-none}); install it with:" >&2; \
		echo "  CGO_ENABLED=0 go install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)" >&2; \
		exit 1; fi

generate: sqlc
	$(SQLC) generate

check-generated: sqlc
	@$(SQLC) diff || { echo "gen/ is stale: run 'make generate' and commit the result" >&2; exit 1; }

test:
	bash scripts/test.sh

vet:
	go vet ./...

build:
	go build -o bin/ ./cmd/...
