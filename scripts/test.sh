#!/usr/bin/env bash
# Runs pgrl's tests against a real PostgreSQL: the one named by
# PGRL_TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/pgrl_test,
# starting a local server (and creating the database) first when none answers.
#
#   bash scripts/test.sh                       # everything
#   bash scripts/test.sh ./migration/... -run Up   # extra arguments go to go test
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
pgrl_ensure_postgres
# The clients of the tests that call pgrl_check from Python and Node.
bash scripts/sqlclients.sh
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL

# Without package arguments, test every package.
pkgs=(./...)
for arg in "$@"; do
	case $arg in
	./* | github.com/*) pkgs=() ;;
	esac
done
# A package's tests may take more than go test's default 10 minutes on a busy
# machine (the fault tests scale their deadlines to it); a -timeout among the
# arguments still wins.
exec go test -race -count=1 -timeout 30m "$@" "${pkgs[@]}"
