#!/usr/bin/env bash
# Vets and tests the ulule/limiter store module (its own go.mod) against a
# real PostgreSQL, started first when none answers (as scripts/test.sh does).
#
#   bash ulule/test.sh                  # vet + every test, with -race
#   bash ulule/test.sh -run Suite -v    # extra arguments go to go test
#
# ulule's concurrency test hangs instead of failing when the store errors
# (its goroutines call require without deferring wg.Done): the tests guard it
# with their own timeout, and -timeout bounds the whole run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. scripts/lib.sh
pgrl_ensure_postgres
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL
cd ulule
go vet ./...
exec go test -race -count=1 -timeout 15m "$@" ./...
