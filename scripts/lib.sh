# Shell functions shared by pgrl's scripts. Source it:
#
#   . scripts/lib.sh
#   pgrl_ensure_postgres          # a PostgreSQL answers at the test URL, database created
#   url=$(pgrl_db_url)
#
# pgrl_ensure_postgres uses the server named by PGRL_TEST_DATABASE_URL (default
# postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable). When nothing
# answers there and the host is this machine, it starts a local server whose
# data lives in the repository's .pgdata/ directory (git ignores it),
# installing PostgreSQL with apt-get first when no server binaries exist and
# the script runs as root. It is idempotent: the next call finds the server
# running. Stop the server with: pg_ctl -D .pgdata/<port> stop

PGRL_DEFAULT_TEST_URL='postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable'
PGRL_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

pgrl_log() { printf '%s\n' "$*" >&2; }
pgrl_die() { printf 'error: %s\n' "$*" >&2; return 1; }

# Stopping what a script started. A server that was sent a signal is still
# running, and may still write into its directory (Redis logs its shutdown,
# PostgreSQL removes its pid file last): remove its files only after it is
# gone. Cleanup must never turn a passing run into a failing one, so these
# functions log what they could not do and return 0.

# pgrl_alive PID succeeds while the process exists and is not a zombie.
pgrl_alive() {
	local state=""
	kill -0 "$1" 2>/dev/null || return 1
	if [[ -r /proc/$1/stat ]]; then
		# The state is the first field after the command's closing parenthesis.
		state=$(sed 's/^.*) //; s/ .*//' "/proc/$1/stat" 2>/dev/null) || true
		[[ $state != Z ]] || return 1
	fi
	return 0
}

# pgrl_wait_gone PID TENTHS waits until the process is gone, at most TENTHS
# tenths of a second; it fails when the process is still there.
pgrl_wait_gone() {
	local pid=$1 n=$2
	while pgrl_alive "$pid"; do
		((n-- > 0)) || return 1
		sleep 0.1
	done
	return 0
}

# pgrl_stop_pid PID [SECONDS] [SIGNAL] stops a process and waits until it is
# gone: SIGNAL (default TERM), up to SECONDS (default 10) for it to exit, then
# KILL and up to 5 s more. A child of the calling shell is reaped too. It
# returns 0 when the process is gone (or never existed), 1 with a message
# when even KILL did not end it.
pgrl_stop_pid() {
	local pid=$1 secs=${2:-10} sig=${3:-TERM}
	[[ $pid =~ ^[0-9]+$ ]] || { pgrl_log "warning: not a process id: '$pid'"; return 0; }
	pgrl_alive "$pid" || { wait "$pid" 2>/dev/null || true; return 0; }
	kill -s "$sig" "$pid" 2>/dev/null || true
	if ! pgrl_wait_gone "$pid" $((secs * 10)); then
		pgrl_log "warning: process $pid still running ${secs}s after SIG$sig; sending SIGKILL"
		kill -s KILL "$pid" 2>/dev/null || true
		if ! pgrl_wait_gone "$pid" 50; then
			pgrl_log "warning: process $pid survived SIGKILL"
			return 1
		fi
	fi
	wait "$pid" 2>/dev/null || true
	return 0
}

# pgrl_stop_pidfile FILE [SECONDS] [SIGNAL] stops the process whose id is the
# first line of FILE (Redis' --pidfile, PostgreSQL's postmaster.pid), as
# pgrl_stop_pid does. A missing or empty file is nothing to stop.
pgrl_stop_pidfile() {
	local file=$1 pid=""
	[[ -f $file ]] || return 0
	read -r pid <"$file" 2>/dev/null || true
	[[ -n $pid ]] || return 0
	pgrl_stop_pid "$pid" "${2:-10}" "${3:-TERM}"
}

