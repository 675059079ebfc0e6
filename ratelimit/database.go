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
// A Database is safe for concurrent use. It starts no goroutine of its own, so
// it needs no closing: it lives as long as its limiters do.
type Database struct {
	db        DB // the pool's share when db is a *pgxpool.Pool
	opts      DatabaseOptions
	coalescer *coalescer // nil when coalescing is off or db is one connection
	breaker   *breaker

	mu    sync.Mutex
	names []string // the limits made from the Database, for the Observer's breaker events
}

// DatabaseOptions configures a Database. The zero value is the defaults.
type DatabaseOptions struct {
	// Timeout bounds every check's wait for PostgreSQL, whatever the
	// caller's context: when it passes, the limit's failure policy answers.
	// Defaults to DefaultTimeout. Config.Timeout says how to choose it.
	Timeout time.Duration

	// BreakerThreshold is how many consecutive database failures open the
	// breaker, which then answers every limit of the Database by its failure
	// policy without a round trip. Defaults to DefaultBreakerThreshold.
	BreakerThreshold int

	// BreakerCooldown is how long the breaker stays open before one check
	// probes the database again. Defaults to DefaultBreakerCooldown.
	BreakerCooldown time.Duration

	// DisableCoalescing sends every check as a statement of its own.
	// Config.DisableCoalescing says when that helps.
	DisableCoalescing bool

	// MaxBatch and MaxInFlight bound the coalescer: the most checks in one
	// statement (default DefaultMaxBatch), and the most statements of one
	// algorithm in flight at once (default DefaultMaxInFlight).
	MaxBatch, MaxInFlight int

	// CreatePartitions lets a check create its window's partition when the
	// partitioned layout has none (Config.CreatePartitions says more).
	CreatePartitions bool

	// Cleanup, when not nil, deletes expired counters now and then from
	// the checks' own path (see cleanup.Opportunistic).
	Cleanup *cleanup.Opportunistic

	// Observer receives every decision of the Database's limits (under each
	// limit's name) and the breaker's changes (once per limit, since the
	// breaker keeps every limit of the Database away from the database).
	Observer Observer

	// Logger receives outage and recovery events and shadow denials.
	// Defaults to slog.Default().
	Logger *slog.Logger
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
	s := &Database{db: db, opts: opts}
	if !opts.DisableCoalescing && !singleConn(db) {
		s.coalescer = newCoalescer(opts.MaxBatch, opts.MaxInFlight)
	}
	s.breaker = newBreaker(opts, "", s.observeBreaker)
	return s, nil
}

// Limiter returns a limit kept in the Database's database. cfg describes the
// limit; the Database's options (DatabaseOptions) hold what is per database, and
// setting one of those in cfg as well is refused with ErrInvalidOption,
// naming the DatabaseOptions field. The limiters of one Database share its
// coalescer, breaker and pool share.
func (s *Database) Limiter(cfg Config) (*Limiter, error) {
	if err := cfg.perLimitOnly(); err != nil {
		return nil, err
	}
	o := s.opts
	cfg.Timeout, cfg.BreakerThreshold, cfg.BreakerCooldown = o.Timeout, o.BreakerThreshold, o.BreakerCooldown
	cfg.DisableCoalescing, cfg.MaxBatch, cfg.MaxInFlight = o.DisableCoalescing, o.MaxBatch, o.MaxInFlight
	cfg.CreatePartitions, cfg.Cleanup, cfg.Observer, cfg.Logger = o.CreatePartitions, o.Cleanup, o.Observer, o.Logger
	if err := cfg.Validate(); err != nil {
		return nil, err
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

// databaseOf is the Database of a limiter made by New: its own breaker, and the
// coalescer New's limiters with the same database and coalescer settings
// share. cfg has its defaults filled in.
func databaseOf(db DB, cfg Config) *Database {
	if pool, ok := db.(*pgxpool.Pool); ok {
		db = sharedPoolFor(pool)
	}
	s := &Database{db: db, opts: DatabaseOptions{
		Timeout: cfg.Timeout, BreakerThreshold: cfg.BreakerThreshold, BreakerCooldown: cfg.BreakerCooldown,
		DisableCoalescing: cfg.DisableCoalescing, MaxBatch: cfg.MaxBatch, MaxInFlight: cfg.MaxInFlight,
		CreatePartitions: cfg.CreatePartitions, Cleanup: cfg.Cleanup, Observer: cfg.Observer, Logger: cfg.Logger,
	}}
	if !cfg.DisableCoalescing && !singleConn(db) {
		s.coalescer = sharedCoalescer(db, cfg.MaxBatch, cfg.MaxInFlight)
	}
	s.breaker = newBreaker(s.opts, cfg.Name, func(open bool) {
		if cfg.Observer != nil {
			cfg.Observer.ObserveBreaker(cfg.Name, open)
		}
	})
	return s
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

// perLimitOnly refuses a Config given to Database.Limiter that sets what the
// Database holds.
func (c Config) perLimitOnly() error {
	for _, f := range []struct {
		name string
		set  bool
	}{
		{"Timeout", c.Timeout != 0},
		{"BreakerThreshold", c.BreakerThreshold != 0},
		{"BreakerCooldown", c.BreakerCooldown != 0},
		{"DisableCoalescing", c.DisableCoalescing},
		{"MaxBatch", c.MaxBatch != 0},
		{"MaxInFlight", c.MaxInFlight != 0},
		{"CreatePartitions", c.CreatePartitions},
		{"Cleanup", c.Cleanup != nil},
		{"Observer", c.Observer != nil},
		{"Logger", c.Logger != nil},
	} {
		if f.set {
			return invalid(ErrInvalidOption, "Config.%s for %q: a limit made by Database.Limiter takes it from its Database; set DatabaseOptions.%s instead", f.name, c.Name, f.name)
		}
	}
	return nil
}
