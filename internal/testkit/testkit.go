// Package testkit holds the helpers that tests of several packages share:
// a settable clock for DatabaseOptions.Now (and MemoryOptions.Now), a log
// buffer safe for concurrent writers, a pool on which every statement
// fails, a pool wrapper that counts statements, and a limiter constructor
// that fails the test on error. Tests that need a real database get it
// from package dbtest.
package testkit

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/ratelimit"
)

// Clock is a settable clock for DatabaseOptions.Now or MemoryOptions.Now,
// safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock standing at t.
func NewClock(t time.Time) *Clock { return &Clock{t: t} }

// Now returns the clock's instant; pass the method value c.Now as
// DatabaseOptions.Now or MemoryOptions.Now.
func (c *Clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

// Set moves the clock to t.
func (c *Clock) Set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

// Add moves the clock by d.
func (c *Clock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// Pinned returns a DatabaseOptions.Now (or MemoryOptions.Now) that always
// answers t.
func Pinned(t time.Time) func() time.Time { return func() time.Time { return t } }

// LogBuffer captures log output (such as a slog handler's); safe for
// concurrent writers.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// DeadURL is a database URL on a port where nothing listens.
const DeadURL = "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2"

// DeadPool returns a pool on DeadURL: every statement fails to connect. It
// closes when the test ends.
func DeadPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), DeadURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// DecisionTimeout is the Timeout NewLimiter gives a limiter whose Config
// sets none. Tests that compare PostgreSQL's decisions with a model, a
// replay or each other must get PostgreSQL's answer: on a test machine
// under load (the race detector, another suite beside it) a check can take
// longer than ratelimit.DefaultTimeout, and the failure policy's answer
// would be taken for a wrong decision. Tests of timeouts and of the
// defaults set Timeout themselves or call New.
const DecisionTimeout = time.Minute

// New is a limit of cfg on a Database of its own on db, made with opts
// (the first, when given): what ratelimit.New was before the Database,
// for tests of one limit. Limits that must share a coalescer or a breaker
// come from one Database (NewDatabase).
func New(db ratelimit.DB, cfg ratelimit.Config, opts ...ratelimit.DatabaseOptions) (*ratelimit.Limiter, error) {
	var o ratelimit.DatabaseOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	d, err := ratelimit.NewDatabase(db, o)
	if err != nil {
		return nil, err
	}
	return d.Limiter(cfg)
}

// NewDatabase is ratelimit.NewDatabase, failing the test on error, with
// Timeout DecisionTimeout unless opts sets one.
func NewDatabase(t testing.TB, db ratelimit.DB, opts ratelimit.DatabaseOptions) *ratelimit.Database {
	t.Helper()
	if opts.Timeout == 0 {
		opts.Timeout = DecisionTimeout
	}
	d, err := ratelimit.NewDatabase(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Limiter is d.Limiter, failing the test on error.
func Limiter(t testing.TB, d *ratelimit.Database, cfg ratelimit.Config) *ratelimit.Limiter {
	t.Helper()
	l, err := d.Limiter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// NewLimiter is New failing the test on error, with Timeout
// DecisionTimeout unless opts sets one.
func NewLimiter(t testing.TB, db ratelimit.DB, cfg ratelimit.Config, opts ...ratelimit.DatabaseOptions) *ratelimit.Limiter {
	t.Helper()
	var o ratelimit.DatabaseOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	return Limiter(t, NewDatabase(t, db, o), cfg)
}

// Reset empties the buffer.
func (b *LogBuffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}
