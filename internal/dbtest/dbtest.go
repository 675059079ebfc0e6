// Package dbtest gives tests a real PostgreSQL to work against.
//
// The server is the one named by PGRL_TEST_DATABASE_URL, or
// postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable when it is
// unset (scripts/test.sh starts a local server and creates that database when
// none is reachable). Every test gets a schema of its own, created empty or
// with pgrl's migrations applied and dropped when the test ends, so tests run
// in parallel without seeing each other's rows.
package dbtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/sql/schema"
)

// EnvURL is the environment variable that points the tests at a database.
const EnvURL = "PGRL_TEST_DATABASE_URL"

// DefaultURL is the database the tests use when EnvURL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable"

// URL returns the test database's connection string.
func URL() string {
	if u := os.Getenv(EnvURL); u != "" {
		return u
	}
	return DefaultURL
}

var (
	adminOnce sync.Once
	adminPool *pgxpool.Pool
	adminErr  error
)

// Admin returns a pool on the test database outside any test schema, shared
// by every test of the process. The test fails at once when the database
// cannot be reached.
func Admin(t testing.TB) *pgxpool.Pool {
	t.Helper()
	adminOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cfg, err := pgxpool.ParseConfig(URL())
		if err != nil {
			adminErr = fmt.Errorf("parse %s: %w", EnvURL, err)
			return
		}
		cfg.MaxConns = 4
		adminPool, adminErr = pgxpool.NewWithConfig(ctx, cfg)
		if adminErr == nil {
			adminErr = adminPool.Ping(ctx)
		}
		if adminErr != nil {
			adminErr = fmt.Errorf("test database %s unreachable (%w); run scripts/test.sh, which starts one, or set %s", URL(), adminErr, EnvURL)
		}
	})
	if adminErr != nil {
		t.Fatal(adminErr)
	}
	return adminPool
}

// NewSchema creates an empty schema with a unique name, drops it (and all it
// holds) when the test ends, and returns its name.
func NewSchema(t testing.TB) string {
	t.Helper()
	admin := Admin(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "pgrl_test_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Logf("drop schema %s: %v", name, err)
		}
	})
	return name
}

// Migrate applies every embedded up migration, in order, inside schemaName.
// It does not record versions: tests of the migration tool use that tool.
// When the database has the citus extension, the tables are distributed
// the way rl-migrate up distributes them (migration.Distribute).
func Migrate(t testing.TB, schemaName string) {
	t.Helper()
	ctx := context.Background()
	conn, err := Admin(t).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if err := Apply(ctx, conn.Conn(), schemaName); err != nil {
		t.Fatal(err)
	}
}

// Apply runs every embedded up migration, in order, in one transaction on
// conn: inside schemaName, or in the connection's default schema when
// schemaName is empty. It records no version. Then, in a transaction of
// its own, it calls migration.Distribute, which distributes pgrl's tables
// when the database has the citus extension and does nothing otherwise.
func Apply(ctx context.Context, conn *pgx.Conn, schemaName string) error {
	names, err := fs.Glob(schema.FS, "*.up.sql")
	if err != nil {
		return err
	}
	sort.Strings(names)
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if schemaName != "" {
		if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schemaName}.Sanitize()); err != nil {
			return err
		}
	}
	for _, n := range names {
		body, err := fs.ReadFile(schema.FS, n)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, string(body)); err != nil {
			return fmt.Errorf("apply %s: %w", n, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	// On Citus, the tables are distributed as rl-migrate up distributes
	// them, by the same function.
	if schemaName == "" {
		var s *string
		if err := conn.QueryRow(ctx, "SELECT current_schema()").Scan(&s); err != nil {
			return err
		}
		if s == nil {
			return nil
		}
		schemaName = *s
	}
	// Tests that distribute their schemas at once may deadlock on Citus:
	// Distribute tries again when it is the victim.
	_, err = migration.Distribute(ctx, conn, schemaName)
	return err
}

// Option adjusts the pool configuration that Pool builds.
type Option func(*pgxpool.Config)

// WithExecMode sets pgx's query exec mode on every connection of the pool.
func WithExecMode(mode pgx.QueryExecMode) Option {
	return func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode }
}

// WithMaxConns sets the pool's size.
func WithMaxConns(n int32) Option {
	return func(c *pgxpool.Config) { c.MaxConns = n }
}

// Pool returns a pool whose connections use a fresh, migrated schema as
// their search_path. The pool closes and the schema is dropped when the test
// ends. It also returns the schema's name.
func Pool(t testing.TB, opts ...Option) (*pgxpool.Pool, string) {
	t.Helper()
	name := NewSchema(t)
	Migrate(t, name)
	return PoolOn(t, name, opts...), name
}

