#!/usr/bin/env bash
# Vets and tests the gin and echo examples (their own go.mod, so that the
# core module carries neither framework) against a real PostgreSQL, started
# first when none answers (as scripts/test.sh does).
#
#   bash frameworks/test.sh           # vet + every test and example, with -race
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. scripts/lib.sh
pgrl_ensure_postgres
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL
cd frameworks
go vet ./...
exec go test -race -count=1 -timeout 10m "$@" ./...
