#!/usr/bin/env bash
# Installs the clients that the tests of pgrl_check use from other languages
# (tests/sql_check_test.go): Python's psycopg (Debian's python3-psycopg, for
# the system's python3) and Node's pg (the version tests/sqlclients pins,
# into tests/sqlclients/node_modules). Does nothing for what is there.
# .ci/run runs it; run it yourself once before `bash scripts/test.sh` on a
# machine of your own (the psycopg install needs root and apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if ! /usr/bin/python3 -c 'import psycopg' >/dev/null 2>&1 && ! python3 -c 'import psycopg' >/dev/null 2>&1; then
	pgrl_apt_install python3-psycopg
fi
command -v node >/dev/null 2>&1 || pgrl_apt_install nodejs npm
if ! (cd tests/sqlclients && node -e "require('./node_modules/pg')") >/dev/null 2>&1; then
	pgrl_log "installing Node's pg into tests/sqlclients"
	(cd tests/sqlclients && npm ci --no-audit --no-fund --loglevel=error)
fi