// PoolOn returns a pool whose search_path is the given schema. It closes when
// the test ends.
func PoolOn(t testing.TB, schemaName string, opts ...Option) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schemaName
	cfg.MaxConns = 8
	for _, o := range opts {
		o(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// URLWithSchema returns the test database URL with search_path set to the
// schema, for handing to another process or a CLI.
func URLWithSchema(schemaName string) string {
	u := URL()
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "search_path=" + schemaName
}

// NewRole creates a role that can log in with a password and has no
// privilege at all (beyond what PostgreSQL gives PUBLIC), and returns its
// name. When the test ends it drops what the role owns and the role. Use
// URLAs to connect as it.
func NewRole(t testing.TB) string {
	t.Helper()
	admin := Admin(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "pgrl_role_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{name}.Sanitize()+" LOGIN PASSWORD "+quote(rolePassword(name))); err != nil {
		t.Fatalf("create role %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		id := pgx.Identifier{name}.Sanitize()
		for _, stmt := range []string{"DROP OWNED BY " + id + " CASCADE", "DROP ROLE " + id} {
			if _, err := admin.Exec(ctx, stmt); err != nil {
				t.Logf("%s: %v", stmt, err)
			}
		}
	})
	return name
}

// URLAs returns the test database URL with the user (and password) of a
// role made by NewRole.
func URLAs(role string) string {
	u, err := url.Parse(URL())
	if err != nil || u.Scheme == "" {
		return URL() + " user=" + role + " password=" + rolePassword(role)
	}
	u.User = url.UserPassword(role, rolePassword(role))
	return u.String()
}

// URLAsWithSchema is URLAs with search_path set to the schema.
func URLAsWithSchema(role, schemaName string) string {
	u, err := url.Parse(URLAs(role))
	if err != nil {
		return URLAs(role)
	}
	q := u.Query()
	q.Set("search_path", schemaName)
	// Encode writes a space as "+", which libpq-style URL parsing keeps as
	// a plus (options=-c name=value would become "-c+name=value"); "%20" it
	// decodes. A literal "+" is already "%2B".
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	return u.String()
}

func rolePassword(role string) string { return "pw-" + role }

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// ForExamples creates a fresh schema with pgrl's migrations applied and a
// pool whose search_path is that schema, for Example functions, which take
// no *testing.T: call it from TestMain. The returned function closes the
// pool and drops the schema.
func ForExamples() (*pgxpool.Pool, string, func(), error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, URL())
	if err != nil {
		return nil, "", nil, err
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "pgrl_example_" + hex.EncodeToString(b[:])
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		admin.Close()
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		admin.Close()
		return nil, "", nil, fmt.Errorf("test database %s unreachable or unusable (%w); run scripts/test.sh, which starts one, or set %s", URL(), err, EnvURL)
	}
	conn, err := admin.Acquire(ctx)
	if err == nil {
		err = Apply(ctx, conn.Conn(), name)
		conn.Release()
	}
	if err != nil {
		drop()
		return nil, "", nil, err
	}
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		drop()
		return nil, "", nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		drop()
		return nil, "", nil, err
	}
	// Open a few connections before the examples run, as a running
	// application's pool has them: the examples use the default Timeout,
	// and on a loaded machine opening a connection can take longer than it,
	// which would hand an example's check to the failure policy.
	if err := warm(ctx, pool, 4); err != nil {
		pool.Close()
		drop()
		return nil, "", nil, err
	}
	return pool, name, func() { pool.Close(); drop() }, nil
}

// NewDatabase creates an empty database on the test server, dropped when
// the test ends, and returns its URL: for tests of what a command does to a
// database of the user's own.
func NewDatabase(t testing.TB) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "pgrl_db_test_" + hex.EncodeToString(b[:])
	admin := Admin(t)
	if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	u, err := url.Parse(URL())
	if err != nil || u.Scheme == "" {
		t.Fatalf("this test needs %s in URL form, not %q", EnvURL, URL())
	}
	u.Path = "/" + name
	return u.String()
}

// ObjectsIn counts the relations (tables, sequences, views, indexes) and
// functions in a schema of the database at dbURL.
func ObjectsIn(t testing.TB, dbURL, schemaName string) int {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var n int
	if err := conn.QueryRow(context.Background(), `
		SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace WHERE s.nspname = $1)
		     + (SELECT count(*) FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace WHERE s.nspname = $1)`, schemaName).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// warm opens n connections of pool at once and returns them to it.
func warm(ctx context.Context, pool *pgxpool.Pool, n int) error {
	conns := make([]*pgxpool.Conn, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conns[i], errs[i] = pool.Acquire(ctx)
			if errs[i] == nil {
				errs[i] = conns[i].Ping(ctx)
			}
		}()
	}
	wg.Wait()
	for _, c := range conns {
		if c != nil {
			c.Release()
		}
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
