// Package migration applies pgrl's schema migrations: the counter tables and
// the partitioning functions embedded in package schema. An application calls
// it at start-up; rl-migrate is a thin command-line front end over it.
//
// It drives github.com/golang-migrate/migrate with its own migrations table
// (pgrl_schema_migrations by default), never golang-migrate's default
// schema_migrations, which usually belongs to the application. Migrators
// serialize on an advisory lock, so several instances of an application may
// call Up at the same moment: one applies the migrations, the others wait and
// then find nothing to do.
//
// Every statement runs with a lock_timeout (Config.LockTimeout), so DDL never
// queues behind a long transaction and stalls the queries queued behind it.
// Every pgrl migration file runs as one transaction: when the database
// rejects one (a lock timeout, for instance), nothing of it remains, the
// migrations table is set back to the previous version, and the call returns
// a *FailedError; running it again later is safe.
package migration

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	migrate "github.com/golang-migrate/migrate/v4"
	"github.com/golang-migrate/migrate/v4/database"
	pgxmigrate "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgrl/pgrl/internal/ident"
	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/sql/schema"
)

// DefaultTable is the migrations table used when Config.Table is empty.
const DefaultTable = "pgrl_schema_migrations"

// DefaultLockTimeout is the lock_timeout used when Config.LockTimeout is zero.
const DefaultLockTimeout = 5 * time.Second

// DefaultLockWait is how long a migrator waits for another one when
// Config.LockWait is zero.
const DefaultLockWait = time.Minute

// DefaultPartitionWidth is the partition width SetLayout uses when given zero.
const DefaultPartitionWidth = time.Hour

// DefaultPartitionLookahead is how far ahead SetLayout makes partitions when
// Config.PartitionLookahead is zero. It matches rl-cleanup's default
// --horizon, so that one width suits both.
const DefaultPartitionLookahead = 24 * time.Hour

// MaxPartitions is the most partitions SetLayout makes in its transaction:
// the partitions covering now to now + the lookahead (and, when switching
// from the plain layout, the live windows' ends). Every partition is a lock
// its transaction holds, and the lock table is shared by every database of
// the server. A width with lookahead / width > MaxPartitions - 1 is refused.
const MaxPartitions = 64

// Layout is how pgrl_fixed_window is stored: LayoutPlain or
// LayoutPartitioned.
type Layout string

// Layouts accepted by SetLayout.
const (
	// LayoutPlain keeps pgrl_fixed_window as one UNLOGGED table; rl-cleanup
	// deletes its dead rows in batches.
	LayoutPlain Layout = "plain"
	// LayoutPartitioned range-partitions pgrl_fixed_window on expires_at;
	// rl-cleanup drops whole past partitions.
	LayoutPartitioned Layout = "partitioned"
)

// Config configures a Migrator. The zero value is ready to use.
type Config struct {
	// Schema is the schema that holds pgrl's tables, functions and the
	// migrations table. Up, UpTo and Force create it when it is missing.
	// Defaults to the connection's current schema: the first existing schema
	// on its search_path, usually public.
	Schema string

	// Table is the name of the migrations table, inside Schema. It must not be
	// "schema_migrations", golang-migrate's default, which is most likely the
	// application's own. Defaults to "pgrl_schema_migrations".
	Table string

	// LockTimeout is the lock_timeout of every statement the migrator runs:
	// a migration that cannot get its table locks within it fails (and is
	// rolled back) instead of queueing behind a long transaction while every
	// query on the table queues behind it. Defaults to 5 seconds.
	LockTimeout time.Duration

	// LockWait is how long to wait for another migrator (another instance
	// of the application, another rl-migrate) to finish before giving up
	// with ErrLockWait. Defaults to 1 minute.
	LockWait time.Duration

	// PartitionLookahead is how far ahead of now SetLayout makes
	// partitions in the partitioned layout: at least the longest
	// fixed-window limit's window, so that every check finds its partition.
	// rl-cleanup --partitions keeps them coming. Defaults to
	// DefaultPartitionLookahead (24h).
	PartitionLookahead time.Duration

	// GrantTo names roles (the application's) that Up and UpTo grant the
	// rights checks need, after migrating, also when nothing was pending:
	// USAGE on Schema, SELECT, INSERT, UPDATE, DELETE on the counter tables
	// and EXECUTE on the functions checks call. See Grant.
	GrantTo []string

	// Logger receives one line per migration applied or reverted, with the
	// time that migration took ("took").
	// Defaults to discarding logs.
	Logger *slog.Logger
}

// Migrator applies pgrl's migrations to one database schema. It is safe for
// concurrent use; its operations run one at a time. Close it when done.
type Migrator struct {
	cfg     Config
	connCfg *pgx.ConnConfig

	mu       sync.Mutex
	conn     *pgx.Conn // control connection: lock, status, layout
	schema   string    // resolved schema name
	user     string    // current_user of the control connection
	database string    // current_database() of the control connection
}

// New parses connString (a postgres:// URL or key=value string; "" reads the
// libpq PG* environment variables) and returns a Migrator. It does not
// connect: the first operation does.
func New(connString string, cfg Config) (*Migrator, error) {
	connCfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("pgrl migration: %w", err)
	}
	return NewWithConnConfig(connCfg, cfg)
}

