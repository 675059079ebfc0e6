// Package cleanup removes pgrl counter rows that can no longer change any
// decision, for applications that call it themselves and for rl-cleanup.
//
// A row is dead when its fixed window has ended, when its token bucket would
// be full again, when its sliding-window state is older than two windows, or
// when every slot of its concurrency limit has lapsed, judged at the run's
// cutoff: the database clock, held back to the start of the oldest open
// transaction of the database (a transaction decides at its start), by at
// most Options.MaxGrace.
// Run deletes dead rows in bounded batches (ModeDelete), or, for the
// partitioned layout of pgrl_fixed_window, drops whole partitions whose range
// lies in the past and creates upcoming ones (ModePartitions). Either way it
// never touches a row a check can still read or write, holds no lock longer
// than one short statement, and stops between batches when its context is
// cancelled or MaxDuration has passed.
//
// Two runs against the same schema never work at once: Run takes a
// session-level advisory lock and, when another run holds it, returns at once
// with Result.Skipped set.
//
// Opportunistic runs a small cleanup from inside the request path, on about
// one check in N, for applications that have no cron.
//
// Its statements read and pass instants as microseconds since the Unix
// epoch, and the partition functions of migration 000011 run with fixed
// text settings, so no DateStyle, TimeZone or pgx exec mode of the session
// changes what a run judges dead.
package cleanup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// Mode selects how Run removes dead fixed-window rows.
type Mode int

const (
	// ModeDelete deletes dead rows in batches from every table. It is the
	// default and works with both layouts of pgrl_fixed_window.
	ModeDelete Mode = iota
	// ModePartitions needs the partitioned layout: it creates partitions
	// ahead up to Horizon, drops the partitions of pgrl_fixed_window whose
	// whole range is past, and deletes dead rows from the other tables
	// (token buckets, sliding windows, request ids, concurrency slots).
	ModePartitions
)

// String returns "delete" or "partitions".
func (m Mode) String() string {
	switch m {
	case ModeDelete:
		return "delete"
	case ModePartitions:
		return "partitions"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// ParseMode parses "delete" or "partitions".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "delete":
		return ModeDelete, nil
	case "partitions":
		return ModePartitions, nil
	}
	return 0, fmt.Errorf("%w: unknown mode %q; use delete or partitions", ErrInvalidOptions, s)
}

// Defaults applied by Run to zero-valued Options fields.
const (
	DefaultBatchSize        = 5000
	DefaultHorizon          = 24 * time.Hour
	DefaultLockTimeout      = time.Second
	DefaultStatementTimeout = 30 * time.Second
	DefaultMaxGrace         = 15 * time.Minute
)

// MaxPartitionsAhead is the most partitions of pgrl_fixed_window that a
// ModePartitions run keeps from now to now + Horizon; a horizon that would
// need more is refused with ErrInvalidOptions. Every partition is a relation
// that a query on the whole table locks, and the lock table is shared by
// every database of the server. Partitions are made in transactions of at
// most this many. It equals migration.MaxPartitions.
const MaxPartitionsAhead = 64

// Table names, as they appear in Result and in progress reports.
const (
	TableFixedWindow   = "pgrl_fixed_window"
	TableTokenBucket   = "pgrl_token_bucket"
	TableSlidingWindow = "pgrl_sliding_window"
	// TableRequests holds the answers of checks with a request id
	// (ratelimit.RequestID, migration 000017).
	TableRequests = "pgrl_request"
	// TableConcurrency holds the slots of concurrency limits
	// (ratelimit.Concurrency, migration 000019).
	TableConcurrency = "pgrl_concurrency"
)

// Errors returned by Run. Each message names the fix; test with errors.Is.
var (
	// ErrInvalidOptions: an Options field is out of range. Nothing was done.
	ErrInvalidOptions = errors.New("invalid cleanup options")
	// ErrNotMigrated: pgrl's tables are missing from the search_path. It
	// is the same value as ratelimit.ErrNotMigrated and
	// migration.ErrNotMigrated. Run returns it wrapped in an error whose
	// message names the database, the user and the schema it looked in.
	ErrNotMigrated = notmigrated.Err
	// ErrPermission: the role running the cleanup lacks a grant it needs
	// (SQLSTATE 42501, or a schema without USAGE, which hides the tables).
	// The message names the role and the grant. Nothing was done, unless
	// the database refused a statement part-way (a grant revoked during the
	// run): the Result then says what was. It is the same value as
	// ratelimit.ErrPermission, policy.ErrPermission and
	// migration.ErrPermission, so errors.Is matches any of them.
	ErrPermission = pgerr.ErrPermission
	// ErrPlainLayout: ModePartitions was asked for, but pgrl_fixed_window uses
	// the plain layout.
	ErrPlainLayout = errors.New("pgrl_fixed_window is not partitioned; run `rl-migrate layout partitioned` first, or use delete mode")
)

