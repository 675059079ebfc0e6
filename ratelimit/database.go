package ratelimit

import (
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/cleanup"
)

// Database is pgrl in one PostgreSQL database: what every limit kept there
// shares. It holds the database's share of the pool (PoolShareDivisor), the
// coalescer that packs concurrent checks of all its limits into shared
// statements, the deadline of a check, the circuit breaker that judges the
// database's health once for all its limits, opportunistic cleanup, the
// Observer and the Logger. Build one per database when the application
// starts and make every limit from it with Database.Limiter:
//
//	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{})
//	...
//	login, err := limits.Limiter(ratelimit.Config{Name: "login:ip", Limit: 10, Window: time.Minute})
//
// A Database is safe for concurrent use. It needs no closing: it lives as
// long as its limiters do, and the goroutines it starts (one that ends
// checks past their Timeout, and one that extends the slots of concurrency
// limits) end a little after its last check or slot.
type Database struct {
	db        DB // the pool's share when db is a *pgxpool.Pool
	opts      DatabaseOptions
	coalescer *coalescer // nil when coalescing is off or db is one connection
	breaker   *breaker
	deadlines *deadlines // bounds each check by opts.Timeout

	mu    sync.Mutex
	names []string // the limits made from the Database, for the Observer's breaker events

	keeperOnce sync.Once
	keeper     *slotKeeper // extends the slots of concurrency limits (slot.go)

	policies sync.Map // stored policy name → *policyOverrides, shared by its limiters
}

// DatabaseOptions configures a Database: what is per database. The zero
// value is the defaults.
type DatabaseOptions struct {
	// Timeout bounds each check's wait for PostgreSQL (a connection, the
	// round trip, a row lock), on the client and whatever the caller's
	// context: a context with no deadline, or a later one, does not lengthen
	// it. When it passes, the limit's failure policy answers (FailToMemory
	// by default), so a stalled or partitioned database never stalls the
	// application. Pair it with a server-side statement_timeout a little
	// shorter (see StatementTimeoutParam), so that PostgreSQL abandons a
	// slow statement itself and the connection survives. pgx closes a
	// connection whose statement was abandoned: a Database on a single
	// *pgx.Conn loses its connection at the first timeout, so give it a
	// pool. A check is ended within a sixteenth of the Timeout after it has
	// passed (one goroutine per Database ends them, rather than a timer per
	// check; Timeouts under 16ms keep a timer). Peek and Reset are bounded
	// by it too (they return the error).
	// Checks inside the caller's transaction (…Tx) are bounded by the
	// caller's context alone. Defaults to DefaultTimeout (500ms); negative
	// values are refused with ErrInvalidTimeout.
	Timeout time.Duration

	// BreakerThreshold is how many consecutive failed checks (of any limit
	// of the Database) open the breaker; while open, checks skip the
	// database and each limit's failure policy answers. Defaults to
	// DefaultBreakerThreshold (5). Negative values are refused with
	// ErrInvalidOption.
	BreakerThreshold int

	// BreakerCooldown is how long the breaker stays open before one check
	// probes the database again. Defaults to DefaultBreakerCooldown
	// (500ms). Negative values are refused with ErrInvalidTimeout.
	BreakerCooldown time.Duration

	// DisableCoalescing turns off the coalescing of concurrent checks. By
	// default, checks that arrive while MaxInFlight round trips are
	// already running, or while a check of their key is in flight, wait
	// and go out together, one statement for up to MaxBatch of them (of
	// every limit of the Database), decided exactly as if one after
	// another; a hot key's waiting checks are decided by one update of its
	// row. A check that finds the way clear goes out at once, alone, so a
	// lone caller's latency does not change. A Database on a *pgx.Conn or
	// a pgx.Tx never coalesces; one on a pool, or on a DB of your own that
	// wraps a pool, does. Set DisableCoalescing for a DB of your own that
	// wraps a single connection. Defaults to false (coalescing on).
	DisableCoalescing bool

	// MaxBatch caps the checks that one coalesced round trip decides.
	// Defaults to DefaultMaxBatch (256). Negative values are refused with
	// ErrInvalidOption.
	MaxBatch int

	// MaxInFlight is how many coalesced round trips may run at once before
	// further checks wait to be coalesced (a check of a key in flight
	// always waits: see DisableCoalescing). Measured on two cores, 2 gave
	// the best throughput from 8 to 64 callers without raising the median
	// latency (docs/REDIS.md). Defaults to DefaultMaxInFlight (2).
	// Negative values are refused with ErrInvalidOption.
	MaxInFlight int

	// CreatePartitions lets a fixed-window check in the partitioned layout
	// that finds no partition for its window create it (DDL, from the
	// request path, under the application's role, which must then own
	// pgrl's tables) and check again. Defaults to false: such a check
	// returns ErrNoPartition instead, and partitions are made ahead by
	// `rl-migrate layout`, rl-cleanup --partitions and EnsurePartitions.
	CreatePartitions bool

	// Cleanup, when set, deletes dead counter rows from the request path,
	// for applications that schedule no rl-cleanup: on about one check in
	// Cleanup.Every it starts one small batch in the background, after the
	// check has its answer, so the check is never delayed and never fails
	// because of it. Only a Database on a *pgxpool.Pool uses it. Defaults
	// to nil (off).
	Cleanup *cleanup.Opportunistic

	// Observer receives every decision of the Database's limits (under
	// each limit's name) and the breaker's changes (once per limit, since
	// the breaker keeps every limit of the Database away from the
	// database), for metrics. Defaults to nil (none).
	Observer Observer

	// Logger receives outage and recovery events (once per outage, not per
	// check) and shadow denials. Defaults to slog.Default().
	Logger *slog.Logger

	// ShareMinRetryAfter is the shortest RetryAfter that a limit with
	// Config.ShareDenials sends: shorter denials end before sharing them
	// pays off, and would fill the notification queue. Defaults to
	// DefaultShareMinRetryAfter (1s). Negative values are refused with
	// ErrInvalidTimeout.
	ShareMinRetryAfter time.Duration

	// Now pins the instant each check of every limit of the Database is
	// decided at (their memory fallbacks included), for tests that replay
	// a sequence of instants. Leave it nil in production: the database's
	// clock decides, so that every instance of an application agrees.
	// With Now set, no denial is shared (Config.ShareDenials) nor taken
	// from another process (Limiter.AddDenial). Defaults to nil.
	Now func() time.Time
}