// NewWithConnConfig is New for an already parsed connection configuration,
// which it copies.
func NewWithConnConfig(connCfg *pgx.ConnConfig, cfg Config) (*Migrator, error) {
	if connCfg == nil {
		return nil, errors.New("pgrl migration: nil connection config")
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if cfg.Table == pgxmigrate.DefaultMigrationsTable {
		return nil, invalidConfig("%q is golang-migrate's default table, most likely your application's own; keep the default %q or pick another name",
			cfg.Table, DefaultTable)
	}
	if err := ident.Check("migrations table", cfg.Table); err != nil {
		return nil, invalidConfig("%v", err)
	}
	if cfg.Schema != "" {
		if err := ident.Check("schema", cfg.Schema); err != nil {
			return nil, invalidConfig("%v", err)
		}
	}
	for _, r := range cfg.GrantTo {
		if err := ident.Check("role to grant to", r); err != nil {
			return nil, invalidConfig("%v", err)
		}
	}
	if cfg.LockTimeout < 0 || cfg.LockWait < 0 || cfg.PartitionLookahead < 0 {
		return nil, invalidConfig("LockTimeout, LockWait and PartitionLookahead must not be negative")
	}
	if cfg.PartitionLookahead == 0 {
		cfg.PartitionLookahead = DefaultPartitionLookahead
	}
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = DefaultLockTimeout
	}
	if cfg.LockWait == 0 {
		cfg.LockWait = DefaultLockWait
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := connCfg.Copy()
	if c.RuntimeParams == nil {
		c.RuntimeParams = map[string]string{}
	}
	if _, ok := c.RuntimeParams["application_name"]; !ok {
		c.RuntimeParams["application_name"] = "pgrl-migrate"
	}
	c.RuntimeParams["lock_timeout"] = millis(cfg.LockTimeout)
	if cfg.Schema != "" {
		c.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
	return &Migrator{cfg: cfg, connCfg: c}, nil
}

// Close closes the migrator's connection.
func (m *Migrator) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.conn == nil {
		return nil
	}
	err := m.conn.Close(context.Background())
	m.conn = nil
	return err
}

// Result describes what an operation changed.
type Result struct {
	// Schema is the schema migrated.
	Schema string `json:"schema"`
	// From is the version before the operation (0: none applied).
	From uint `json:"from"`
	// To is the version after it.
	To uint `json:"to"`
	// Applied lists the migrations applied, in order.
	Applied []Migration `json:"applied"`
	// Reverted lists the migrations reverted, in order.
	Reverted []Migration `json:"reverted"`
	// Distributed lists the tables Up or UpTo distributed on Citus (see
	// Distribute): empty without the citus extension and when they already
	// were.
	Distributed []string `json:"distributed,omitempty"`
}

// Changed reports whether the operation applied or reverted anything.
func (r Result) Changed() bool { return r.From != r.To }

// Status describes the state of a schema.
type Status struct {
	// Schema is the schema inspected.
	Schema string `json:"schema"`
	// Table is the migrations table, inside Schema.
	Table string `json:"migrations_table"`
	// Version is the version recorded (0: none applied).
	Version uint `json:"version"`
	// Dirty is true when a migration stopped part-way (see ErrDirty).
	Dirty bool `json:"dirty"`
	// Latest is the newest embedded version.
	Latest uint `json:"latest"`
	// Applied lists the embedded migrations at or below Version.
	Applied []Migration `json:"applied"`
	// Pending lists the embedded migrations above Version.
	Pending []Migration `json:"pending"`
	// Layout is pgrl_fixed_window's layout, LayoutPlain or
	// LayoutPartitioned, or "" when the table does not exist.
	Layout Layout `json:"layout"`
	// PartitionWidth is the width of the partitions in the partitioned
	// layout, else zero.
	PartitionWidth time.Duration `json:"-"`
	// Citus is true when the citus extension exists in the database.
	Citus bool `json:"citus"`
	// Distribution says how each of pgrl's tables is stored (local without
	// Citus; see Distribute).
	Distribution []Distribution `json:"distribution"`
}

// Up applies every pending migration. Nothing pending is success.
//
// With Config.GrantTo set it first checks that every role named exists
// (a *MissingRoleError, and nothing done, when one does not) and, after
// migrating, grants those roles the application's rights (see Grant), also
// when nothing was pending.
//
// When nothing is pending, Up only reads the migrations table: it needs no
// CREATE on the schema and takes no lock, so an application may call it at
// start-up under its own role, which Grant lets read that table. Check does
// the same without ever trying to migrate.
func (m *Migrator) Up(ctx context.Context) (Result, error) {
	return m.up(ctx, Latest().Version, func(mg *migrate.Migrate, _ uint) error { return mg.Up() })
}

// UpTo applies the pending migrations up to and including version. It
// never reverts: a database already past version is an error. Like Up, it
// checks Config.GrantTo first and grants after.
func (m *Migrator) UpTo(ctx context.Context, version uint) (Result, error) {
	if _, err := Lookup(version); err != nil {
		return Result{}, err
	}
	return m.up(ctx, version, func(mg *migrate.Migrate, current uint) error {
		if current > version {
			return fmt.Errorf("the database is at version %d, past %d: `up` never reverts; use `rl-migrate down` to go back", current, version)
		}
		return mg.Migrate(version)
	})
}

// up checks the roles to grant to, migrates to target unless the schema is
// there already, and grants.
func (m *Migrator) up(ctx context.Context, target uint, op func(*migrate.Migrate, uint) error) (Result, error) {
	if err := m.checkRoles(ctx, m.cfg.GrantTo); err != nil {
		return Result{}, err
	}
	res, done, err := m.upToDate(ctx, target)
	if err != nil {
		return res, err
	}
	if !done {
		if res, err = m.run(ctx, needCreate, Up, op); err != nil {
			return res, err
		}
	}
	if res.Distributed, err = m.distribute(ctx); err != nil {
		return res, err
	}
	return res, m.Grant(ctx, m.cfg.GrantTo...)
}

// distribute distributes pgrl's tables on Citus (see Distribute) when some
// are not yet; it takes the migration lock only then, so that an up with
// nothing to do stays a read.
func (m *Migrator) distribute(ctx context.Context) ([]string, error) {
	m.mu.Lock()
	conn, schemaName, err := m.control(ctx)
	var todo bool
	if err == nil {
		todo, err = needsDistribution(ctx, conn, schemaName)
	}
	m.mu.Unlock()
	if err != nil || !todo {
		return nil, err
	}
	var changed []string
	err = m.withLock(ctx, needOwner, func(conn *pgx.Conn, schemaName string) error {
		var err error
		changed, err = Distribute(ctx, conn, schemaName)
		return err
	})
	if len(changed) > 0 {
		m.cfg.Logger.Info("distributed pgrl's tables on Citus", "schema", schemaName, "tables", strings.Join(changed, ","))
	}
	return changed, err
}

// upToDate reports whether the migrations table cleanly records version
// target: then `up` has nothing to do and needs neither the migration lock
// nor CREATE on the schema. Any doubt (no table, a table it cannot read, a
// dirty flag, another version) answers false and leaves the decision to
// run, under the lock, with its own checks and messages.
func (m *Migrator) upToDate(ctx context.Context, target uint) (Result, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	conn, schemaName, err := m.control(ctx)
	if err != nil {
		return Result{}, false, err
	}
	st, err := m.status(ctx, conn, schemaName)
	if err != nil || st.Dirty || st.Version != target {
		return Result{}, false, nil
	}
	return Result{Schema: schemaName, From: st.Version, To: st.Version, Applied: []Migration{}, Reverted: []Migration{}}, true, nil
}

// checkRoleNames refuses a role name PostgreSQL would not take as given.
func checkRoleNames(roles []string) error {
	for _, r := range roles {
		if err := ident.Check("role to grant to", r); err != nil {
			return invalidConfig("%v", err)
		}
	}
	return nil
}

// checkRoles returns a *MissingRoleError naming every role of roles that
// does not exist.
func (m *Migrator) checkRoles(ctx context.Context, roles []string) error {
	if len(roles) == 0 {
		return nil
	}
	if err := checkRoleNames(roles); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	conn, _, err := m.control(ctx)
	if err != nil {
		return err
	}
	return missingRoles(ctx, conn, roles)
}

// missingRoles returns a *MissingRoleError naming the roles that do not
// exist, in the order given, or nil.
func missingRoles(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, roles []string) error {
	rows, err := q.Query(ctx, `SELECT r FROM unnest($1::text[]) WITH ORDINALITY AS u(r, i)
		WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = u.r) ORDER BY i`, roles)
	if err != nil {
		return err
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	if len(missing) > 0 {
		return &MissingRoleError{Roles: missing}
	}
	return nil
}

// Check reports whether the schema holds every migration this build
// carries. It is the start-up guard for an application that runs under its
// own role: it needs only what Grant gives that role (USAGE on the schema,
// SELECT on the migrations table), changes nothing and takes no lock.
//
// It returns nil when nothing is pending; a *PendingError (matching
// ErrPending and ErrNotMigrated) naming the database, the user, the schema,
// the pending migrations and the command that applies them; a *DirtyError
// when a migration stopped part-way; a *PermissionError when the role may
// not read the migrations table. A database at a version newer than this
// build's newest migration (migrated by a newer pgrl, as in a rolling
// deploy) has nothing pending for this build and passes.
func (m *Migrator) Check(ctx context.Context) error {
	st, err := m.Status(ctx)
	if err != nil {
		return err
	}
	if st.Dirty {
		return &DirtyError{Version: st.Version, Table: qualified(st.Schema, st.Table)}
	}
	if len(st.Pending) == 0 {
		return nil
	}
	m.mu.Lock()
	user, db := m.user, m.database
	m.mu.Unlock()
	return &PendingError{Database: db, User: user, Schema: st.Schema, Table: st.Table, Version: st.Version, Pending: st.Pending}
}

// Down reverts the newest steps applied migrations (fewer when fewer are
// applied). Nothing applied is success.
func (m *Migrator) Down(ctx context.Context, steps int) (Result, error) {
	if steps < 1 {
		return Result{}, fmt.Errorf("pgrl migration: steps must be at least 1, got %d", steps)
	}
	return m.run(ctx, needOwner, Down, func(mg *migrate.Migrate, current uint) error {
		n := 0
		for _, a := range Available() {
			if a.Version <= current {
				n++
			}
		}
		n = min(n, steps)
		if n == 0 {
			return migrate.ErrNoChange
		}
		return mg.Steps(-n)
	})
}

// DownAll reverts every applied migration, removing all of pgrl's tables and
// functions (and their rows). The migrations table stays, empty.
func (m *Migrator) DownAll(ctx context.Context) (Result, error) {
	return m.run(ctx, needOwner, Down, func(mg *migrate.Migrate, _ uint) error { return mg.Down() })
}

// Force records version as the current one and clears the dirty flag,
// without running any migration. Use it after repairing a dirty database by
// hand. Version 0 records that no migration is applied.
func (m *Migrator) Force(ctx context.Context, version uint) error {
	target := database.NilVersion
	if version != 0 {
		if _, err := Lookup(version); err != nil {
			return err
		}
		target = int(version)
	}
	return m.withLock(ctx, needCreate, func(conn *pgx.Conn, schemaName string) error {
		mg, _, closeFn, err := m.open(schemaName)
		if err != nil {
			return err
		}
		defer closeFn()
		if err := mg.Force(target); err != nil {
			return unwrapDriverError(err)
		}
		m.cfg.Logger.Info("forced pgrl migration version", "schema", schemaName, "version", version)
		return nil
	})
}

// Status reports the recorded version and the applied and pending
// migrations. It changes nothing and takes no lock.
func (m *Migrator) Status(ctx context.Context) (Status, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	conn, schemaName, err := m.control(ctx)
	if err != nil {
		return Status{}, err
	}
	if err := checkAccess(ctx, conn, schemaName, needUsage); err != nil {
		return Status{}, err
	}
	st, err := m.status(ctx, conn, schemaName)
	if err != nil {
		return st, err
	}
	if st.Citus, err = HasCitus(ctx, conn); err != nil {
		return st, err
	}
	st.Distribution, err = Distributions(ctx, conn, schemaName)
	if st.Distribution == nil {
		st.Distribution = []Distribution{}
	}
	return st, err
}

// SetLayout switches pgrl_fixed_window between LayoutPlain and
// LayoutPartitioned (with partitions width wide; zero means
// DefaultPartitionWidth) by calling pgrl_fixed_window_set_layout, which
// copies the live rows, and makes the partitions from now to now +
// Config.PartitionLookahead. It returns the layout in place afterwards.
//
// Switching to partitioned builds the new table and its partitions first and
// then holds an ACCESS EXCLUSIVE lock on pgrl_fixed_window only while it
// copies the live rows, so checks on fixed-window limits wait about as long
// as that copy takes; it fails after Config.LockTimeout rather than queue
// behind a long transaction. Changing the width of a partitioned table takes
// no table lock: existing partitions keep their ranges and new ones start
// where they end.
//
// No transaction makes more than MaxPartitions partitions: a width for which
// the lookahead (or, from the plain layout, the live windows) would need
// more is refused with a *PartitionCountError, and nothing changes.
func (m *Migrator) SetLayout(ctx context.Context, layout Layout, width time.Duration) (Layout, error) {
	if layout != LayoutPlain && layout != LayoutPartitioned {
		return "", invalidConfig("unknown layout %q: use %s or %s", layout, LayoutPlain, LayoutPartitioned)
	}
	if width == 0 {
		width = DefaultPartitionWidth
	}
	if width < time.Second {
		return "", invalidConfig("partition width %s is shorter than one second", width)
	}
	if width%time.Second != 0 {
		return "", invalidConfig("partition width %s is not a whole number of seconds", width)
	}
	lookahead := m.cfg.PartitionLookahead
	if layout == LayoutPartitioned {
		if n := PartitionsNeeded(lookahead, width); n > MaxPartitions {
			return "", &PartitionCountError{Width: width, Lookahead: lookahead, Needed: n}
		}
	}
	var out string
	err := m.withLock(ctx, needOwner, func(conn *pgx.Conn, schemaName string) error {
		st, err := m.status(ctx, conn, schemaName)
		if err != nil {
			return err
		}
		if st.Dirty {
			return &DirtyError{Version: st.Version, Table: qualified(schemaName, m.cfg.Table)}
		}
		if st.Version < 4 {
			return fmt.Errorf("%w: in database %s, schema %s (looked in as user %s) is at version %d and this layout switch needs version 4; run `rl-migrate --schema %s up` first",
				ErrNotMigrated, m.database, schemaName, m.user, st.Version, schemaName)
		}
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schemaName}.Sanitize()); err != nil {
				return err
			}
			// Durations as whole microseconds: no session setting reads them.
			if layout == LayoutPlain && st.Layout == LayoutPartitioned {
				// Back to plain, set_layout renames the partitioned
				// table's constraint, which Citus refuses on a
				// distributed table: make it local first (Distribute
				// distributes the new one below).
				if err := undistribute(ctx, tx, schemaName, "pgrl_fixed_window"); err != nil {
					return err
				}
			}
			if err := tx.QueryRow(ctx, `SELECT pgrl_fixed_window_set_layout($1,
				$2::bigint * interval '1 microsecond', $3::bigint * interval '1 microsecond')`,
				string(layout), width.Microseconds(), lookahead.Microseconds()).Scan(&out); err != nil {
				return err
			}
			// Switching layouts builds a new, local pgrl_fixed_window:
			// on Citus it is distributed again, in the same transaction,
			// so that no check ever sees it undistributed.
			_, err := Distribute(ctx, tx, schemaName)
			return err
		})
		var pgErr *pgconn.PgError
		if pgerr.IsTooManyPartitions(err) && errors.As(err, &pgErr) {
			// The live windows reach further than MaxPartitions partitions.
			return &PartitionCountError{Width: width, Lookahead: lookahead, Detail: pgErr.Message + " (" + pgErr.Hint + ")"}
		}
		return err
	})
	if err != nil {
		return "", err
	}
	m.cfg.Logger.Info("pgrl_fixed_window layout set", "layout", out, "partition_width", width.String(), "lookahead", lookahead.String())
	return Layout(out), nil
}