// Options configures Run. The zero value is a delete-mode run with the
// defaults below.
type Options struct {
	// Mode is ModeDelete (the default) or ModePartitions.
	Mode Mode
	// BatchSize is the most rows one DELETE statement removes. Defaults to
	// DefaultBatchSize (5000). Must not be negative.
	BatchSize int
	// MaxBatches stops each table after this many batches. Defaults to 0: no
	// limit. Opportunistic sets it to 1.
	MaxBatches int
	// MaxDuration stops the run between batches once it has run this long.
	// Defaults to 0: no limit. Must not be negative.
	MaxDuration time.Duration
	// DryRun counts what would be deleted, created and dropped, and changes
	// nothing.
	DryRun bool
	// Horizon is how far ahead of now ModePartitions creates partitions
	// (it has nothing to do with Result.Cutoff):
	// at least the longest fixed window of any limiter plus the time between
	// two runs, so that every check finds its partition. It may span at most
	// MaxPartitionsAhead - 1 partition widths (ErrInvalidOptions otherwise).
	// Defaults to DefaultHorizon (24h). Must not be negative.
	Horizon time.Duration
	// LockTimeout is the session's lock_timeout: the longest any statement
	// of the run waits for a lock. Defaults to DefaultLockTimeout (1s).
	LockTimeout time.Duration
	// StatementTimeout is the session's statement_timeout: the longest any
	// one statement of the run (a batch, a DETACH, a VACUUM) may take.
	// Defaults to DefaultStatementTimeout (30s).
	StatementTimeout time.Duration
	// BatchPause is slept between batches to leave more of the server to
	// the checks. Defaults to 0.
	BatchPause time.Duration
	// Vacuum runs VACUUM (SKIP_LOCKED) on every table the run deleted rows
	// from, so their space is reused at once. Defaults to false: the tables'
	// own autovacuum settings normally do this within a minute or two.
	Vacuum bool
	// Logger receives a line per batch (debug) and a summary (info).
	// Defaults to discarding everything.
	Logger *slog.Logger
	// Progress, when set, is called after every batch and every partition
	// dropped, from the goroutine running Run.
	Progress func(Progress)
	// MaxGrace bounds how far open transactions hold the run back. A
	// transaction decides at its start (now()), so rows it can still read
	// are kept until it ends: the run removes only rows dead at the start of
	// the oldest open transaction of the database (Result.Cutoff). A
	// transaction open for longer than MaxGrace (a session left idle in a
	// transaction) holds it back no further than MaxGrace before now; a
	// check it makes afterwards may then count from an empty row. The run
	// also falls back to MaxGrace before now when sessions of other roles
	// have open transactions whose start it is not allowed to see (grant
	// pg_read_all_stats to its role to avoid that). Defaults to
	// DefaultMaxGrace (15m). Must not be negative.
	MaxGrace time.Duration
	// At pins the instant up to which rows and partitions are dead, for
	// tests only; production leaves it nil and the database clock and the
	// open transactions decide (see MaxGrace).
	At *time.Time
}

// Progress reports how far a run has got.
type Progress struct {
	// Table is the table being worked on.
	Table string
	// Deleted is how many rows the run has deleted from Table so far.
	Deleted int64
	// Batches is how many batches have run on Table so far.
	Batches int
	// PartitionsDropped is how many partitions the run has dropped so far.
	PartitionsDropped int
	// Elapsed is the time since the run started.
	Elapsed time.Duration
}

// TableResult is what a run did to one table.
type TableResult struct {
	// Deleted is how many dead rows were deleted (0 in a dry run).
	Deleted int64 `json:"deleted"`
	// WouldDelete is, in a dry run, how many dead rows the table holds.
	WouldDelete int64 `json:"would_delete"`
	// Batches is how many DELETE statements ran.
	Batches int `json:"batches"`
	// Vacuumed is true when the run vacuumed the table afterwards.
	Vacuumed bool `json:"vacuumed"`
}

// Tables holds the per-table results.
type Tables struct {
	FixedWindow   TableResult `json:"pgrl_fixed_window"`
	TokenBucket   TableResult `json:"pgrl_token_bucket"`
	SlidingWindow TableResult `json:"pgrl_sliding_window"`
	// Requests is the answers of checks with a request id
	// (ratelimit.RequestID) kept past their retention; zero where the
	// table does not exist yet (before migration 000017).
	Requests TableResult `json:"pgrl_request"`
	// Concurrency is the rows of concurrency limits (ratelimit.Concurrency)
	// whose every slot has lapsed; zero where the table does not exist yet
	// (before migration 000019) and where the run's role may not read and
	// delete it (a warning names the grant).
	Concurrency TableResult `json:"pgrl_concurrency"`
}

// Partitions is what a ModePartitions run did to pgrl_fixed_window's
// partitions.
type Partitions struct {
	// Created is how many partitions were created ahead (in a dry run: how
	// many would be).
	Created int `json:"created"`
	// Dropped names the partitions dropped (in a dry run: that would be).
	Dropped []string `json:"dropped"`
	// RowsDropped is how many rows the dropped partitions held.
	RowsDropped int64 `json:"rows_dropped"`
	// LeftoversDropped names tables left detached by an interrupted earlier
	// run, dropped now.
	LeftoversDropped []string `json:"leftovers_dropped"`
	// Detach is the form used: "concurrently" or "plain" (PostgreSQL 13, a
	// DEFAULT partition exists, or the database has the citus extension).
	Detach string `json:"detach,omitempty"`
}