// NewDatabase returns the Database of the database db: a *pgxpool.Pool (or a
// wrapper around one) for applications; a *pgx.Conn or a pgx.Tx serves one
// statement at a time and so is never coalesced. NewDatabase validates opts and
// does not touch the database.
func NewDatabase(db DB, opts DatabaseOptions) (*Database, error) {
	if isNil(db) {
		return nil, ErrNilDB
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if pool, ok := db.(*pgxpool.Pool); ok {
		// Checks hold at most their share of the pool (PoolShareDivisor).
		db = sharedPoolFor(pool)
	}
	s := &Database{db: db, opts: opts, deadlines: newDeadlines(opts.Timeout)}
	if !opts.DisableCoalescing && !singleConn(db) {
		s.coalescer = newCoalescer(opts.MaxBatch, opts.MaxInFlight)
	}
	s.breaker = newBreaker(opts, s.observeBreaker)
	return s, nil
}

// Limiter returns a limit kept in the Database's database, described by
// cfg (validated as Config.Validate does). The limits of one Database share
// its coalescer, breaker, pool share, Timeout, Observer, Logger and clock
// (Now).
func (s *Database) Limiter(cfg Config) (*Limiter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Algorithm == Concurrency && singleConn(s.db) {
		return nil, invalid(ErrInvalidOption, "concurrency limit %q on a single connection (a *pgx.Conn or a pgx.Tx): its slots are extended in the background, beside the application's statements, which one connection cannot run at once; make the Database on a *pgxpool.Pool", cfg.Name)
	}
	l, err := newLimiter(s, cfg)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	if !slices.Contains(s.names, cfg.Name) {
		s.names = append(s.names, cfg.Name)
	}
	s.mu.Unlock()
	return l, nil
}

// Options returns the Database's options, defaults filled in.
func (s *Database) Options() DatabaseOptions { return s.opts }

// observeBreaker tells the Observer that the breaker opened or closed, once
// for each limit of the Database.
func (s *Database) observeBreaker(open bool) {
	if s.opts.Observer == nil {
		return
	}
	s.mu.Lock()
	names := slices.Clone(s.names)
	s.mu.Unlock()
	for _, n := range names {
		s.opts.Observer.ObserveBreaker(n, open)
	}
}

// withDefaults fills defaults and validates.
func (o DatabaseOptions) withDefaults() (DatabaseOptions, error) {
	if o.Timeout < 0 {
		return o, invalid(ErrInvalidTimeout, "DatabaseOptions.Timeout %v; use a positive timeout, or 0 for the default %v", o.Timeout, DefaultTimeout)
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.BreakerThreshold < 0 {
		return o, invalid(ErrInvalidOption, "DatabaseOptions.BreakerThreshold %d; use a positive count of failures, or 0 for %d", o.BreakerThreshold, DefaultBreakerThreshold)
	}
	if o.BreakerThreshold == 0 {
		o.BreakerThreshold = DefaultBreakerThreshold
	}
	if o.BreakerCooldown < 0 {
		return o, invalid(ErrInvalidTimeout, "DatabaseOptions.BreakerCooldown %v; use a positive duration, or 0 for %v", o.BreakerCooldown, DefaultBreakerCooldown)
	}
	if o.BreakerCooldown == 0 {
		o.BreakerCooldown = DefaultBreakerCooldown
	}
	if o.ShareMinRetryAfter < 0 {
		return o, invalid(ErrInvalidTimeout, "DatabaseOptions.ShareMinRetryAfter %v; use a positive duration, or 0 for %v", o.ShareMinRetryAfter, DefaultShareMinRetryAfter)
	}
	if o.ShareMinRetryAfter == 0 {
		o.ShareMinRetryAfter = DefaultShareMinRetryAfter
	}
	if o.MaxBatch < 0 {
		return o, invalid(ErrInvalidOption, "DatabaseOptions.MaxBatch %d; use a positive count of checks, or 0 for %d", o.MaxBatch, DefaultMaxBatch)
	}
	if o.MaxInFlight < 0 {
		return o, invalid(ErrInvalidOption, "DatabaseOptions.MaxInFlight %d; use a positive count of statements, or 0 for %d", o.MaxInFlight, DefaultMaxInFlight)
	}
	if o.MaxBatch == 0 {
		o.MaxBatch = DefaultMaxBatch
	}
	if o.MaxInFlight == 0 {
		o.MaxInFlight = DefaultMaxInFlight
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o, nil
}
