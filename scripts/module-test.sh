#!/usr/bin/env bash
# Vets and tests one of the modules that carry a dependency the core module
# must not (otelpgrl, frameworks, grpclimit: each has its own go.mod) against
# a real PostgreSQL, started first when none answers (as scripts/test.sh does).
#
#   bash scripts/module-test.sh grpclimit            # vet + every test, with -race
#   bash scripts/module-test.sh otelpgrl -run Annotate -v
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. scripts/lib.sh
module=${1:?usage: scripts/module-test.sh MODULE [go test arguments]}
shift
pgrl_ensure_postgres
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL
cd "$module"
go vet ./...
exec go test -race -count=1 -timeout 10m "$@" ./...