// PartitionsNeeded is how many partitions of the given width (aligned on
// multiples of it) it takes to cover now to now + lookahead, at most.
func PartitionsNeeded(lookahead, width time.Duration) int64 {
	if width <= 0 {
		return math.MaxInt64
	}
	n := int64(lookahead / width)
	if lookahead%width != 0 {
		n++
	}
	return n + 1
}

// MinPartitionWidth is the narrowest width, in whole seconds, for which a
// lookahead needs at most MaxPartitions partitions.
func MinPartitionWidth(lookahead time.Duration) time.Duration {
	secs := int64(math.Ceil(lookahead.Seconds() / float64(MaxPartitions-1)))
	return time.Duration(max(secs, 1)) * time.Second
}

// PartitionCountError reports a partition width too narrow for the
// lookahead or the live windows: more than MaxPartitions partitions would be
// made in one transaction. Nothing was changed.
type PartitionCountError struct {
	// Width is the partition width asked for.
	Width time.Duration
	// Lookahead is how far ahead partitions were to be made.
	Lookahead time.Duration
	// Needed is how many partitions the lookahead needs (0 when the live
	// windows were the problem; Detail says so).
	Needed int64
	// Detail is the database's explanation when the live windows need too
	// many partitions.
	Detail string
}

// Error names the widths and lookaheads that work.
func (e *PartitionCountError) Error() string {
	if e.Detail != "" {
		return fmt.Sprintf("partition width %s is too narrow: %s; choose a wider --partition-width", e.Width, e.Detail)
	}
	return fmt.Sprintf("partition width %s with a lookahead of %s needs %d partitions, more than the %d one transaction may make: use --partition-width %s or wider, or a shorter --lookahead (at most %s at this width)",
		e.Width, e.Lookahead, e.Needed, MaxPartitions, MinPartitionWidth(e.Lookahead), e.Width*time.Duration(MaxPartitions-1))
}