// Result reports what Run did. It is filled in as far as the run got, also
// when Run returns an error.
type Result struct {
	// Mode is "delete" or "partitions".
	Mode string `json:"mode"`
	// DryRun repeats Options.DryRun.
	DryRun bool `json:"dry_run"`
	// Tables holds per-table counts.
	Tables Tables `json:"tables"`
	// Batches is the total number of DELETE statements run.
	Batches int `json:"batches"`
	// Partitions is set in ModePartitions.
	Partitions *Partitions `json:"partitions,omitempty"`
	// Duration is how long the run took.
	Duration time.Duration `json:"-"`
	// DurationMS is Duration in milliseconds.
	DurationMS int64 `json:"duration_ms"`
	// StoppedEarly is true when the run stopped before it was done, because
	// its context was cancelled or MaxDuration passed; StopReason says which.
	StoppedEarly bool `json:"stopped_early"`
	// StopReason is "cancelled", "max-duration" or "max-batches" when
	// StoppedEarly.
	StopReason string `json:"stop_reason,omitempty"`
	// Skipped is true when another cleanup of the same schema was running,
	// so this one did nothing. SkippedReason says so in words.
	Skipped bool `json:"skipped"`
	// SkippedReason explains Skipped.
	SkippedReason string `json:"skipped_reason,omitempty"`
	// Cutoff is the instant up to which rows and partitions were judged
	// dead: the database clock, or the start of the oldest open transaction
	// when that is earlier, but no more than Options.MaxGrace before the
	// clock. Zero when the run stopped before computing it (a skipped run,
	// or one that failed first); the JSON result then has no "cutoff".
	Cutoff time.Time `json:"cutoff,omitzero"`
	// CutoffHeldBy says, when Cutoff is before the database clock, what
	// held it back, such as "transaction of pid 4242 open since ...".
	CutoffHeldBy string `json:"cutoff_held_by,omitempty"`
}

// SkippedAnotherRunning is Result.SkippedReason when another cleanup holds
// the lock.
const SkippedAnotherRunning = "another rl-cleanup is running; nothing done"

// Run cleans the pgrl tables found in the pool's search_path, on one
// connection it holds for the whole run and returns to the pool with its
// session settings restored.
//
// Cancelling ctx stops the run between batches; the statement in flight
// finishes first (StatementTimeout bounds it). The Result says how far the
// run got. See RunConn for the rest.
func Run(ctx context.Context, db *pgxpool.Pool, opts Options) (Result, error) {
	if db == nil {
		return Result{}, fmt.Errorf("%w: nil pool", ErrInvalidOptions)
	}
	if err := opts.validate(); err != nil {
		return Result{}, err
	}
	pc, err := db.Acquire(ctx)
	if err != nil {
		return Result{}, err
	}
	conn := pc.Conn()
	var prevLock, prevStmt string
	if err := conn.QueryRow(context.WithoutCancel(ctx),
		"SELECT current_setting('lock_timeout'), current_setting('statement_timeout')").Scan(&prevLock, &prevStmt); err != nil {
		pc.Release()
		return Result{}, err
	}
	res, err := RunConn(ctx, conn, opts)
	rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, rerr := conn.Exec(rctx, "SELECT set_config('lock_timeout', $1, false), set_config('statement_timeout', $2, false)",
		prevLock, prevStmt); rerr != nil {
		// The session's state is unknown: do not hand it back to the pool.
		_ = pc.Hijack().Close(rctx)
		return res, err
	}
	pc.Release()
	return res, err
}

