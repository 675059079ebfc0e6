package migration

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/pgerr"
)

// On Citus (distributed PostgreSQL), pgrl's tables are spread over the
// cluster when the citus extension exists in the database: the counter
// tables are distributed by key, colocated with each other, so that every
// check touches one shard; the partition settings are a reference table,
// copied to every node; the policy tables stay ordinary tables of the
// coordinator (CoordinatorTables says why). A plain counter table on a
// Citus coordinator would work, but silently: every check would run on the
// coordinator alone, which is what Citus was brought in to avoid. So Up,
// UpTo, SetLayout and the test helper of this repository distribute without
// being asked, through Distribute.

// Kinds of Distribution.
const (
	// DistributionLocal is an ordinary table of the node it is on (always,
	// without Citus).
	DistributionLocal = "local"
	// DistributionDistributed is a table hash-distributed over shards.
	DistributionDistributed = "distributed"
	// DistributionReference is a table copied to every node.
	DistributionReference = "reference"
	// DistributionCitusLocal is a table Citus knows but keeps on the
	// coordinator (a "Citus local table").
	DistributionCitusLocal = "citus_local"
)

// DistributedTables are the tables Distribute distributes by their key
// column, colocated with each other: the counters every check writes.
var DistributedTables = []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"}

// ReferenceTables are the tables Distribute makes reference tables: small,
// written rarely, read by the partition functions.
var ReferenceTables = []string{"pgrl_partition_settings"}

// CoordinatorTables are the tables that stay ordinary tables of the
// coordinator: the policies and their overrides. Their triggers keep
// updated_at, guard the key mode and NOTIFY the processes that cache
// policies, which listen on the coordinator; on a reference table Citus
// would fire them on every node's placement, under the shard's name, and
// refuses the sub-selects that writing a policy uses. Checks never read
// them: a policy limiter caches its policy and checks with plain takes (a
// check that reads its policy in the statement is refused by Citus, with
// ratelimit.ErrUnsupported). Distribute turns a reference table of these
// back into an ordinary one.
var CoordinatorTables = []string{"pgrl_policy", "pgrl_policy_override"}

// DistributionColumn is the column the counter tables are distributed by.
const DistributionColumn = "key"

// StepFunctions are the algorithms' step functions (migration 000012), which
// Distribute pins to their schema with SET search_path on Citus. On one
// PostgreSQL the planner inlines them into every statement, which is what
// makes them cheap. On Citus the coordinator would inline them too and send
// each worker the deparsed result, in which every call in an update arm is
// spelled out in full (38 KB for the sliding window), for the worker to
// parse and plan on every check. A function with a setting of its own is
// never inlined: the coordinator sends the call, and the worker runs the
// function, whose search_path lets its body find the step types. The
// sliding window's statements call its step at a window start
// (pgrl_sliding_window_take_at, migration 000022), pinned likewise. The token
// bucket's lease helpers that statements send to workers (migration 000016)
// are pinned too: their bodies call pgrl_token_bucket_lease_us, which a
// worker's session, whose search_path does not hold the schema, would not
// find.
var StepFunctions = []string{"pgrl_fixed_window_take", "pgrl_token_bucket_take", "pgrl_sliding_window_take",
	"pgrl_sliding_window_take_at", "pgrl_token_bucket_leased", "pgrl_token_bucket_lease_over_at",
	"pgrl_token_bucket_lease_epoch_us"}

// Distribution is how Citus stores one of pgrl's tables.
type Distribution struct {
	// Table is the table's name.
	Table string `json:"table"`
	// Kind is DistributionLocal, DistributionDistributed,
	// DistributionReference or DistributionCitusLocal.
	Kind string `json:"kind"`
	// Column is the distribution column of a distributed table.
	Column string `json:"column,omitempty"`
	// Shards is how many shards a distributed table has (1 for a reference
	// table).
	Shards int `json:"shards,omitempty"`
	// ColocationID is Citus's colocation group of a distributed table:
	// tables with the same one keep the same keys on the same node.
	ColocationID int `json:"colocation_id,omitempty"`
}

// String is "distributed by key, 32 shards", "reference", "local", ….
func (d Distribution) String() string {
	switch d.Kind {
	case DistributionDistributed:
		return fmt.Sprintf("distributed by %s, %d shards, colocation %d", d.Column, d.Shards, d.ColocationID)
	case DistributionCitusLocal:
		return "Citus local table (coordinator only)"
	}
	return d.Kind
}

// Querier is what Distribute and Distributions need of a connection: a
// *pgx.Conn, a pgx.Tx or a pool.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// HasCitus reports whether the citus extension exists in the database.
func HasCitus(ctx context.Context, q Querier) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')").Scan(&ok)
	return ok, err
}

// Distributions reports how each of pgrl's tables that exists in schemaName
// is stored, counters first. Without the citus extension every table is
// DistributionLocal.
func Distributions(ctx context.Context, q Querier, schemaName string) ([]Distribution, error) {
	citus, err := HasCitus(ctx, q)
	if err != nil {
		return nil, err
	}
	return existing(ctx, q, schemaName, slices.Concat(DistributedTables, ReferenceTables, CoordinatorTables), citus)
}