// Is reports whether target is ErrTooManyPartitions or ErrInvalidConfig.
func (e *PartitionCountError) Is(target error) bool {
	return target == ErrTooManyPartitions || target == ErrInvalidConfig
}

// Grant gives each role the rights an application's checks need in the
// migrated schema, and nothing more: USAGE on the schema; SELECT, INSERT,
// UPDATE and DELETE on pgrl_fixed_window, pgrl_token_bucket,
// pgrl_sliding_window and pgrl_request; SELECT on the migrations table and
// pgrl_partition_settings (what Status, Check and a no-op Up read, so that
// the application can check at start-up that its schema is current);
// SELECT on the policy tables pgrl_policy and
// pgrl_policy_override (read by package policy, written by the migration
// role or a DBA, never by the application); EXECUTE on pgrl_abort_unless,
// the arithmetic functions the checks inline and pgrl_stored_key
// (appFunctions). Partitions made later
// need no grant of their own: PostgreSQL checks a query's rights on the
// table it names, the partitioned parent. Granting again is harmless; Up
// calls it with Config.GrantTo. Run it as the owner of pgrl's tables. A role
// that does not exist is a *MissingRoleError, and nothing is granted.
func (m *Migrator) Grant(ctx context.Context, roles ...string) error {
	if len(roles) == 0 {
		return nil
	}
	if err := checkRoleNames(roles); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	conn, schemaName, err := m.control(ctx)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if err := missingRoles(ctx, tx, roles); err != nil {
			return err
		}
		for _, r := range roles {
			stmts, err := grantStatements(ctx, tx, schemaName, m.cfg.Table, r)
			if err != nil {
				return err
			}
			for _, stmt := range stmts {
				if _, err := tx.Exec(ctx, stmt); err != nil {
					return fmt.Errorf("%s: %w", stmt, err)
				}
			}
		}
		m.cfg.Logger.Info("granted pgrl's application rights", "schema", schemaName, "roles", strings.Join(roles, ","))
		return nil
	})
}

