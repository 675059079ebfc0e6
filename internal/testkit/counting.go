package testkit

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// CountingDB is a ratelimit.DB on a pool that counts the statements it
// passes on (Exec, Query and QueryRow calls), for tests that prove a check
// did or did not reach the database.
type CountingDB struct {
	*pgxpool.Pool
	n atomic.Int64
}

// Statements is how many statements went through so far.
func (c *CountingDB) Statements() int64 { return c.n.Load() }

// Exec counts and runs a statement.
func (c *CountingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.n.Add(1)
	return c.Pool.Exec(ctx, sql, args...)
}

// Query counts and runs a query.
func (c *CountingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.n.Add(1)
	return c.Pool.Query(ctx, sql, args...)
}

// QueryRow counts and runs a one-row query.
func (c *CountingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.n.Add(1)
	return c.Pool.QueryRow(ctx, sql, args...)
}