// distributionOf reads Citus's metadata for one table (the extension exists).
func distributionOf(ctx context.Context, q Querier, schemaName, table string) (Distribution, error) {
	d := Distribution{Table: table, Kind: DistributionLocal}
	var method, model string
	var column *string
	var shards, colocation int
	err := q.QueryRow(ctx, `SELECT p.partmethod::text, p.repmodel::text,
	       CASE WHEN p.partmethod = 'h' THEN pg_catalog.column_to_column_name(p.logicalrelid, p.partkey) END,
	       (SELECT count(*)::int FROM pg_catalog.pg_dist_shard AS s WHERE s.logicalrelid = p.logicalrelid),
	       p.colocationid::int
	  FROM pg_catalog.pg_dist_partition AS p WHERE p.logicalrelid = $1::regclass`, qualified(schemaName, table)).
		Scan(&method, &model, &column, &shards, &colocation)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return d, nil
	case err != nil:
		return d, err
	}
	switch {
	case method == "h":
		d.Kind, d.Shards, d.ColocationID = DistributionDistributed, shards, colocation
		if column != nil {
			d.Column = *column
		}
	case method == "n" && model == "t":
		d.Kind, d.Shards = DistributionReference, shards
	case method == "n":
		d.Kind = DistributionCitusLocal
	}
	return d, nil
}

// Distribute distributes pgrl's tables in schemaName when the citus
// extension exists in the database, and does nothing otherwise: the counter
// tables (DistributedTables) by key, colocated with each other, with
// create_distributed_table (not its _concurrently form, which refuses
// UNLOGGED tables), the partition settings (ReferenceTables) with
// create_reference_table, and it turns CoordinatorTables that an earlier
// version distributed back into ordinary tables; it pins the StepFunctions
// to schemaName. Tables already where they belong, functions already
// pinned, and tables that do not exist, are left alone, so it is
// idempotent; it returns the tables it changed. It runs on q as given: inside the caller's transaction when q is
// one. The shard count is Citus's (citus.shard_count, 32 by default; a
// session may set another).
//
// The counter tables carry no triggers; citus.enable_unsafe_triggers is on
// for Distribute's own transaction only, so that a schema whose policy
// tables an earlier version made reference tables can be turned back.
//
// Citus breaks a distributed deadlock (40P01) by cancelling one of its
// transactions, which may be Distribute's while another process distributes
// tables at the same time (another instance's rl-migrate up, or tests that
// each distribute a schema of their own). When Distribute runs its own
// transaction, nothing of a cancelled one remains, and it starts again from
// what is left to do, up to distributeAttempts times in all, after a short
// random pause. Inside the caller's transaction the deadlock aborted that
// transaction too, so the error is returned.
func Distribute(ctx context.Context, q Querier, schemaName string) ([]string, error) {
	if _, inTx := q.(pgx.Tx); inTx {
		return distributeOnce(ctx, q, schemaName)
	}
	for attempt := 1; ; attempt++ {
		changed, err := distributeOnce(ctx, q, schemaName)
		if attempt == distributeAttempts || !pgerr.IsDeadlock(err) {
			return changed, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(time.Duration(attempt*50+rand.IntN(50)) * time.Millisecond):
		}
	}
}

// distributeAttempts is how many times Distribute runs its transaction
// when Citus cancels it to break a deadlock.
const distributeAttempts = 5