// appTables are the tables a check reads and writes: the counters, and the
// answers of checks with a request id (migration 000017), which checks also
// delete when they clean up, and the slots of concurrency limits
// (migration 000019).
var appTables = []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window", "pgrl_request", "pgrl_concurrency"}

// appReadTables are the tables an application only reads: the layout
// settings Status reports, and the policies of migration 000007, which
// package policy loads and the DBA (or rl-policy, as the migration role)
// writes. Grant adds the migrations table, which Status, Check and a no-op
// Up read.
var appReadTables = []string{"pgrl_partition_settings", "pgrl_policy", "pgrl_policy_override"}

// appFunctions are the functions a check calls: pgrl_abort_unless, the
// named-arithmetic functions of migration 000005, which the planner inlines
// only for a user who may execute them (without EXECUTE a check fails with
// 42501), the check-queue functions of migration 000006, the steps of
// migration 000012, the check functions of migration 000014 and those of
// migration 000015, which take slices too, and the token bucket's lease
// helpers and slice functions of migration 000016, pgrl_check (000018),
// the concurrency limits' functions (000019) and the sliding window's step
// at a given window start with its helpers (000022).
// TestEveryFunctionGranted holds every function of the migrations to this
// list or to the operations' own.
var appFunctions = []string{
	"pgrl_abort_unless(boolean, text)",
	"pgrl_epoch_us(timestamptz)",
	"pgrl_from_epoch_us(bigint)",
	"pgrl_elapsed_us(timestamptz, timestamptz)",
	"pgrl_window_start_us(bigint, bigint)",
	"pgrl_window_end_us(bigint, bigint)",
	"pgrl_float8_bits(float8)",
	"pgrl_token_bucket_refill(float8, bigint, float8, float8)",
	"pgrl_token_bucket_balance(float8, bigint, float8, float8, float8, boolean)",
	"pgrl_token_bucket_full_at(timestamptz, float8, float8, float8)",
	"pgrl_sliding_window_current(timestamptz, timestamptz, bigint)",
	"pgrl_sliding_window_previous(timestamptz, timestamptz, bigint, bigint, bigint)",
	"pgrl_sliding_window_elapsed_us(bigint, timestamptz, bigint)",
	"pgrl_sliding_window_allows(bigint, bigint, bigint, bigint, bigint, bigint)",
	"pgrl_saturating_add(bigint, bigint)",
	"pgrl_fixed_window_take_queue(bytea[], bigint[], boolean[], integer[], bigint[], bigint[], boolean[], timestamptz)",
	"pgrl_token_bucket_take_queue(bytea[], bigint[], boolean[], integer[], float8[], float8[], boolean[], timestamptz)",
	"pgrl_sliding_window_take_queue(bytea[], bigint[], boolean[], integer[], bigint[], bigint[], boolean[], timestamptz)",
	"pgrl_stored_key(text, text, boolean)",
	"pgrl_us(timestamptz)",
	"pgrl_ts(bigint)",
	"pgrl_now(timestamptz)",
	"pgrl_now_us(timestamptz)",
	"pgrl_token_bucket_refilled_at(timestamptz, float8, float8, float8)",
	"pgrl_fixed_window_take(bigint, bigint, bigint, bigint, boolean, boolean)",
	"pgrl_token_bucket_take(float8, bigint, bigint, bigint, float8, float8, boolean, boolean)",
	"pgrl_sliding_window_roll(bigint, bigint, bigint, bigint, bigint, boolean)",
	"pgrl_sliding_window_elapsed(bigint, bigint, bigint)",
	"pgrl_sliding_window_room(bigint, bigint, bigint, bigint, bigint)",
	"pgrl_sliding_window_take(bigint, bigint, bigint, bigint, bigint, bigint, bigint, boolean, boolean)",
	"pgrl_fixed_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], timestamptz)",
	"pgrl_token_bucket_take_checks(bytea[], float8[], float8[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], timestamptz)",
	"pgrl_sliding_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], timestamptz)",
	"pgrl_slice_probe(bigint, bigint)",
	"pgrl_slice_ask(bigint, bigint, bigint, bigint)",
	"pgrl_fixed_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz)",
	"pgrl_sliding_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz)",
	"pgrl_token_bucket_lease_us(bigint)",
	"pgrl_token_bucket_lease_epoch_us(bigint)",
	"pgrl_token_bucket_leased(bigint, bigint, bigint, bigint)",
	"pgrl_token_bucket_lease_roll(bigint, bigint, bigint, bigint, boolean)",
	"pgrl_token_bucket_lease_over_at(bigint, bigint, bigint)",
	"pgrl_token_bucket_lease_returnable(bigint, bigint, bigint, bigint, bigint, boolean)",
	"pgrl_token_bucket_slice(float8, bigint, bigint, bigint, bigint, bigint, float8, float8, boolean)",
	"pgrl_token_bucket_return_slice(bytea, timestamptz, bigint, float8, float8, timestamptz)",
	"pgrl_token_bucket_take_checks(bytea[], float8[], float8[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz)",
	"pgrl_check(text, text, bigint)",
	"pgrl_concurrency_step(pgrl_slot[], bigint, bytea, bigint, bigint)",
	"pgrl_concurrency_renew(pgrl_slot[], bigint, pgrl_slot[])",
	"pgrl_concurrency_holds(pgrl_slot[], bigint, bytea)",
	"pgrl_concurrency_held(pgrl_slot[], bigint)",
	"pgrl_concurrency_next_us(pgrl_slot[], bigint)",
	"pgrl_concurrency_last_us(pgrl_slot[], bigint)",
	"pgrl_concurrency_tokens(pgrl_slot[], bigint, bytea)",
	"pgrl_sliding_window_roll_at(bigint, bigint, bigint, bigint, bigint, boolean)",
	"pgrl_sliding_window_elapsed_at(bigint, bigint, bigint, bigint)",
	"pgrl_sliding_window_take_at(bigint, bigint, bigint, bigint, bigint, bigint, bigint, bigint, boolean, boolean)",
}

