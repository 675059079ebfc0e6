package migration_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// databaseURL and schema stand for the application's DATABASE_URL and the
// schema it keeps pgrl's tables in: the test database and a schema name of
// this run, dropped when the tests end.
var databaseURL, schema string

func TestMain(m *testing.M) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	databaseURL, schema = dbtest.URL(), "pgrl_example_"+hex.EncodeToString(b[:])
	code := m.Run()
	ctx := context.Background()
	if conn, err := pgx.Connect(ctx, databaseURL); err == nil {
		_, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		_ = conn.Close(ctx)
	}
	os.Exit(code)
}

// The body of this example, after its first line, is the README's snippet
// for migrating at start-up (TestREADMEMigrationSnippets).
func ExampleMigrator_Up() {
	ctx := context.Background()
	m, err := migration.New(databaseURL, migration.Config{Schema: schema})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = m.Close() }()
	res, err := m.Up(ctx) // no pending migration is success
	if errors.Is(err, migration.ErrDirty) {
		log.Fatal("someone must run `rl-migrate force N`: ", err)
	}
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("applied any:", len(res.Applied) > 0)
	// Output:
	// applied any: true
}

// Runs after ExampleMigrator_Up, on the schema it migrated.
func ExampleMigrator_Check() {
	ctx := context.Background()
	m, err := migration.New(databaseURL, migration.Config{Schema: schema})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = m.Close() }()
	// At start-up, under the application's own role: refuse to serve until
	// the schema is current.
	if err := m.Check(ctx); err != nil {
		log.Fatal(err) // migration.ErrPending names the versions and the command to run
	}
	res, err := m.Up(ctx) // a second Up finds nothing to do
	if err != nil {
		log.Fatal(err)
	}
	st, err := m.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("applied any:", len(res.Applied) > 0)
	fmt.Println("up to date:", st.Version == st.Latest, "layout:", st.Layout)
	// Output:
	// applied any: false
	// up to date: true layout: plain
}