// distributeOnce is one attempt of Distribute.
func distributeOnce(ctx context.Context, q Querier, schemaName string) ([]string, error) {
	citus, err := HasCitus(ctx, q)
	if err != nil || !citus {
		return nil, err
	}
	var changed []string
	colocateWith := ""
	var pending []string
	counters, err := existing(ctx, q, schemaName, DistributedTables, true)
	if err != nil {
		return nil, err
	}
	for _, d := range counters {
		t := d.Table
		switch d.Kind {
		case DistributionDistributed:
			if colocateWith == "" {
				colocateWith = qualified(schemaName, t)
			}
		case DistributionLocal:
			pending = append(pending, t)
		default:
			return nil, fmt.Errorf("pgrl migration: %s is a %s; pgrl distributes it by %s: undistribute it (SELECT undistribute_table('%s')) and run up again",
				qualified(schemaName, t), d, DistributionColumn, qualified(schemaName, t))
		}
	}
	configs, err := existing(ctx, q, schemaName, ReferenceTables, true)
	if err != nil {
		return nil, err
	}
	var refs []string
	for _, d := range configs {
		if d.Kind == DistributionLocal {
			refs = append(refs, d.Table)
		}
	}
	policies, err := existing(ctx, q, schemaName, CoordinatorTables, true)
	if err != nil {
		return nil, err
	}
	var locals []string
	for _, d := range policies {
		if d.Kind != DistributionLocal {
			locals = append(locals, d.Table)
		}
	}
	steps, err := unpinnedSteps(ctx, q, schemaName)
	if err != nil {
		return nil, err
	}
	if len(pending) == 0 && len(refs) == 0 && len(locals) == 0 && len(steps) == 0 {
		return nil, nil
	}
	run := func(q Querier) error {
		if _, err := q.Exec(ctx, "SET LOCAL citus.enable_unsafe_triggers TO on"); err != nil {
			return err
		}
		for _, f := range steps {
			if _, err := q.Exec(ctx, "ALTER FUNCTION "+f+" SET search_path = "+pgx.Identifier{schemaName}.Sanitize()); err != nil {
				return fmt.Errorf("pin %s to schema %s: %w", f, schemaName, err)
			}
		}
		for _, t := range locals {
			var still bool
			if err := q.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition WHERE logicalrelid = $1::regclass)",
				qualified(schemaName, t)).Scan(&still); err != nil {
				return err
			}
			if !still { // undistributed with the other one, by their foreign key
				continue
			}
			if _, err := q.Exec(ctx, "SELECT pg_catalog.undistribute_table($1::regclass, cascade_via_foreign_keys => true)",
				qualified(schemaName, t)); err != nil {
				return fmt.Errorf("make %s an ordinary table of the coordinator again: %w", qualified(schemaName, t), err)
			}
			changed = append(changed, t)
		}
		for _, t := range refs {
			if _, err := q.Exec(ctx, "SELECT pg_catalog.create_reference_table($1::regclass)", qualified(schemaName, t)); err != nil {
				return fmt.Errorf("make %s a reference table: %w", qualified(schemaName, t), err)
			}
			changed = append(changed, t)
		}
		for _, t := range pending {
			with := colocateWith
			if with == "" {
				with = "default"
			}
			if _, err := q.Exec(ctx, "SELECT pg_catalog.create_distributed_table($1::regclass, $2, colocate_with => $3)",
				qualified(schemaName, t), DistributionColumn, with); err != nil {
				return fmt.Errorf("distribute %s by %s: %w", qualified(schemaName, t), DistributionColumn, err)
			}
			if colocateWith == "" {
				colocateWith = qualified(schemaName, t)
			}
			changed = append(changed, t)
		}
		return nil
	}
	if tx, ok := q.(pgx.Tx); ok {
		err = run(tx)
	} else if b, ok := q.(interface {
		Begin(context.Context) (pgx.Tx, error)
	}); ok {
		err = pgx.BeginFunc(ctx, b, func(tx pgx.Tx) error { return run(tx) })
	} else {
		err = run(q)
	}
	if err != nil {
		return nil, fmt.Errorf("pgrl migration: %w", err)
	}
	return changed, nil
}

// existing returns the distribution of each of tables that exists in
// schemaName, in order: from Citus's metadata when citus is set, else
// DistributionLocal.
func existing(ctx context.Context, q Querier, schemaName string, tables []string, citus bool) ([]Distribution, error) {
	var out []Distribution
	for _, t := range tables {
		var exists bool
		if err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", qualified(schemaName, t)).Scan(&exists); err != nil {
			return nil, err
		}
		if !exists {
			continue
		}
		d := Distribution{Table: t, Kind: DistributionLocal}
		if citus {
			var err error
			if d, err = distributionOf(ctx, q, schemaName, t); err != nil {
				return nil, err
			}
		}
		out = append(out, d)
	}
	return out, nil
}

// unpinnedSteps returns the StepFunctions of schemaName that have no
// settings of their own (so the planner would inline them), as
// regprocedure text, in order.
func unpinnedSteps(ctx context.Context, q Querier, schemaName string) ([]string, error) {
	var steps []string
	err := q.QueryRow(ctx, `
SELECT coalesce(array_agg(p.oid::regprocedure::text ORDER BY p.proname), '{}')
  FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = $1 AND p.proname = ANY ($2) AND p.proconfig IS NULL`, schemaName, StepFunctions).Scan(&steps)
	return steps, err
}

// needsDistribution reports whether the citus extension exists and one of
// pgrl's tables in schemaName is not where Distribute puts it: a counter or
// reference table still an ordinary local table, or a policy table not one.
func needsDistribution(ctx context.Context, q Querier, schemaName string) (bool, error) {
	citus, err := HasCitus(ctx, q)
	if err != nil || !citus {
		return false, err
	}
	ds, err := Distributions(ctx, q, schemaName)
	if err != nil {
		return false, err
	}
	for _, d := range ds {
		if (d.Kind == DistributionLocal) != slices.Contains(CoordinatorTables, d.Table) {
			return true, nil
		}
	}
	steps, err := unpinnedSteps(ctx, q, schemaName)
	return len(steps) > 0, err
}

// undistribute makes a distributed table local again (undistribute_table,
// which copies its rows back to the coordinator), when the citus extension
// exists and the table is distributed; otherwise it does nothing.
func undistribute(ctx context.Context, q Querier, schemaName, table string) error {
	citus, err := HasCitus(ctx, q)
	if err != nil || !citus {
		return err
	}
	d, err := distributionOf(ctx, q, schemaName, table)
	if err != nil || d.Kind == DistributionLocal {
		return err
	}
	_, err = q.Exec(ctx, "SELECT pg_catalog.undistribute_table($1::regclass)", qualified(schemaName, table))
	return err
}
