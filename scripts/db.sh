#!/usr/bin/env bash
# Makes sure the test PostgreSQL answers (starting a local one when needed,
# see scripts/lib.sh) and prints its URL:
#
#   export PGRL_TEST_DATABASE_URL=$(bash scripts/db.sh)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
pgrl_ensure_postgres
pgrl_db_url
