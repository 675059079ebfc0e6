package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/migration"
)

// prepareDatabase creates the demo's schema when it is missing and applies
// pgrl's migrations to it (a no-op when they are already applied). It
// writes nothing anywhere else: the connection string's search_path is
// ignored. It logs the schema it uses, which is also in the result.
func prepareDatabase(ctx context.Context, connString, schemaName string, log io.Writer) error {
	m, err := migration.New(connString, migration.Config{Schema: schemaName})
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	res, err := m.Up(ctx)
	if err != nil {
		return fmt.Errorf("migrate schema %q: %w", schemaName, err)
	}
	if res.Changed() {
		fmt.Fprintf(log, "multiinstance: migrated schema %q to version %d\n", res.Schema, res.To)
	} else {
		fmt.Fprintf(log, "multiinstance: using schema %q (version %d)\n", res.Schema, res.To)
	}
	return nil
}

// openPool connects a pool of conns connections, with search_path set to
// the demo's schema, and opens all of them, so that no call of the round
// waits for a connection to be established.
func openPool(ctx context.Context, connString, schemaName string, conns int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("invalid --database-url: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{schemaName}.Sanitize()
	cfg.MaxConns = int32(conns)
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "pgrl-multiinstance"
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	held := make([]*pgxpool.Conn, conns)
	errs := make([]error, conns)
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			held[i], errs[i] = pool.Acquire(ctx)
		}()
	}
	wg.Wait()
	for i := range conns {
		if held[i] != nil {
			held[i].Release()
		}
	}
	for _, err := range errs {
		if err != nil {
			pool.Close()
			return nil, err
		}
	}
	return pool, nil
}

// windowMargin is how close to the end of a window a round may start. The
// calls of a round take milliseconds; starting one no closer than this to a
// window boundary keeps all of its calls in one window, so the demo's totals
// do not depend on the moment it was run.
const windowMargin = 3 * time.Second

// awaitWindowRoom waits, when the database clock is within windowMargin of
// the end of a window of the given length (windows are aligned on the Unix
// epoch, as pgrl aligns them), until the next window has begun.
func awaitWindowRoom(ctx context.Context, connString string, window time.Duration, log io.Writer) error {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var nowUs int64
	if err := conn.QueryRow(ctx, "SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint").Scan(&nowUs); err != nil {
		return err
	}
	windowUs := window.Microseconds()
	left := time.Duration(windowUs-nowUs%windowUs) * time.Microsecond
	if left >= windowMargin {
		return nil
	}
	wait := left + 100*time.Millisecond
	fmt.Fprintf(log, "multiinstance: the window ends in %v; waiting %v so that the round counts in one window\n", left.Round(time.Millisecond), wait.Round(time.Millisecond))
	select {
	case <-time.After(wait):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
