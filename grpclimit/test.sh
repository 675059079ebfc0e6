#!/usr/bin/env bash
# Vets and tests the gRPC interceptors (their own go.mod, so that the
# core module carries no gRPC) against a real PostgreSQL, started
# first when none answers (as scripts/test.sh does).
#
#   bash grpclimit/test.sh            # vet + every test, with -race
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. scripts/lib.sh
pgrl_ensure_postgres
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL
cd grpclimit
go vet ./...
exec go test -race -count=1 -timeout 10m "$@" ./...
