#!/usr/bin/env bash
# Runs the pgrl vs go-redis/redis_rate comparison (cmd/vsredis) on this
# machine: makes sure Redis and PostgreSQL are up, then runs the benchmark and
# draws its chart.
#
#   bench/run.sh                          # text table on stdout
#   OUT=/tmp/vsredis bench/run.sh         # also writes $OUT.json and $OUT.svg
#   bench/run.sh --callers 64 --keys 100000 --max-in-flight 1
#   bench/run.sh --callers 8,32,64 --keys 10 --mix app --duration 2s
#
# Extra arguments go to vsredis. Environment:
#   DATABASE_URL / PGRL_TEST_DATABASE_URL  the PostgreSQL to use (default:
#       postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable)
#   REDIS_ADDR  host:port of Redis (default 127.0.0.1:6379); when nothing
#       answers there, Redis is installed (apt, as root) and started
#   OUT         path prefix for the JSON report and the SVG chart
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
redis_addr="${REDIS_ADDR:-127.0.0.1:6379}"
redis_host="${redis_addr%:*}"
redis_port="${redis_addr##*:}"
db_url="${DATABASE_URL:-${PGRL_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable}}"

log() { echo "bench/run.sh: $*" >&2; }

as_root() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
		log "need root for: $*"
		return 1
	fi
}

redis_up() {
	if command -v redis-cli >/dev/null; then
		redis-cli -h "$redis_host" -p "$redis_port" ping 2>/dev/null | grep -q PONG
	else
		# No client: talk RESP by hand.
		exec 3<>"/dev/tcp/$redis_host/$redis_port" 2>/dev/null || return 1
		printf 'PING\r\n' >&3
		local reply
		read -r -t 2 reply <&3 || true
		exec 3<&-
		[[ "$reply" == +PONG* ]]
	fi
}

ensure_redis() {
	if redis_up; then
		return
	fi
	if ! command -v redis-server >/dev/null; then
		log "installing redis-server"
		as_root apt-get update -qq
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
	fi
	log "starting redis-server on $redis_host:$redis_port"
	redis-server --daemonize yes --bind "$redis_host" --port "$redis_port" --save "" --appendonly no >/dev/null
	for _ in $(seq 50); do
		redis_up && return
		sleep 0.1
	done
	log "Redis did not come up at $redis_addr"
	exit 1
}

pg_up() { psql "$db_url" -XqAtc 'SELECT 1' >/dev/null 2>&1; }

setup_postgres() {
	# The repository's shared script starts a local server (installing
	# PostgreSQL when needed) and creates the database.
	if [ -f "$root/scripts/lib.sh" ]; then
		# shellcheck disable=SC1091
		. "$root/scripts/lib.sh"
		PGRL_TEST_DATABASE_URL="$db_url" pgrl_ensure_postgres
		return
	fi
	if ! command -v psql >/dev/null || ! pg_up; then
		log "PostgreSQL not reachable at $db_url; start one or set DATABASE_URL"
		exit 1
	fi
}

ensure_redis
setup_postgres

cd "$here"
bin="$(mktemp -d)"
# Cleanup must not fail a run that passed.
trap 'rm -rf "$bin" || true' EXIT
go build -o "$bin/vsredis" ./cmd/vsredis
go build -o "$bin/vsredischart" ./cmd/vsredischart

if [ -n "${OUT:-}" ]; then
	"$bin/vsredis" --database-url "$db_url" --redis-addr "$redis_addr" --output json "$@" >"$OUT.json"
	"$bin/vsredischart" -o "$OUT.svg" "$OUT.json"
	log "wrote $OUT.json and $OUT.svg"
	cat "$OUT.json"
else
	"$bin/vsredis" --database-url "$db_url" --redis-addr "$redis_addr" "$@"
fi
