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

# What runs on Citus today, and is held to it here. Not yet on Citus, and
# so not run here (docs/SCALING.md, "Not yet on Citus", says why and what
# each needs): checks that read their stored
# policy in the statement (ratelimit.Config.Policy: Citus refuses it),
# rl-migrate down (Citus's DDL
# propagation refuses some steps and breaks others as distributed
# deadlocks, 40P01), and dropping a partition while checks run.

# Distribution itself and rl-migrate on Citus.
group migration ./migration/ '^(TestCitus.*|TestLayoutSwitchKeepsLiveRowsAndUnloggedPartitions|TestConcurrentUpInOneProcess)$' "$@"
group rl-migrate ./cmd/rl-migrate/ '^(TestCitus.*)$' "$@"
# The three algorithms' statements, check queues, coalesced batches (Citus
# refuses the set-based …TakeMany, 42P18, and the coalescer then sends every
# batch as a check queue; TestCoalescedMatchesSequentialReplay is not here:
# it also asserts that 64 callers did coalesce, which on Citus's slow
# statements beside other work they did not always), AllowUpTo, AllowAll of one algorithm and of
# several (AllOrNothing runs in a transaction of its own there), the …Tx
# forms.
group algorithms ./ratelimit/ '^(TestBatchMatchesModel|TestBatchesMatchSingleChecks|TestRunsMatchSingleChecks|TestCoalescingOnWrappedPool|TestFixedWindowSequence|TestFixedWindowPenalty|TestTokenBucketSequence|TestTokenBucketPenalty|TestSlidingWindowSequence|TestSharedStatementsMatchSingleChecks|TestAllowUpToGrantsWhatIsLeft|TestAllowUpToConcurrentNeverOverGrants|TestAllowAllSameAlgorithm|TestAllowAllOrNothing|TestAllowTx|TestAllowAllTx|TestStepVectorsSQL|TestSlice.*)$' "$@"
group gen ./gen/ '^(Example|ExampleQueries_TokenBucketTake_transaction)$' "$@"
# Policies and overrides: written through package policy and in plain SQL
# (the policy tables stay ordinary tables of the coordinator, where their
# triggers and NOTIFY work), their rules, and applied by policy limiters,
# which on Citus check with the cached policy (a check that reads its policy
# in the statement does not run there).
group policy ./policy/ '^(TestCitus.*|TestHasOverrides.*|TestApplicationRoleReadsOnly|TestPermissionNamesTheGrant|TestSetGetListDelete|TestBadInputRefused|TestConfigRulesAreTheTablesRules|TestStoredKeyInSQL|TestOverridesAndExplain|TestLimiterFollowsPolicyChanges|TestKeyModeChangeWithOverridesRefused|TestKeyModeChangeWithOverridesRefusedInSQL)$' "$@"
# Quota leases: slices sized by the statement, returns to their window,
# penalty, stored policies; across OS processes, never over the limit,
# and a holder killed with SIGKILL.
group lease ./lease/ '.' "$@"
# Both cleanup modes.
group cleanup ./cleanup/ '^(TestCitus.*|TestDryRunCountsAndDeletesNothing|TestPartitionDryRunDropsNothing|TestSecondRunIsSkippedWhileFirstHoldsTheLock)$' "$@"
# Several OS processes on one key of a distributed table: exactly the limit
# admitted (4 processes × 50 calls, limit 20, every algorithm), and every
# attempt counted under penalty.
group multiprocess ./tests/ '^(TestMultiprocessExactlyTheLimit|TestMultiprocessPenaltyCountsEveryAttempt|TestMultiSingleAlgorithmConsumes|TestMultiBadInputsConsumeNothing|TestLeaseMultiprocess.*)$' "$@"
# Concurrency limits: pgrl_concurrency stays a table of the coordinator
# (not distributed yet: docs/CONCURRENCY.md), and acquires, releases,
# extensions and lapses work there beside the distributed counters.
group concurrency ./ratelimit/ '^(TestAcquire.*|TestSlotLeaseLapsesAndIsExtended|TestConcurrencyRefusals|TestDroppedSlotIsReleased)$' "$@"

if [[ ${#failed[@]} -gt 0 ]]; then
	pgrl_log "Citus: failed: ${failed[*]}"
	exit 1
fi
pgrl_log "Citus: every group passed"
