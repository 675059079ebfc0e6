#!/usr/bin/env bash
# A throwaway Citus cluster for pgrl's tests: a coordinator and two workers
# on this machine, with a test database in which the citus extension exists
# on every node and the nodes are registered.
#
#   bash scripts/citus.sh up      # prints the coordinator's test database URL
#   bash scripts/citus.sh down    # stops the three servers, removes their files
#   bash scripts/citus.sh url     # prints the URL again
#
# Citus is not packaged for Debian. When citus.so is missing from the
# PostgreSQL it uses, `up` builds it with build.sh from the Citus source kept
# beside the repository (../shared/citus, or PGRL_CITUS_SRC), which needs
# root; without that source it fails and says how to get Citus. It never
# pretends a cluster is there.
#
# Settings (environment):
#   PGRL_CITUS_PORT      coordinator port; the workers take the next two (default 9700)
#   PGRL_CITUS_DIR       where the data directories live (default: a directory
#                        in TMPDIR, remembered for `down` in TMPDIR/pgrl-citus-PORT.dir)
#   PGRL_CITUS_DB        test database name (default pgrl_test)
#   PGRL_CITUS_SRC       directory holding Citus's build.sh (default ../shared/citus
#                        next to the repository)
#   PGRL_CITUS_PG_BIN    PostgreSQL binaries (default /usr/lib/postgresql/15/bin;
#                        Citus 13.2 supports PostgreSQL 15 to 17)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

port=${PGRL_CITUS_PORT:-9700}
db=${PGRL_CITUS_DB:-pgrl_test}
bindir=${PGRL_CITUS_PG_BIN:-/usr/lib/postgresql/15/bin}
ports=("$port" $((port + 1)) $((port + 2)))
statefile=${TMPDIR:-/tmp}/pgrl-citus-$port.dir

citus_url() {
	printf 'postgres://postgres@127.0.0.1:%s/%s?sslmode=disable\n' "$port" "$db"
}

# citus_dir prints the cluster's directory: the one given, else the one
# recorded by `up`.
citus_dir() {
	if [[ -n ${PGRL_CITUS_DIR:-} ]]; then
		printf '%s\n' "$PGRL_CITUS_DIR"
	elif [[ -f $statefile ]]; then
		cat "$statefile"
	fi
}

# ensure_citus makes sure the citus extension is installed into the
# PostgreSQL of bindir, building it when the source is at hand.
ensure_citus() {
	[[ -x $bindir/pg_config || -x $bindir/postgres ]] ||
		pgrl_die "no PostgreSQL binaries in $bindir; install PostgreSQL 15 (apt-get install postgresql-15) or set PGRL_CITUS_PG_BIN" || return 1
	local pgconfig=$bindir/pg_config libdir
	[[ -x $pgconfig ]] || pgconfig=$(command -v pg_config || true)
	libdir=$("$pgconfig" --pkglibdir 2>/dev/null || echo "${bindir%/bin}/lib")
	[[ -f $libdir/citus.so ]] && return 0
	local src=${PGRL_CITUS_SRC:-$PGRL_REPO_ROOT/../shared/citus}
	if [[ ! -f $src/build.sh ]]; then
		pgrl_die "Citus is not installed ($libdir/citus.so is missing) and no Citus source was found at $src: build and install Citus 13.2 for this PostgreSQL (https://github.com/citusdata/citus, see its README), or point PGRL_CITUS_SRC at a directory with a build.sh that does"
		return 1
	fi
	pgrl_log "citus.so missing from $libdir: building Citus with $src/build.sh (a few minutes)"
	PG_CONFIG=$pgconfig bash "$src/build.sh" >&2 || { pgrl_die "building Citus with $src/build.sh failed"; return 1; }
	[[ -f $libdir/citus.so ]] || pgrl_die "$src/build.sh finished but $libdir/citus.so is still missing" || return 1
}

psql_on() { # psql_on PORT DATABASE ARGS...
	local p=$1 d=$2
	shift 2
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$p" -U postgres -d "$d" "$@"
}

