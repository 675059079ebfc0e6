#!/usr/bin/env bash
# Runs the multi-instance demo (examples/multiinstance): several OS processes
# fire concurrent checks at one key, first with a memory limiter in each
# process, then with pgrl's shared counter in PostgreSQL, and print what each
# admitted. Arguments go to the demo:
#
#   bash scripts/demo.sh
#   bash scripts/demo.sh --algorithm token_bucket --output json
#   bash scripts/demo.sh --database-url postgres://user@host/db
#
# Without --database-url or DATABASE_URL the demo uses the test database
# (PGRL_TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/pgrl_test),
# and this script first starts a local PostgreSQL when none answers there
# (see scripts/lib.sh). In any database the demo keeps its tables in a schema
# of its own, pgrl_demo (--schema NAME picks another), which it creates and
# migrates itself: it never writes into public or the URL's search_path.
set -euo pipefail
cd "$(dirname "$0")/.."

own_db=1
[[ -n ${DATABASE_URL:-} ]] && own_db=0
for arg in "$@"; do
	case $arg in
	--database-url | --database-url=* | -database-url | -database-url=*) own_db=0 ;;
	esac
done
if [[ $own_db == 1 ]]; then
	. scripts/lib.sh
	pgrl_ensure_postgres
	PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
	export PGRL_TEST_DATABASE_URL
fi
exec go run ./examples/multiinstance "$@"