# pgrl_remove_dir DIR [SECONDS] removes a directory tree, retrying for up to
# SECONDS (default 5) when something still writes into it; it logs a warning
# and returns 0 when it cannot.
pgrl_remove_dir() {
	local dir=$1 secs=${2:-5} _
	[[ -n $dir ]] || return 0
	for _ in $(seq $((secs * 10))); do
		rm -rf -- "$dir" 2>/dev/null && [[ ! -e $dir ]] && return 0
		sleep 0.1
	done
	rm -rf -- "$dir" 2>/dev/null && [[ ! -e $dir ]] && return 0
	pgrl_log "warning: could not remove $dir (left in place): $(rm -rf -- "$dir" 2>&1 | head -n 1)"
	return 0
}

# pgrl_exit_trap CMD... runs CMD as a script's EXIT trap without changing the
# script's exit status, whatever CMD does (set -e does not apply inside it):
#
#   cleanup() { pgrl_stop_pidfile "$dir/redis.pid"; pgrl_remove_dir "$dir"; }
#   trap 'pgrl_exit_trap cleanup' EXIT
pgrl_exit_trap() {
	local rc=$?
	set +e
	"$@"
	exit "$rc"
}

# pgrl_db_url prints the test database URL.
pgrl_db_url() { printf '%s\n' "${PGRL_TEST_DATABASE_URL:-$PGRL_DEFAULT_TEST_URL}"; }