// grantStatements returns the GRANT statements that give role the
// application's rights on the objects present in schemaName.
func grantStatements(ctx context.Context, tx pgx.Tx, schemaName, migrationsTable, role string) ([]string, error) {
	r := pgx.Identifier{role}.Sanitize()
	out := []string{"GRANT USAGE ON SCHEMA " + pgx.Identifier{schemaName}.Sanitize() + " TO " + r}
	for _, t := range appTables {
		var ok bool
		if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", qualified(schemaName, t)).Scan(&ok); err != nil {
			return nil, err
		}
		if ok {
			out = append(out, "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "+qualified(schemaName, t)+" TO "+r)
		}
	}
	for _, t := range append([]string{migrationsTable}, appReadTables...) {
		var ok bool
		if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", qualified(schemaName, t)).Scan(&ok); err != nil {
			return nil, err
		}
		if ok {
			out = append(out, "GRANT SELECT ON TABLE "+qualified(schemaName, t)+" TO "+r)
		}
	}
	for _, f := range appFunctions {
		sig, types := signature(schemaName, f)
		var ok bool
		// A signature naming a type of pgrl's that an older schema lacks
		// is an error to to_regprocedure, not NULL: look for the types
		// first.
		if err := tx.QueryRow(ctx, `SELECT coalesce(bool_and(to_regtype(t) IS NOT NULL), true) FROM unnest($1::text[]) AS t`,
			types).Scan(&ok); err != nil {
			return nil, err
		}
		if !ok {
			continue
		}
		if err := tx.QueryRow(ctx, "SELECT to_regprocedure($1) IS NOT NULL", sig).Scan(&ok); err != nil {
			return nil, err
		}
		if ok {
			out = append(out, "GRANT EXECUTE ON FUNCTION "+sig+" TO "+r)
		}
	}
	return out, nil
}

// ownType is a type of pgrl's in a function's signature (pgrl_slot[]).
var ownType = regexp.MustCompile(`\bpgrl_[a-z_]+`)

// signature qualifies the function signature f (as appFunctions lists it)
// with schemaName: its name, and the names of pgrl's own types among its
// arguments, which are found in that schema whatever the search_path. It
// also returns those types, qualified.
func signature(schemaName, f string) (string, []string) {
	q := pgx.Identifier{schemaName}.Sanitize() + "."
	name, args, _ := strings.Cut(f, "(")
	types := []string{}
	for _, t := range ownType.FindAllString(args, -1) {
		types = append(types, q+t)
	}
	return q + name + "(" + ownType.ReplaceAllString(args, q+"$0"), types
}

// access is what an operation needs of the database user.
type access int

const (
	needUsage  access = iota // read: USAGE on the schema
	needCreate               // migrate up: CREATE on the schema (or the database, to create it)
	needOwner                // down, layout: own pgrl's tables
)

// checkAccess turns a missing privilege into a *PermissionError that names
// the grant, before anything is tried.
func checkAccess(ctx context.Context, conn *pgx.Conn, schemaName string, need access) error {
	var user, db string
	var exists, usage, create, createDB, owner bool
	var tableOwner *string
	err := conn.QueryRow(ctx, `SELECT current_user::text, current_database()::text,
	       n.oid IS NOT NULL,
	       coalesce(has_schema_privilege(n.oid, 'USAGE'), false),
	       coalesce(has_schema_privilege(n.oid, 'CREATE'), false),
	       has_database_privilege(current_database(), 'CREATE'),
	       (SELECT pg_get_userbyid(c.relowner)::text FROM pg_catalog.pg_class c
	         WHERE c.relnamespace = n.oid AND c.relname = 'pgrl_fixed_window'),
	       coalesce((SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_catalog.pg_class c
	         WHERE c.relnamespace = n.oid AND c.relname = 'pgrl_fixed_window'), true)
	  FROM (SELECT 1) AS one LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = $1`, schemaName).
		Scan(&user, &db, &exists, &usage, &create, &createDB, &tableOwner, &owner)
	if err != nil {
		return err
	}
	u, s := pgx.Identifier{user}.Sanitize(), pgx.Identifier{schemaName}.Sanitize()
	switch {
	case !exists && need == needCreate && !createDB:
		return &PermissionError{User: user, Need: "CREATE on database " + db + " (to create schema " + schemaName + ")",
			Fix: "create the schema for it (CREATE SCHEMA " + s + " AUTHORIZATION " + u + ") or GRANT CREATE ON DATABASE " + pgx.Identifier{db}.Sanitize() + " TO " + u}
	case exists && !usage:
		return &PermissionError{User: user, Need: "USAGE on schema " + schemaName,
			Fix: "GRANT USAGE ON SCHEMA " + s + " TO " + u + ", or run as the owner of pgrl's tables"}
	case exists && need == needCreate && !create:
		return &PermissionError{User: user, Need: "CREATE on schema " + schemaName + " (migrations create tables and functions)",
			Fix: "run rl-migrate as the schema's owner (the migration role), or GRANT CREATE ON SCHEMA " + s + " TO " + u}
	case exists && need == needOwner && !owner && tableOwner != nil:
		return &PermissionError{User: user, Need: "ownership of " + schemaName + ".pgrl_fixed_window (owned by " + *tableOwner + ")",
			Fix: "run as " + *tableOwner + " (the migration role), or GRANT " + pgx.Identifier{*tableOwner}.Sanitize() + " TO " + u}
	}
	return nil
}