// RunConn is Run on a connection the caller owns, such as the one rl-cleanup
// opens. It sets lock_timeout and statement_timeout on the session (and
// leaves them set), takes the cleanup lock, works, and releases the lock.
//
// Before touching anything it checks that pgrl's tables exist
// (ErrNotMigrated) and, in ModePartitions, that pgrl_fixed_window is
// partitioned (ErrPlainLayout). When another cleanup of the same schema is
// running it returns at once with Result.Skipped set and a nil error.
func RunConn(ctx context.Context, conn *pgx.Conn, opts Options) (res Result, err error) {
	start := time.Now()
	res.Mode = opts.Mode.String()
	res.DryRun = opts.DryRun
	defer func() {
		res.Duration = time.Since(start)
		res.DurationMS = res.Duration.Milliseconds()
	}()
	if conn == nil {
		return res, fmt.Errorf("%w: nil connection", ErrInvalidOptions)
	}
	if err := opts.validate(); err != nil {
		return res, err
	}
	opts.setDefaults()

	r := &runner{
		conn:  conn,
		opts:  opts,
		q:     sqlops.New(),
		stop:  ctx,
		ctx:   context.WithoutCancel(ctx),
		start: start,
		res:   &res,
		log:   opts.Logger,
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	if _, err := conn.Exec(r.ctx, "SELECT set_config('lock_timeout', $1, false), set_config('statement_timeout', $2, false)",
		msString(opts.LockTimeout), msString(opts.StatementTimeout)); err != nil {
		return res, err
	}
	tables, err := r.q.CleanupTables(r.ctx, conn)
	if err != nil {
		return res, err
	}
	privs, err := r.q.CleanupPrivileges(r.ctx, conn)
	if err != nil {
		return res, err
	}
	if missing := missingTables(tables); len(missing) > 0 {
		// A schema of search_path without USAGE hides its tables: then
		// the fix is a grant, not a migration.
		if pe := pgerr.Diagnose(r.ctx, conn, cleanNeed, notmigrated.Err); pe != nil {
			return res, pe
		}
		if len(missing) == 4 {
			return res, notmigrated.At(r.ctx, conn)
		}
		return res, notmigrated.At(r.ctx, conn, missing...)
	}
	if err := checkPrivileges(privs, tables.SchemaName, opts.Mode); err != nil {
		return res, err
	}
	if opts.Mode == ModePartitions {
		if !tables.FixedWindowPartitioned {
			return res, ErrPlainLayout
		}
		step, err := r.q.FixedWindowPartitionSeconds(r.ctx, conn)
		if err != nil {
			return res, fmt.Errorf("read partition width: %w", err)
		}
		if err := checkHorizon(opts.Horizon, time.Duration(step)*time.Second); err != nil {
			return res, err
		}
		res.Partitions = &Partitions{Dropped: []string{}, LeftoversDropped: []string{}}
	}
	r.tables = tables
	r.canCleanConcurrency, r.role = privs.CanCleanConcurrency, privs.RoleName

	locked, err := r.q.CleanupTryLock(r.ctx, conn)
	if err != nil {
		return res, err
	}
	if !locked {
		res.Skipped = true
		res.SkippedReason = SkippedAnotherRunning
		r.log.Info("cleanup skipped", "reason", res.SkippedReason)
		return res, nil
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, uerr := r.q.CleanupUnlock(uctx, conn); uerr != nil {
			// A session lock outlives an error only with its session: close it.
			_ = conn.Close(uctx)
			if err == nil {
				err = fmt.Errorf("release cleanup lock: %w", uerr)
			}
		}
	}()

	if err := r.computeCutoff(); err != nil {
		return res, err
	}
	err = r.explain(r.run())
	r.log.Info("cleanup finished",
		"mode", res.Mode, "dry_run", res.DryRun,
		"fixed_window_deleted", res.Tables.FixedWindow.Deleted,
		"token_bucket_deleted", res.Tables.TokenBucket.Deleted,
		"sliding_window_deleted", res.Tables.SlidingWindow.Deleted,
		"concurrency_deleted", res.Tables.Concurrency.Deleted,
		"batches", res.Batches, "stopped_early", res.StoppedEarly,
		"elapsed", time.Since(start))
	return res, err
}

// cleanNeed is what a delete-mode run needs on the counter tables.
var cleanNeed = pgerr.Need{Tables: []string{TableFixedWindow, TableTokenBucket, TableSlidingWindow},
	Privileges: []string{"SELECT", "DELETE"}}

// explain turns a statement the database refused for want of a privilege
// (one revoked during the run, or one the checks before it do not cover)
// into an ErrPermission that names the grant. Other errors pass unchanged.
func (r *runner) explain(err error) error {
	if pe := pgerr.Diagnose(r.ctx, r.conn, cleanNeed, err); pe != nil {
		return pe
	}
	return err
}

// missingTables lists the pgrl tables cleanup needs that the search_path
// lacks.
func missingTables(t sqlops.CleanupTablesRow) []string {
	var missing []string
	for _, tbl := range []struct {
		name string
		ok   bool
	}{
		{TableFixedWindow, t.FixedWindowExists},
		{TableTokenBucket, t.TokenBucketExists},
		{TableSlidingWindow, t.SlidingWindowExists},
		{"pgrl_partition_settings", t.PartitionSettingsExists},
	} {
		if !tbl.ok {
			missing = append(missing, tbl.name)
		}
	}
	return missing
}

// checkPrivileges names the first grant the role lacks for a run in mode.
func checkPrivileges(p sqlops.CleanupPrivilegesRow, schema string, mode Mode) error {
	role := pgx.Identifier{p.RoleName}.Sanitize()
	for _, t := range []struct {
		name string
		ok   bool
	}{
		{TableFixedWindow, p.CanCleanFixedWindow},
		{TableTokenBucket, p.CanCleanTokenBucket},
		{TableSlidingWindow, p.CanCleanSlidingWindow},
	} {
		if !t.ok {
			return &pgerr.PermissionError{Role: p.RoleName, Lacks: []string{"SELECT or DELETE on " + t.name},
				Grants: []string{"GRANT SELECT, DELETE ON " + pgx.Identifier{schema, TableFixedWindow}.Sanitize() + ", " +
					pgx.Identifier{schema, TableTokenBucket}.Sanitize() + ", " + pgx.Identifier{schema, TableSlidingWindow}.Sanitize() +
					" TO " + role}}
		}
	}
	if mode != ModePartitions {
		// Delete mode reads no partition setting: it needs no right on
		// pgrl_partition_settings, whatever the layout.
		return nil
	}
	if !p.CanReadPartitionSettings {
		return &pgerr.PermissionError{Role: p.RoleName, Lacks: []string{"SELECT on pgrl_partition_settings, which partition mode reads"},
			Grants: []string{"GRANT SELECT ON " + pgx.Identifier{schema, "pgrl_partition_settings"}.Sanitize() + " TO " + role}}
	}
	if !p.OwnsFixedWindow {
		return &pgerr.PermissionError{Role: p.RoleName,
			Lacks: []string{"ownership of pgrl_fixed_window: partition mode creates and drops its partitions, " +
				"which only its owner " + p.FixedWindowOwner + " may do"},
			Grants: []string{"GRANT " + pgx.Identifier{p.FixedWindowOwner}.Sanitize() + " TO " + role},
			Hint:   "or run as " + p.FixedWindowOwner}
	}
	return nil
}

func (o *Options) validate() error {
	switch {
	case o.Mode != ModeDelete && o.Mode != ModePartitions:
		return fmt.Errorf("%w: unknown mode %d", ErrInvalidOptions, o.Mode)
	case o.BatchSize < 0:
		return fmt.Errorf("%w: batch size %d is negative; use a positive number such as %d", ErrInvalidOptions, o.BatchSize, DefaultBatchSize)
	case o.BatchSize > 1_000_000:
		return fmt.Errorf("%w: batch size %d is too large; use at most 1000000", ErrInvalidOptions, o.BatchSize)
	case o.MaxBatches < 0:
		return fmt.Errorf("%w: max batches %d is negative", ErrInvalidOptions, o.MaxBatches)
	case o.MaxDuration < 0:
		return fmt.Errorf("%w: max duration %s is negative; use a positive duration such as 2m", ErrInvalidOptions, o.MaxDuration)
	case o.Horizon < 0:
		return fmt.Errorf("%w: horizon %s is negative; use a positive duration such as 24h", ErrInvalidOptions, o.Horizon)
	case o.LockTimeout < 0:
		return fmt.Errorf("%w: lock timeout %s is negative; use a positive duration such as 1s", ErrInvalidOptions, o.LockTimeout)
	case o.LockTimeout > 0 && o.LockTimeout < time.Millisecond:
		return fmt.Errorf("%w: lock timeout %s is under 1ms; use at least 1ms", ErrInvalidOptions, o.LockTimeout)
	case o.StatementTimeout < 0:
		return fmt.Errorf("%w: statement timeout %s is negative; use a positive duration such as 30s", ErrInvalidOptions, o.StatementTimeout)
	case o.StatementTimeout > 0 && o.StatementTimeout < time.Millisecond:
		return fmt.Errorf("%w: statement timeout %s is under 1ms; use at least 1ms", ErrInvalidOptions, o.StatementTimeout)
	case o.BatchPause < 0:
		return fmt.Errorf("%w: batch pause %s is negative", ErrInvalidOptions, o.BatchPause)
	case o.MaxGrace < 0:
		return fmt.Errorf("%w: max grace %s is negative; use a positive duration such as 15m", ErrInvalidOptions, o.MaxGrace)
	}
	return nil
}

// checkHorizon refuses a horizon that needs more than MaxPartitionsAhead
// partitions of width.
func checkHorizon(horizon, width time.Duration) error {
	if width <= 0 {
		return nil
	}
	n := int64(horizon / width)
	if horizon%width != 0 {
		n++
	}
	if n+1 <= MaxPartitionsAhead {
		return nil
	}
	minWidth := (horizon + time.Duration(MaxPartitionsAhead-2)) / time.Duration(MaxPartitionsAhead-1)
	minWidth = ((minWidth + time.Second - 1) / time.Second) * time.Second
	return fmt.Errorf("%w: horizon %s (how far ahead partitions are created) needs %d partitions of %s, more than the %d allowed: shorten the horizon to at most %s, or widen the partitions (rl-migrate layout partitioned --partition-width %s or wider)",
		ErrInvalidOptions, horizon, n+1, width, MaxPartitionsAhead, width*time.Duration(MaxPartitionsAhead-1), minWidth)
}

func (o *Options) setDefaults() {
	if o.BatchSize == 0 {
		o.BatchSize = DefaultBatchSize
	}
	if o.Horizon == 0 {
		o.Horizon = DefaultHorizon
	}
	if o.LockTimeout == 0 {
		o.LockTimeout = DefaultLockTimeout
	}
	if o.StatementTimeout == 0 {
		o.StatementTimeout = DefaultStatementTimeout
	}
	if o.MaxGrace == 0 {
		o.MaxGrace = DefaultMaxGrace
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
}

func msString(d time.Duration) string {
	return strconv.FormatInt(d.Milliseconds(), 10)
}

// runner carries one run's state.
type runner struct {
	conn   *pgx.Conn
	opts   Options
	q      *sqlops.Queries
	stop   context.Context // cancelled: stop between batches
	ctx    context.Context // for statements: never cancelled mid-statement
	start  time.Time
	res    *Result
	log    *slog.Logger
	tables sqlops.CleanupTablesRow
	// canCleanConcurrency is false when the role may not read and delete
	// pgrl_concurrency (granted the counter tables only, before migration
	// 000019 added it): the run leaves that table alone.
	canCleanConcurrency bool
	role                string    // the role running the cleanup
	cutoff              time.Time // rows and partitions dead at or before it go
	// cutoffUs is cutoff in microseconds since the Unix epoch, as the
	// statements take it: instants go in and out of them as integers,
	// which no DateStyle or TimeZone of the session reads otherwise.
	cutoffUs pgtype.Int8
	halted   bool // cancelled or out of time: do nothing more
}

// computeCutoff sets r.cutoff, the instant up to which rows are dead: the
// database clock, held back to the start of the oldest open transaction of
// the database (it still decides at its start), by at most MaxGrace.
func (r *runner) computeCutoff() error {
	if r.opts.At != nil {
		r.setCutoff(*r.opts.At)
		r.res.Cutoff = *r.opts.At
		return nil
	}
	h, err := r.q.CleanupHorizon(r.ctx, r.conn)
	if err != nil {
		return fmt.Errorf("find the oldest open transaction: %w", err)
	}
	now, oldestXact, oldestPrepared := time.UnixMicro(h.NowUs), time.UnixMicro(h.OldestXactStartUs), time.UnixMicro(h.OldestPreparedUs)
	floor := now.Add(-r.opts.MaxGrace)
	cutoff, heldBy := now, ""
	if oldestXact.Before(cutoff) {
		cutoff = oldestXact
		heldBy = fmt.Sprintf("transaction of pid %d open since %s", h.OldestPid, oldestXact.UTC().Format(time.RFC3339Nano))
	}
	if h.HiddenOpen > 0 && floor.Before(cutoff) {
		cutoff = floor
		heldBy = fmt.Sprintf("%d sessions of other roles have open transactions whose start this role cannot see; "+
			"assumed %s old (grant pg_read_all_stats to this role to see them)", h.HiddenOpen, r.opts.MaxGrace)
		r.log.Info("cleanup cutoff held back by hidden transactions", "sessions", h.HiddenOpen, "max_grace", r.opts.MaxGrace)
	}
	if cutoff.Before(floor) {
		r.log.Warn("an open transaction is older than the cleanup's max grace; rows it may still read are removed",
			"pid", h.OldestPid, "xact_start", oldestXact, "max_grace", r.opts.MaxGrace,
			"fix", "end that transaction (pg_stat_activity shows it), or raise --max-grace")
		cutoff = floor
		heldBy = fmt.Sprintf("transaction of pid %d open since %s, capped at the max grace of %s",
			h.OldestPid, oldestXact.UTC().Format(time.RFC3339Nano), r.opts.MaxGrace)
	}
	if oldestPrepared.Before(floor) {
		r.log.Warn("a prepared transaction is older than the cleanup's max grace; a row it locked makes the run wait for --lock-timeout",
			"prepared", oldestPrepared, "fix", "COMMIT PREPARED or ROLLBACK PREPARED it (see pg_prepared_xacts)")
	}
	r.setCutoff(cutoff)
	r.res.Cutoff = cutoff
	r.res.CutoffHeldBy = heldBy
	return nil
}

// setCutoff sets the instant up to which rows and partitions are dead.
func (r *runner) setCutoff(t time.Time) {
	r.cutoff, r.cutoffUs = t, pgtype.Int8{Int64: t.UnixMicro(), Valid: true}
}

// stopped reports whether the run must stop now, and records why.
func (r *runner) stopped() bool {
	if r.halted {
		return true
	}
	switch {
	case r.stop.Err() != nil:
		r.res.StopReason = "cancelled"
	case r.opts.MaxDuration > 0 && time.Since(r.start) >= r.opts.MaxDuration:
		r.res.StopReason = "max-duration"
	default:
		return false
	}
	r.res.StoppedEarly = true
	r.halted = true
	return true
}

func (r *runner) run() error {
	if r.opts.Mode == ModePartitions {
		if err := r.partitions(); err != nil {
			return err
		}
	} else if err := r.table(TableFixedWindow, &r.res.Tables.FixedWindow); err != nil {
		return err
	}
	if err := r.table(TableTokenBucket, &r.res.Tables.TokenBucket); err != nil {
		return err
	}
	if err := r.table(TableSlidingWindow, &r.res.Tables.SlidingWindow); err != nil {
		return err
	}
	if r.stopped() {
		// Not even to ask which later tables exist: a run past its
		// MaxDuration ends at once.
		return nil
	}
	// The tables of later migrations are cleaned where they exist, so
	// that a schema at an older version is cleaned as before.
	exists, err := r.q.RequestsExist(r.ctx, r.conn)
	if err != nil {
		return err
	}
	if exists {
		if err := r.table(TableRequests, &r.res.Tables.Requests); err != nil {
			return err
		}
	}
	if r.stopped() {
		return nil
	}
	if exists, err = r.q.ConcurrencyExists(r.ctx, r.conn); err != nil || !exists {
		return err
	}
	if !r.canCleanConcurrency {
		r.log.Warn("cleanup left pgrl_concurrency alone: the role may not read and delete it, so the rows of "+
			"concurrency limits whose slots have all lapsed stay",
			"fix", "GRANT SELECT, DELETE ON "+pgx.Identifier{r.tables.SchemaName, TableConcurrency}.Sanitize()+
				" TO "+pgx.Identifier{r.role}.Sanitize())
		return nil
	}
	return r.table(TableConcurrency, &r.res.Tables.Concurrency)
}

// table deletes (or, in a dry run, counts) one table's dead rows.
func (r *runner) table(name string, tr *TableResult) error {
	if r.stopped() {
		return nil
	}
	if r.opts.DryRun {
		var n int64
		var err error
		switch name {
		case TableFixedWindow:
			n, err = r.q.FixedWindowCountExpired(r.ctx, r.conn, r.cutoffUs)
		case TableTokenBucket:
			n, err = r.q.TokenBucketCountFull(r.ctx, r.conn, r.cutoffUs)
		case TableSlidingWindow:
			n, err = r.q.SlidingWindowCountExpired(r.ctx, r.conn, r.cutoffUs)
		case TableRequests:
			n, err = r.q.RequestCountExpired(r.ctx, r.conn, r.cutoffUs)
		case TableConcurrency:
			n, err = r.q.ConcurrencyCountExpired(r.ctx, r.conn, r.cutoffUs)
		}
		if err != nil {
			return fmt.Errorf("count dead rows of %s: %w", name, err)
		}
		tr.WouldDelete = n
		return nil
	}
	size := int32(r.opts.BatchSize)
	for {
		if tr.Batches > 0 && r.opts.BatchPause > 0 {
			select {
			case <-time.After(r.opts.BatchPause):
			case <-r.stop.Done():
			}
		}
		if r.stopped() {
			break
		}
		if r.opts.MaxBatches > 0 && tr.Batches >= r.opts.MaxBatches {
			// Only this table stops; the others still get their batches.
			r.res.StoppedEarly = true
			if r.res.StopReason == "" {
				r.res.StopReason = "max-batches"
			}
			break
		}
		t0 := time.Now()
		var n int64
		var err error
		switch {
		case name == TableRequests:
			// By primary key everywhere: the table is never distributed.
			n, err = r.q.RequestDeleteExpiredBatch(r.ctx, r.conn, sqlops.RequestDeleteExpiredBatchParams{AtUs: r.cutoffUs, BatchSize: size})
		case r.tables.Citus:
			// A ctid names a row of one shard only: batches by primary key.
			n, err = r.deleteByKey(name, size)
		case name == TableFixedWindow:
			n, err = r.q.FixedWindowDeleteExpiredBatch(r.ctx, r.conn, sqlops.FixedWindowDeleteExpiredBatchParams{AtUs: r.cutoffUs, BatchSize: size})
		case name == TableTokenBucket:
			n, err = r.q.TokenBucketDeleteFullBatch(r.ctx, r.conn, sqlops.TokenBucketDeleteFullBatchParams{AtUs: r.cutoffUs, BatchSize: size})
		case name == TableSlidingWindow:
			n, err = r.q.SlidingWindowDeleteExpiredBatch(r.ctx, r.conn, sqlops.SlidingWindowDeleteExpiredBatchParams{AtUs: r.cutoffUs, BatchSize: size})
		case name == TableConcurrency:
			n, err = r.q.ConcurrencyDeleteExpiredBatch(r.ctx, r.conn, sqlops.ConcurrencyDeleteExpiredBatchParams{AtUs: r.cutoffUs, BatchSize: size})
		}
		if err != nil {
			return fmt.Errorf("delete dead rows of %s (batch %d): %w", name, tr.Batches+1, err)
		}
		tr.Batches++
		tr.Deleted += n
		r.res.Batches++
		r.log.Debug("cleanup batch", "table", name, "deleted", n, "took", time.Since(t0))
		r.progress(name, tr)
		if n < int64(size) {
			break
		}
	}
	if tr.Deleted > 0 && r.opts.Vacuum && !r.stopped() {
		if err := r.vacuum(name); err != nil {
			return err
		}
		tr.Vacuumed = true
	}
	return nil
}

// deleteByKey runs one batch of the primary-key deletes, which Citus
// accepts on distributed tables (the ctid ones it refuses).
func (r *runner) deleteByKey(name string, size int32) (int64, error) {
	switch name {
	case TableFixedWindow:
		return r.q.FixedWindowDeleteExpiredBatchByKey(r.ctx, r.conn, sqlops.FixedWindowDeleteExpiredBatchByKeyParams{AtUs: r.cutoffUs.Int64, BatchSize: size})
	case TableTokenBucket:
		return r.q.TokenBucketDeleteFullBatchByKey(r.ctx, r.conn, sqlops.TokenBucketDeleteFullBatchByKeyParams{AtUs: r.cutoffUs.Int64, BatchSize: size})
	case TableConcurrency:
		return r.q.ConcurrencyDeleteExpiredBatchByKey(r.ctx, r.conn, sqlops.ConcurrencyDeleteExpiredBatchByKeyParams{AtUs: r.cutoffUs.Int64, BatchSize: size})
	default:
		return r.q.SlidingWindowDeleteExpiredBatchByKey(r.ctx, r.conn, sqlops.SlidingWindowDeleteExpiredBatchByKeyParams{AtUs: r.cutoffUs.Int64, BatchSize: size})
	}
}

func (r *runner) progress(name string, tr *TableResult) {
	if r.opts.Progress == nil {
		return
	}
	p := Progress{Table: name, Elapsed: time.Since(r.start)}
	if tr != nil {
		p.Deleted, p.Batches = tr.Deleted, tr.Batches
	}
	if r.res.Partitions != nil {
		p.PartitionsDropped = len(r.res.Partitions.Dropped)
	}
	r.opts.Progress(p)
}

func (r *runner) vacuum(name string) error {
	sql := "VACUUM (SKIP_LOCKED) " + pgx.Identifier{r.tables.SchemaName, name}.Sanitize()
	if _, err := r.conn.Exec(r.ctx, sql); err != nil {
		return fmt.Errorf("vacuum %s: %w", name, err)
	}
	return nil
}

// partitions creates partitions ahead and drops past ones.
func (r *runner) partitions() error {
	p := r.res.Partitions
	schema := r.tables.SchemaName
	parent := pgx.Identifier{schema, TableFixedWindow}.Sanitize()

	// Create ahead first: a check must find its partition even if the drops
	// below fail.
	if r.opts.DryRun {
		n, err := r.missingAhead()
		if err != nil {
			return err
		}
		p.Created = n
	} else {
		// Each call is its own short transaction and makes at most
		// MaxPartitionsAhead partitions; call again until none are missing.
		for {
			n, err := r.q.FixedWindowEnsurePartitionsAhead(r.ctx, r.conn, r.opts.Horizon.Microseconds())
			if err != nil {
				return fmt.Errorf("create partitions ahead: %w", err)
			}
			p.Created += int(n)
			if n < MaxPartitionsAhead || r.stopped() {
				break
			}
		}
	}

	parts, err := r.q.FixedWindowPartitions(r.ctx, r.conn)
	if err != nil {
		return fmt.Errorf("list partitions: %w", err)
	}
	// Citus refuses DETACH CONCURRENTLY on distributed tables.
	concurrently := r.tables.ServerVersionNum >= 140000 && !r.tables.Citus
	for _, part := range parts {
		if part.IsDefault {
			// DETACH CONCURRENTLY is refused while a DEFAULT partition exists.
			concurrently = false
		}
	}
	p.Detach = "plain"
	if concurrently {
		p.Detach = "concurrently"
	}

	for _, part := range parts {
		if part.IsDefault || time.UnixMicro(part.UpperBoundUs).After(r.cutoff) {
			continue // it can hold a row a check can still read
		}
		if r.stopped() {
			return nil
		}
		t0 := time.Now()
		ident := pgx.Identifier{part.SchemaName, part.PartitionName}.Sanitize()
		var rows int64
		if err := r.conn.QueryRow(r.ctx, "SELECT count(*) FROM "+ident).Scan(&rows); err != nil {
			return fmt.Errorf("count rows of partition %s: %w", part.PartitionName, err)
		}
		if !r.opts.DryRun {
			if err := r.detach(parent, ident, concurrently); err != nil {
				return fmt.Errorf("detach partition %s: %w", part.PartitionName, err)
			}
			if _, err := r.conn.Exec(r.ctx, "DROP TABLE "+ident); err != nil {
				return fmt.Errorf("drop detached partition %s: %w", part.PartitionName, err)
			}
		}
		p.Dropped = append(p.Dropped, part.PartitionName)
		p.RowsDropped += rows
		r.log.Debug("cleanup partition", "partition", part.PartitionName, "rows", rows,
			"upper_bound", time.UnixMicro(part.UpperBoundUs), "dry_run", r.opts.DryRun, "took", time.Since(t0))
		r.progress(TableFixedWindow, nil)
	}

	leftovers, err := r.q.FixedWindowDetachedPartitions(r.ctx, r.conn)
	if err != nil {
		return fmt.Errorf("list detached partitions: %w", err)
	}
	for _, l := range leftovers {
		if r.stopped() {
			return nil
		}
		if !r.opts.DryRun {
			if _, err := r.conn.Exec(r.ctx, "DROP TABLE "+pgx.Identifier{l.SchemaName, l.TableName}.Sanitize()); err != nil {
				return fmt.Errorf("drop detached partition %s: %w", l.TableName, err)
			}
		}
		p.LeftoversDropped = append(p.LeftoversDropped, l.TableName)
	}
	return nil
}

// detach detaches one partition, with the least locking form available. An
// earlier DETACH CONCURRENTLY that was interrupted leaves the partition
// "pending detach"; FINALIZE completes it.
func (r *runner) detach(parent, part string, concurrently bool) error {
	if !concurrently {
		_, err := r.conn.Exec(r.ctx, "ALTER TABLE "+parent+" DETACH PARTITION "+part)
		return err
	}
	_, err := r.conn.Exec(r.ctx, "ALTER TABLE "+parent+" DETACH PARTITION "+part+" CONCURRENTLY")
	if pgerr.IsPendingDetach(err) {
		_, err = r.conn.Exec(r.ctx, "ALTER TABLE "+parent+" DETACH PARTITION "+part+" FINALIZE")
	}
	return err
}

// missingAhead counts the partitions that creating ahead would add, for a
// dry run, the way pgrl_fixed_window_create_partitions makes them: ranges
// already covered are skipped, and a new partition ends at the next multiple
// of the width or where an existing one begins.
func (r *runner) missingAhead() (int, error) {
	step, err := r.q.FixedWindowPartitionSeconds(r.ctx, r.conn)
	if err != nil {
		return 0, fmt.Errorf("read partition width: %w", err)
	}
	if step <= 0 {
		return 0, nil
	}
	parts, err := r.q.FixedWindowPartitions(r.ctx, r.conn)
	if err != nil {
		return 0, fmt.Errorf("list partitions: %w", err)
	}
	now := time.UnixMicro(r.tables.NowUs)
	to := now.Add(r.opts.Horizon)
	s := time.Unix(floorDiv(now.Unix(), step)*step, 0)
	n := 0
	for !s.After(to) {
		covered := false
		for _, p := range parts {
			lower, upper := time.UnixMicro(p.LowerBoundUs), time.UnixMicro(p.UpperBoundUs)
			if !p.IsDefault && !lower.After(s) && upper.After(s) {
				s, covered = upper, true
				break
			}
		}
		if covered {
			continue
		}
		e := time.Unix((floorDiv(s.Unix(), step)+1)*step, 0)
		for _, p := range parts {
			if lower := time.UnixMicro(p.LowerBoundUs); !p.IsDefault && lower.After(s) && lower.Before(e) {
				e = lower
			}
		}
		n++
		s = e
	}
	return n, nil
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// PartitionName returns the name of the pgrl_fixed_window partition that
// starts at start: pgrl_fixed_window_YYYYMMDDtHHMMSS in UTC.
func PartitionName(start time.Time) string {
	return TableFixedWindow + "_" + start.UTC().Format("20060102t150405")
}
