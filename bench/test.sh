#!/usr/bin/env bash
# Vets and tests the bench module (vsredis and vsredischart) against a real
# PostgreSQL and a real Redis. PostgreSQL is found or started as
# scripts/test.sh does. Redis is the one at $PGRL_TEST_REDIS_ADDR when that is
# set; otherwise a redis-server started for this run on a free local port,
# with nothing saved to disk, and stopped at the end (installed with apt-get
# first when it is missing and you are root).
#
#   bash bench/test.sh                               # vet, then every test
#   bash bench/test.sh -run EndToEnd ./cmd/vsredis   # extra arguments go to go test
set -euo pipefail
bench_dir=$(cd "$(dirname "$0")" && pwd)
cd "$bench_dir/.."
. scripts/lib.sh

pgrl_ensure_postgres
PGRL_TEST_DATABASE_URL=$(pgrl_db_url)
export PGRL_TEST_DATABASE_URL

redis_dir=""
# stop_redis stops the redis-server started here and waits until it has
# exited before removing its directory (it writes its log there on its way
# down). It never changes the script's exit status.
stop_redis() {
	[[ -n $redis_dir ]] || return 0
	pgrl_stop_pidfile "$redis_dir/redis.pid"
	pgrl_remove_dir "$redis_dir"
}
trap 'pgrl_exit_trap stop_redis' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# start_redis starts redis-server on a free port of 127.0.0.1 and sets
# PGRL_TEST_REDIS_ADDR to it.
start_redis() {
	if ! command -v redis-server >/dev/null 2>&1; then
		pgrl_apt_install redis-server ||
			pgrl_die "redis-server is not installed: install it (Debian: apt-get install redis-server) or set PGRL_TEST_REDIS_ADDR to a Redis the tests may write to" ||
			return 1
	fi
	redis_dir=$(mktemp -d)
	local port
	for _ in $(seq 20); do
		port=$((20000 + RANDOM % 20000))
		pgrl_reachable 127.0.0.1 "$port" && continue
		if redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
			--dir "$redis_dir" --pidfile "$redis_dir/redis.pid" --logfile "$redis_dir/redis.log" \
			--daemonize yes >/dev/null; then
			for _ in $(seq 50); do
				if pgrl_reachable 127.0.0.1 "$port"; then
					PGRL_TEST_REDIS_ADDR=127.0.0.1:$port
					pgrl_log "redis-server started on $PGRL_TEST_REDIS_ADDR for the tests"
					return 0
				fi
				sleep 0.1
			done
		fi
		pgrl_stop_pidfile "$redis_dir/redis.pid"
		rm -f "$redis_dir/redis.pid"
	done
	cat "$redis_dir/redis.log" >&2 2>/dev/null || true
	pgrl_die "could not start redis-server on a free port of 127.0.0.1 (log above)"
}

if [[ -z ${PGRL_TEST_REDIS_ADDR:-} ]]; then
	start_redis
fi
export PGRL_TEST_REDIS_ADDR

cd "$bench_dir"
echo "--- go vet (bench module)"
go vet ./...
echo "--- go test (bench module)"
# Without package arguments, test every package.
pkgs=(./...)
for arg in "$@"; do
	case $arg in
	./* | github.com/*) pkgs=() ;;
	esac
done
go test -race -count=1 "$@" "${pkgs[@]}"
