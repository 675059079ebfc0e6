#!/usr/bin/env bash
# Runs the tests that talk SQL on other PostgreSQL majors, each on a server
# of its own started by scripts/pg.sh: the migration, cleanup, ratelimit and
# policy packages, rl-migrate, rl-cleanup and rl-policy, the multi-process
# tests, and a smoke
# run of both commands (up, layout partitioned, cleanup in both modes, down
# --all). Without the race detector and with -short (the 30 s multi-limit
# soak runs 5 s; a memory-only test that allocates 150 MB is left out), to
# keep CI within its time: the full race-enabled suite runs on the default
# server (scripts/test.sh).
#
#   bash scripts/matrix.sh              # every major in scripts/pg-versions.txt
#   bash scripts/matrix.sh 13 17        # those majors
#   bash scripts/matrix.sh --skip 15    # every major but 15
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

skip=""
majors=()
while [[ $# -gt 0 ]]; do
	case $1 in
	--skip)
		skip=${2:?--skip needs a major}
		shift 2
		;;
	-h | --help)
		sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*)
		majors+=("$1")
		shift
		;;
	esac
done
if [[ ${#majors[@]} -eq 0 ]]; then
	mapfile -t majors < <(bash scripts/pg.sh versions)
fi

# The packages whose tests send SQL, and the multi-process tests.
sql_pkgs=(./migration/... ./cleanup/... ./ratelimit/... ./metrics/... ./policy/... ./cmd/rl-migrate/... ./cmd/rl-cleanup/... ./cmd/rl-policy/...)
multi_run='^(TestMultiprocess|TestMultiConcurrent|TestMultiSingleAlgorithm|TestMultiBadInputs|TestPolicyTwoProcesses)'

bin=$(mktemp -d)
current=""
# Stopped or interrupted, leave no server running; stopping it waits until
# it has exited, and never changes the exit status.
stop_current() {
	[[ -z $current ]] || bash scripts/pg.sh "$current" stop
	pgrl_remove_dir "$bin"
}
trap 'pgrl_exit_trap stop_current' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
go build -o "$bin/" ./cmd/rl-migrate ./cmd/rl-cleanup

# expect NAME JSON PATTERN fails unless the command's JSON output contains PATTERN.
expect() {
	if ! grep -qF -- "$3" <<<"$2"; then
		printf 'smoke: %s: want %s in:\n%s\n' "$1" "$3" "$2" >&2
		return 1
	fi
}

# smoke MAJOR URL runs both commands end to end, as a deploy pipeline and a
# cron would, and checks what they report.
smoke() {
	local major=$1 url=$2 out detach=concurrently
	local m=("$bin/rl-migrate" --database-url "$url" --schema pgrl_smoke --output json)
	local c=("$bin/rl-cleanup" --database-url "$url" --schema pgrl_smoke --output json)
	# DETACH … CONCURRENTLY exists from PostgreSQL 14 on.
	[[ $major -lt 14 ]] && detach=plain
	out=$("${m[@]}" up 2>/dev/null)
	expect "rl-migrate up" "$out" '"changed":true'
	out=$("${m[@]}" layout partitioned --partition-width 1h 2>/dev/null)
	expect "rl-migrate layout" "$out" '"layout":"partitioned"'
	out=$("${c[@]}" 2>/dev/null)
	expect "rl-cleanup (delete mode)" "$out" '"mode":"delete"'
	out=$("${c[@]}" --mode partitions --horizon 3h 2>/dev/null)
	expect "rl-cleanup --mode partitions" "$out" "\"detach\":\"$detach\""
	out=$("${m[@]}" down --all 2>/dev/null)
	expect "rl-migrate down --all" "$out" '"to":0'
	out=$("${m[@]}" status 2>/dev/null)
	expect "rl-migrate status after down --all" "$out" '"version":0'
}

ran=() failed=()
for major in "${majors[@]}"; do
	[[ $major == "$skip" ]] && continue
	start=$SECONDS
	echo "--- PostgreSQL $major"
	current=$major
	if ! url=$(bash scripts/pg.sh "$major" start); then
		echo "PostgreSQL $major: FAILED to start" >&2
		bash scripts/pg.sh "$major" stop || true
		current=""
		failed+=("$major")
		continue
	fi
	status=0
	PGRL_TEST_DATABASE_URL=$url go test -count=1 -short -timeout 30m "${sql_pkgs[@]}" || status=1
	PGRL_TEST_DATABASE_URL=$url go test -count=1 -short -timeout 30m -run "$multi_run" ./tests/ || status=1
	smoke "$major" "$url" || status=1
	bash scripts/pg.sh "$major" stop
	current=""
	if [[ $status != 0 ]]; then
		echo "PostgreSQL $major: FAILED after $((SECONDS - start)) s" >&2
		failed+=("$major")
		continue
	fi
	echo "PostgreSQL $major: passed in $((SECONDS - start)) s"
	ran+=("$major")
done
echo "majors passed: ${ran[*]:-none}"
if [[ ${#failed[@]} -gt 0 ]]; then
	echo "majors FAILED: ${failed[*]}" >&2
	exit 1
fi
