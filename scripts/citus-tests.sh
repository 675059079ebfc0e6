#!/usr/bin/env bash
# The Citus leg of the tests: the tests that send SQL and make sense on a
# distributed cluster, run against PGRL_TEST_DATABASE_URL, which must name
# a Citus coordinator's database (bash scripts/citus.sh up prints one; add
# options=-c citus.shard_count=4 so that the schema every test makes stays
# small). .ci/run starts the cluster, runs this and stops the cluster.
#
#   url=$(bash scripts/citus.sh up)
#   PGRL_TEST_DATABASE_URL="$url&options=-c%20citus.shard_count%3D4" bash scripts/citus-tests.sh
#   bash scripts/citus.sh down
#
# Extra arguments go to every go test run (-v, for instance). It runs every
# group and exits 1 when one failed.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
[[ -n ${PGRL_TEST_DATABASE_URL:-} ]] ||
	{ pgrl_die "set PGRL_TEST_DATABASE_URL to the Citus coordinator's test database (bash scripts/citus.sh up prints it)"; exit 2; }
export PGRL_TEST_DATABASE_URL
if [[ $(pgrl_psql "$PGRL_TEST_DATABASE_URL" -XAtc "SELECT count(*) FROM pg_extension WHERE extname = 'citus'" 2>/dev/null) != 1 ]]; then
	pgrl_die "no citus extension in the database at PGRL_TEST_DATABASE_URL: this leg tests Citus and will not pass without it"
	exit 1
fi

failed=()
group() { # group NAME PACKAGE RUN-REGEX
	local name=$1 pkg=$2 run=$3
	pgrl_log "--- Citus: $name ($pkg -run '$run')"
	go test -count=1 -short -timeout 10m -run "$run" "$pkg" "${@:4}" || failed+=("$name")
}

# Distribution itself and rl-migrate on Citus.
group migration ./migration/ '^(TestCitus.*|TestUpCreatesUnloggedTablesAndRoundTrips|TestUpToAndDownSteps|TestLayoutSwitchKeepsLiveRowsAndUnloggedPartitions|TestConcurrentUpInOneProcess)$' "$@"
group rl-migrate ./cmd/rl-migrate/ '^(TestCitus.*)$' "$@"
# The three algorithms, coalescing, check queues, AllowAll, AllowUpTo.
group algorithms ./ratelimit/ '^(TestFixedWindowSequence|TestFixedWindowPenalty|TestTokenBucketSequence|TestTokenBucketPenalty|TestSlidingWindowSequence|TestCoalescedMatchesSequentialReplay|TestBatchesMatchSingleChecks|TestSharedStatementsMatchSingleChecks|TestAllowUpToGrantsWhatIsLeft|TestAllowUpToConcurrentNeverOverGrants|TestAllowAllOrNothing|TestAllowAllSameAlgorithm|TestAllowTx|TestAllowAllTx)$' "$@"
group gen ./gen/ '^(Example.*)$' "$@"
# Policies and overrides.
group policy ./policy/ '^(TestSetGetListDelete|TestStoredKeyInSQL|TestOverridesAndExplain|TestLimiterFollowsPolicyChanges|TestChangedPolicyReloadedOnce|TestPolicyNewWindowStartsAfresh)$' "$@"
# Both cleanup modes.
group cleanup ./cleanup/ '^(TestCitus.*|TestDryRunCountsAndDeletesNothing|TestPartitionDryRunDropsNothing|TestPartitionModeDropsPastPartitionWhileChecksRun|TestSecondRunIsSkippedWhileFirstHoldsTheLock)$' "$@"
# Several OS processes on one key: exactly the limit admitted.
group multiprocess ./tests/ '^(TestMultiprocessExactlyTheLimit|TestMultiprocessPenaltyCountsEveryAttempt|TestMultiConcurrentOverlappingNoDeadlock|TestPolicyMultiprocessExact|TestAppLoginLimitSharedByTwoProcesses)$' "$@"

if [[ ${#failed[@]} -gt 0 ]]; then
	pgrl_log "Citus: failed: ${failed[*]}"
	exit 1
fi
pgrl_log "Citus: every group passed"