// run takes the migration lock, checks the recorded version, and runs op.
func (m *Migrator) run(ctx context.Context, need access, dir Direction, op func(*migrate.Migrate, uint) error) (Result, error) {
	var res Result
	err := m.withLock(ctx, need, func(conn *pgx.Conn, schemaName string) error {
		res.Schema = schemaName
		mg, drv, closeFn, err := m.open(schemaName)
		if err != nil {
			return err
		}
		defer closeFn()
		v, dirty, err := drv.Version()
		if err != nil {
			return unwrapDriverError(err)
		}
		current := uint(max(v, 0))
		if dirty {
			return &DirtyError{Version: current, Table: qualified(schemaName, m.cfg.Table)}
		}
		if current != 0 {
			if _, err := Lookup(current); err != nil {
				return &UnknownVersionError{Version: current, Available: Available(), InDatabase: true}
			}
		}
		res.From, res.To = current, current
		drv.lastClean, drv.dir = v, dir

		stop := context.AfterFunc(ctx, func() {
			select {
			case mg.GracefulStop <- true:
			default:
			}
		})
		defer stop()

		err = op(mg, current)
		res.To = uint(max(drv.lastClean, 0))
		res.Applied, res.Reverted = between(res.From, res.To)
		if err == nil || errors.Is(err, migrate.ErrNoChange) {
			if ctx.Err() != nil && res.To != m.target(dir) {
				return fmt.Errorf("stopped after version %d: %w", res.To, ctx.Err())
			}
			return nil
		}
		var dirtyErr migrate.ErrDirty
		if errors.As(err, &dirtyErr) {
			return &DirtyError{Version: uint(max(dirtyErr.Version, 0)), Table: qualified(schemaName, m.cfg.Table)}
		}
		var pgErr *pgconn.PgError
		if drv.runErr != nil && errors.As(unwrapDriverError(drv.runErr), &pgErr) {
			// The file ran as one transaction, which the server rolled
			// back: record the version before it again.
			failed := drv.dirtyTarget
			if dir == Down {
				failed = drv.lastClean
			}
			if resetErr := drv.Driver.SetVersion(drv.lastClean, false); resetErr != nil {
				return fmt.Errorf("migration %d failed (%w) and resetting the version failed too: %v", failed, pgErr, unwrapDriverError(resetErr))
			}
			mig, _ := Lookup(uint(max(failed, 0)))
			return &FailedError{Migration: mig, Direction: dir, Version: res.To, Err: pgErr}
		}
		return unwrapDriverError(err)
	})
	return res, err
}

// target is where an unbounded operation in direction dir ends.
func (m *Migrator) target(dir Direction) uint {
	if dir == Down {
		return 0
	}
	return Latest().Version
}

// withLock runs fn holding the migration lock on the control connection.
func (m *Migrator) withLock(ctx context.Context, need access, fn func(*pgx.Conn, string) error) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	conn, schemaName, err := m.control(ctx)
	if err != nil {
		return err
	}
	if err := checkAccess(ctx, conn, schemaName, need); err != nil {
		return err
	}
	key := "pgrl-migrate/" + schemaName + "/" + m.cfg.Table
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+quoteLiteral(millis(m.cfg.LockWait))); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended(current_database() || '/' || $1, 0))", key)
		return err
	})
	if err != nil {
		if pgerr.IsLockTimeout(err) {
			return fmt.Errorf("%w: another migrator held it for more than %s (schema %s); wait for it to finish or raise the wait (--lock-wait)",
				ErrLockWait, m.cfg.LockWait, schemaName)
		}
		return err
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock(hashtextextended(current_database() || '/' || $1, 0))", key); err != nil {
			// Closing the session releases the lock as well.
			_ = conn.Close(uctx)
		}
	}()
	if need == needCreate {
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", schemaName).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schemaName}.Sanitize()); err != nil {
				return err
			}
		}
	}
	return fn(conn, schemaName)
}

// control returns the control connection, opening it when needed, and the
// schema to work in. The caller holds m.mu.
func (m *Migrator) control(ctx context.Context) (*pgx.Conn, string, error) {
	if m.conn == nil || m.conn.IsClosed() {
		conn, err := pgx.ConnectConfig(ctx, m.connCfg)
		if err != nil {
			return nil, "", err
		}
		if err := conn.QueryRow(ctx, "SELECT current_user::text, current_database()::text").Scan(&m.user, &m.database); err != nil {
			_ = conn.Close(ctx)
			return nil, "", err
		}
		m.conn = conn
	}
	if m.schema == "" {
		if m.cfg.Schema != "" {
			m.schema = m.cfg.Schema
		} else {
			var s *string
			if err := m.conn.QueryRow(ctx, "SELECT current_schema()").Scan(&s); err != nil {
				return nil, "", err
			}
			if s == nil {
				return nil, "", errors.New("no schema to migrate: the connection's search_path names no existing schema; pass a schema (--schema) or fix search_path")
			}
			m.schema = *s
		}
	}
	return m.conn, m.schema, nil
}

// status reads the migrations table and pgrl_fixed_window's layout.
func (m *Migrator) status(ctx context.Context, conn *pgx.Conn, schemaName string) (Status, error) {
	st := Status{Schema: schemaName, Table: m.cfg.Table, Latest: Latest().Version, Applied: []Migration{}, Pending: []Migration{}}
	table := qualified(schemaName, m.cfg.Table)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil {
		return st, err
	}
	if exists {
		var v int64
		err := conn.QueryRow(ctx, "SELECT version, dirty FROM "+table+" LIMIT 1").Scan(&v, &st.Dirty)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return st, m.readDenied(err, schemaName, m.cfg.Table)
		}
		st.Version = uint(max(v, 0))
	}
	for _, a := range Available() {
		if a.Version <= st.Version {
			st.Applied = append(st.Applied, a)
		} else {
			st.Pending = append(st.Pending, a)
		}
	}
	var kind *string
	err := conn.QueryRow(ctx, `SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = 'pgrl_fixed_window'`, schemaName).Scan(&kind)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return st, err
	case *kind == "p":
		st.Layout = LayoutPartitioned
		settings := qualified(schemaName, "pgrl_partition_settings")
		var secs int64
		err := conn.QueryRow(ctx, "SELECT partition_seconds FROM "+settings+" WHERE table_name = 'pgrl_fixed_window'").Scan(&secs)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return st, m.readDenied(err, schemaName, "pgrl_partition_settings")
		}
		st.PartitionWidth = time.Duration(secs) * time.Second
	default:
		st.Layout = LayoutPlain
	}
	return st, nil
}