# pgrl_parse_url URL sets PGRL_DB_USER, PGRL_DB_HOST, PGRL_DB_PORT and
# PGRL_DB_NAME from a postgres:// URL.
pgrl_parse_url() {
	local url=$1 rest auth hostport
	rest=${url#*://}
	if [[ $rest == *@* ]]; then
		auth=${rest%%@*}
		rest=${rest#*@}
	else
		auth=""
	fi
	PGRL_DB_USER=${auth%%:*}
	PGRL_DB_USER=${PGRL_DB_USER:-${PGUSER:-postgres}}
	hostport=${rest%%/*}
	hostport=${hostport%%\?*}
	PGRL_DB_NAME=""
	[[ $rest == */* ]] && PGRL_DB_NAME=${rest#*/}
	PGRL_DB_NAME=${PGRL_DB_NAME%%\?*}
	PGRL_DB_NAME=${PGRL_DB_NAME:-$PGRL_DB_USER}
	if [[ $hostport == \[*\]* ]]; then # [::1]:5432
		PGRL_DB_HOST=${hostport%%]*}
		PGRL_DB_HOST=${PGRL_DB_HOST#[}
		PGRL_DB_PORT=${hostport##*]}
		PGRL_DB_PORT=${PGRL_DB_PORT#:}
	else
		PGRL_DB_HOST=${hostport%%:*}
		PGRL_DB_PORT=""
		[[ $hostport == *:* ]] && PGRL_DB_PORT=${hostport##*:}
	fi
	PGRL_DB_HOST=${PGRL_DB_HOST:-127.0.0.1}
	PGRL_DB_PORT=${PGRL_DB_PORT:-5432}
}

# pgrl_reachable HOST PORT succeeds when something accepts TCP connections there.
pgrl_reachable() {
	timeout 3 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

# pgrl_pg_bindir prints the newest /usr/lib/postgresql/*/bin holding initdb
# (or the directory of an initdb on PATH).
pgrl_pg_bindir() {
	local d
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
	if [[ -n $d && -x $d/initdb ]]; then
		printf '%s\n' "$d"
	elif command -v initdb >/dev/null 2>&1; then
		dirname "$(command -v initdb)"
	else
		return 1
	fi
}

# pgrl_apt_install PKG... installs Debian packages (root only), running
# apt-get update once per shell.
pgrl_apt_install() {
	[[ $(id -u) == 0 ]] || pgrl_die "need root to install $*; install it yourself" || return 1
	command -v apt-get >/dev/null 2>&1 || pgrl_die "no apt-get to install $*; install it yourself" || return 1
	if [[ -z ${PGRL_APT_UPDATED:-} ]]; then
		pgrl_log "apt-get update"
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
		PGRL_APT_UPDATED=1
	fi
	pgrl_log "apt-get install $*"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# pgrl_as_postgres CMD... runs a command as the postgres user when root
# (initdb and postgres refuse to run as root), else as the current user.
pgrl_as_postgres() {
	if [[ $(id -u) == 0 ]]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

# pgrl_psql ARGS... runs psql (from PATH or the server binaries).
pgrl_psql() {
	local psql
	psql=$(command -v psql 2>/dev/null || true)
	if [[ -z $psql ]]; then
		local bindir
		bindir=$(pgrl_pg_bindir) || true
		[[ -n $bindir && -x $bindir/psql ]] && psql=$bindir/psql
	fi
	if [[ -z $psql ]]; then
		pgrl_apt_install postgresql-client || return 1
		psql=$(command -v psql)
	fi
	"$psql" "$@"
}

# pgrl_start_local_postgres PORT initialises (once) and starts a cluster
# listening on 127.0.0.1:PORT.
pgrl_start_local_postgres() {
	local port=$1 bindir dir
	bindir=$(pgrl_pg_bindir) || {
		pgrl_apt_install postgresql || return 1
		# Debian's package may have started a cluster of its own on 5432.
		if pgrl_reachable 127.0.0.1 "$port"; then return 0; fi
		bindir=$(pgrl_pg_bindir) || pgrl_die "PostgreSQL installed but no initdb found" || return 1
	}
	dir=$PGRL_REPO_ROOT/.pgdata/$port
	mkdir -p "$dir"
	chmod 0700 "$dir"
	if [[ $(id -u) == 0 ]]; then
		chown postgres: "$dir"
		if ! runuser -u postgres -- test -w "$dir"; then
			# The repository is not reachable by the postgres user (a
			# private home directory): keep the cluster in /tmp instead.
			dir=${TMPDIR:-/tmp}/pgrl-pgdata-$port
			mkdir -p "$dir" && chmod 0700 "$dir" && chown postgres: "$dir"
		fi
	fi
	if [[ ! -f $dir/PG_VERSION ]]; then
		pgrl_log "initdb $dir"
		pgrl_as_postgres "$bindir/initdb" -D "$dir" -A trust -U postgres --no-sync >/dev/null
	fi
	pgrl_log "starting PostgreSQL on 127.0.0.1:$port ($dir)"
	pgrl_as_postgres "$bindir/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
		-o "-p $port -c listen_addresses=127.0.0.1 -k $dir" start >/dev/null ||
		pgrl_die "PostgreSQL did not start; see $dir/server.log"
}

# pgrl_ensure_postgres makes sure the test database answers and exists.
pgrl_ensure_postgres() {
	local url admin
	url=$(pgrl_db_url)
	pgrl_parse_url "$url"
	if ! pgrl_reachable "$PGRL_DB_HOST" "$PGRL_DB_PORT"; then
		case $PGRL_DB_HOST in
		127.0.0.1 | localhost | ::1) ;;
		*)
			pgrl_die "the test database at $PGRL_DB_HOST:$PGRL_DB_PORT is unreachable; start it, or unset PGRL_TEST_DATABASE_URL to use a local server"
			return 1
			;;
		esac
		pgrl_start_local_postgres "$PGRL_DB_PORT" || return 1
	fi
	# Create the database when missing, connected to the maintenance database.
	local base=${url%%\?*} query="" hostpart
	[[ $url == *\?* ]] && query="?${url#*\?}"
	hostpart=${base#*://}
	hostpart=${hostpart%%/*}
	admin="${base%%://*}://$hostpart/postgres$query"
	if ! pgrl_psql "$admin" -XAtqc "SELECT 1 FROM pg_database WHERE datname = '$PGRL_DB_NAME'" | grep -q 1; then
		pgrl_log "creating database $PGRL_DB_NAME"
		pgrl_psql "$admin" -Xqv ON_ERROR_STOP=1 -c "CREATE DATABASE \"$PGRL_DB_NAME\"" >/dev/null
	fi
}