start_node() { # start_node DIR PORT
	local d=$1 p=$2
	if [[ ! -f $d/PG_VERSION ]]; then
		mkdir -p "$d"
		chmod 0700 "$d"
		[[ $(id -u) == 0 ]] && chown postgres: "$d"
		pgrl_as_postgres "$bindir/initdb" -D "$d" -A trust -U postgres --no-sync >/dev/null
		cat >>"$d/postgresql.conf" <<CONF
shared_preload_libraries = 'citus'
listen_addresses = '127.0.0.1'
port = $p
unix_socket_directories = '$d'
max_connections = 300
max_prepared_transactions = 300
fsync = off
synchronous_commit = off
full_page_writes = off
citus.shard_count = 4
CONF
	fi
	if pgrl_as_postgres "$bindir/pg_ctl" -D "$d" status >/dev/null 2>&1; then
		return 0
	fi
	pgrl_reachable 127.0.0.1 "$p" && { pgrl_die "port $p is taken by another server; set PGRL_CITUS_PORT"; return 1; }
	pgrl_as_postgres "$bindir/pg_ctl" -D "$d" -l "$d/server.log" -w -t 60 start >/dev/null ||
		{ pgrl_die "Citus node on port $p did not start; see $d/server.log"; return 1; }
}

up_ok=0
# A failed `up` leaves nothing running.
up_exit() { [[ $up_ok == 1 ]] || down; }

up() {
	ensure_citus
	trap 'pgrl_exit_trap up_exit' EXIT
	local dir
	dir=$(citus_dir)
	if [[ -z $dir ]]; then
		dir=$(mktemp -d "${TMPDIR:-/tmp}/pgrl-citus.XXXXXX")
	fi
	mkdir -p "$dir"
	[[ $(id -u) == 0 ]] && chown postgres: "$dir"
	printf '%s\n' "$dir" >"$statefile"
	local p
	for p in "${ports[@]}"; do
		start_node "$dir/$p" "$p"
	done
	for p in "${ports[@]}"; do
		if ! psql_on "$p" postgres -Atc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
			psql_on "$p" postgres -c "CREATE DATABASE \"$db\""
		fi
		psql_on "$p" "$db" -c "CREATE EXTENSION IF NOT EXISTS citus"
	done
	# Node membership is per database in Citus 13: register the nodes in the
	# test database, on the coordinator.
	psql_on "$port" "$db" -c "SELECT citus_set_coordinator_host('127.0.0.1', $port)" >/dev/null
	for p in "${ports[@]:1}"; do
		psql_on "$port" "$db" -Atc "SELECT 1 FROM pg_dist_node WHERE nodename = '127.0.0.1' AND nodeport = $p" | grep -q 1 ||
			psql_on "$port" "$db" -c "SELECT citus_add_node('127.0.0.1', $p)" >/dev/null
	done
	local workers
	workers=$(psql_on "$port" "$db" -Atc "SELECT count(*) FROM citus_get_active_worker_nodes()")
	[[ $workers == 2 ]] || { pgrl_die "expected 2 active workers, found $workers"; return 1; }
	up_ok=1
	pgrl_log "Citus cluster up in $dir: coordinator 127.0.0.1:$port, workers :${ports[1]} and :${ports[2]}, database $db"
	citus_url
}

down() {
	local dir p pid
	dir=$(citus_dir)
	if [[ -z $dir || ! -d $dir ]]; then
		rm -f "$statefile"
		return 0
	fi
	for p in "${ports[@]}"; do
		[[ -f $dir/$p/postmaster.pid ]] || continue
		pid=$(head -n 1 "$dir/$p/postmaster.pid" 2>/dev/null || true)
		# A fast shutdown first; pgrl_stop_pid waits for the postmaster to exit.
		pgrl_as_postgres "$bindir/pg_ctl" -D "$dir/$p" -m fast -w -t 30 stop >/dev/null 2>&1 || true
		[[ -n $pid ]] && pgrl_stop_pid "$pid" 10
	done
	pgrl_remove_dir "$dir"
	rm -f "$statefile"
	pgrl_log "Citus cluster stopped and removed ($dir)"
}

case ${1:-} in
up) up ;;
down) down ;;
url) citus_url ;;
*)
	pgrl_log "usage: bash scripts/citus.sh up|down|url"
	exit 2
	;;
esac