// readDenied turns a refused read of table into a *PermissionError that
// names the grant; other errors pass unchanged. The caller holds m.mu.
func (m *Migrator) readDenied(err error, schemaName, table string) error {
	if kind, _ := pgerr.Classify(err); kind != pgerr.Permission {
		return err
	}
	u := pgx.Identifier{m.user}.Sanitize()
	return &PermissionError{User: m.user, Need: "SELECT on " + schemaName + "." + table + " (status, Check and a no-op up read it)",
		Fix: "run `rl-migrate --schema " + schemaName + " up --grant-to " + m.user + "` as the owner of pgrl's tables, which grants it, or GRANT SELECT ON TABLE " +
			qualified(schemaName, table) + " TO " + u}
}

// open builds a golang-migrate instance on a connection of its own whose
// search_path is the schema. closeFn closes it.
func (m *Migrator) open(schemaName string) (*migrate.Migrate, *trackingDriver, func(), error) {
	c := m.connCfg.Copy()
	c.RuntimeParams["search_path"] = pgx.Identifier{schemaName}.Sanitize()
	db := stdlib.OpenDB(*c)
	db.SetMaxOpenConns(2)
	inner, err := pgxmigrate.WithInstance(db, &pgxmigrate.Config{MigrationsTable: m.cfg.Table, SchemaName: schemaName})
	if err != nil {
		_ = db.Close()
		return nil, nil, nil, unwrapDriverError(err)
	}
	drv := &trackingDriver{Driver: inner, lastClean: database.NilVersion, dirtyTarget: database.NilVersion,
		log: m.cfg.Logger.With("schema", schemaName)}
	src, err := iofs.New(schema.FS, ".")
	if err != nil {
		_ = inner.Close()
		return nil, nil, nil, err
	}
	mg, err := migrate.NewWithInstance("iofs", src, "pgx5", drv)
	if err != nil {
		_ = inner.Close()
		return nil, nil, nil, err
	}
	mg.Log = migrateLogger{l: m.cfg.Logger.With("schema", schemaName)}
	mg.LockTimeout = m.cfg.LockTimeout + 10*time.Second
	return mg, drv, func() { _, _ = mg.Close() }, nil
}

// trackingDriver remembers the last clean version recorded and the last
// error of a migration file, so that a file the server rejected (and rolled
// back) does not leave the table dirty. It also logs each file it ran with
// the time that file took.
type trackingDriver struct {
	database.Driver
	lastClean   int
	dirtyTarget int
	runErr      error
	dir         Direction
	log         *slog.Logger
}

func (d *trackingDriver) Run(r io.Reader) error {
	// golang-migrate records the target version as dirty before running a
	// file: up runs the file of that version, down the one of the version
	// it leaves.
	v, verb := d.dirtyTarget, "applied"
	if d.dir == Down {
		v, verb = d.lastClean, "reverted"
	}
	start := time.Now()
	err := d.Driver.Run(r)
	if err != nil {
		d.runErr = err
		return err
	}
	mig, lookupErr := Lookup(uint(max(v, 0)))
	name := mig.String()
	if lookupErr != nil {
		name = strconv.Itoa(v)
	}
	d.log.Info(verb+" migration "+name, "took", time.Since(start).Round(100*time.Microsecond).String())
	return nil
}

func (d *trackingDriver) SetVersion(version int, dirty bool) error {
	err := d.Driver.SetVersion(version, dirty)
	if err == nil {
		if dirty {
			d.dirtyTarget = version
		} else {
			d.lastClean = version
		}
	}
	return err
}

// migrateLogger adapts slog to golang-migrate's logger.
type migrateLogger struct{ l *slog.Logger }

// migrateRunLine is golang-migrate's line after each file ("1/u counters
// (12.1ms)"), whose time counts from the start of the whole run, not of the
// file: trackingDriver logs each file with its own time instead.
var migrateRunLine = regexp.MustCompile(`^[0-9]+/[ud] \S+ \([^)]*\)$`)

func (g migrateLogger) Printf(format string, v ...any) {
	line := strings.TrimSpace(fmt.Sprintf(format, v...))
	if migrateRunLine.MatchString(line) {
		return
	}
	g.l.Info(line)
}

func (g migrateLogger) Verbose() bool { return false }

// unwrapDriverError replaces golang-migrate's database.Error, which quotes
// the whole migration and hides its cause, by its cause.
func unwrapDriverError(err error) error {
	var v database.Error
	if errors.As(err, &v) && v.OrigErr != nil {
		return v.OrigErr
	}
	var p *database.Error
	if errors.As(err, &p) && p.OrigErr != nil {
		return p.OrigErr
	}
	if errors.Is(err, sql.ErrConnDone) {
		return errors.New("the database connection was closed")
	}
	return err
}

// between lists the migrations applied (from < to) or reverted (from > to).
func between(from, to uint) (applied, reverted []Migration) {
	applied, reverted = []Migration{}, []Migration{}
	all := Available()
	if to > from {
		for _, a := range all {
			if a.Version > from && a.Version <= to {
				applied = append(applied, a)
			}
		}
	}
	if from > to {
		for i := len(all) - 1; i >= 0; i-- {
			if all[i].Version <= from && all[i].Version > to {
				reverted = append(reverted, all[i])
			}
		}
	}
	return applied, reverted
}

func qualified(schemaName, table string) string {
	return pgx.Identifier{schemaName, table}.Sanitize()
}

func millis(d time.Duration) string { return fmt.Sprintf("%dms", d.Milliseconds()) }

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
