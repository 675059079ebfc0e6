package ulule

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/ulule/limiter/v3"
	"github.com/ulule/limiter/v3/drivers/store/common"

	"github.com/pgrl/pgrl/ratelimit"
)

// DB is what the store sends its statements through: a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx.
type DB interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	Query(context.Context, string, ...any) (pgx.Rows, error)
	QueryRow(context.Context, string, ...any) pgx.Row
}

// Errors returned for a bad setup or a bad call. Test with errors.Is; the
// error's text adds the offending value and the fix.
var (
	// ErrNilDB: NewStore was given no database.
	ErrNilDB = errors.New("pgrl ulule store: nil database; pass a *pgxpool.Pool")
	// ErrInvalidPrefix: with ReadableKeys, the prefix contains ':' or is
	// longer than ratelimit.MaxReadableNameBytes.
	ErrInvalidPrefix = errors.New("pgrl ulule store: invalid prefix")
	// ErrInvalidPolicy: OnFailure is not one of the policies, or
	// FailToStore has no Fallback.
	ErrInvalidPolicy = errors.New("pgrl ulule store: invalid failure policy")
	// ErrInvalidTimeout: a negative Timeout.
	ErrInvalidTimeout = errors.New("pgrl ulule store: invalid timeout")
	// ErrInvalidRate: the rate's period is not one pgrl can count in.
	ErrInvalidRate = errors.New("pgrl ulule store: invalid rate")
	// ErrInvalidCount: PostgreSQL refused a negative increment (hits taken
	// back) that a read of the same counter through ratelimit did not
	// explain: the window's count would fall below the bigint range, or the
	// role may read pgrl_fixed_window but not write it. The
	// *pgconn.PgError is wrapped. No failure policy answers it. (Positive
	// counts never overflow: a count stops at the largest bigint.)
	ErrInvalidCount = errors.New("pgrl ulule store: invalid count")
	// ErrKeyTooLong is pgrl's: with ReadableKeys, a key longer than
	// ratelimit.MaxReadableKeyBytes, which PostgreSQL could not index.
	// Hashed keys (the default) take keys of any length.
	ErrKeyTooLong = ratelimit.ErrKeyTooLong
	// ErrNotMigrated is pgrl's: its tables are missing; run rl-migrate up.
	ErrNotMigrated = ratelimit.ErrNotMigrated
	// ErrReadOnly is pgrl's: the database is a read-only standby.
	ErrReadOnly = ratelimit.ErrReadOnly
	// ErrPermission is pgrl's: the database user lacks a grant on
	// pgrl_fixed_window or its schema (a schema without USAGE hides the
	// table, which would otherwise look missing). The message names the
	// grant. No failure policy answers it.
	ErrPermission = ratelimit.ErrPermission
	// ErrUnsupported is pgrl's: the store's SQL does not fit this server
	// (SQLSTATE class 0A or 42, such as a schema another pgrl version
	// migrated, or Citus refusing an upsert). Run `rl-migrate up` with this
	// version. No failure policy answers it.
	ErrUnsupported = ratelimit.ErrUnsupported
)

// FailurePolicy says what Get, Peek and Increment answer when the database
// cannot (connection refused or lost, server shut down, Options.Timeout
// passed, ratelimit's circuit breaker open after repeated failures). It
// never applies to bad input, to a missing migration, grant or partition,
// to a read-only standby, to SQL the server does not support
// (ErrUnsupported): to any error ratelimit.IsConfigError reports, nor to
// ErrInvalidRate or ErrInvalidCount, nor to a call whose own context
// ended: those errors are always returned.
type FailurePolicy int

const (
	// FailError returns the error, as ulule's Redis store does; ulule's
	// middlewares then answer 500 (or call their error handler). The
	// default.
	FailError FailurePolicy = iota
	// FailOpen answers as if the key had not been counted yet: Reached is
	// false and Remaining is the limit. Availability over protection.
	FailOpen
	// FailClosed answers that the limit is reached: Reached is true and
	// Remaining is 0. Protection over availability.
	FailClosed
	// FailToStore asks Options.Fallback, another limiter.Store (ulule's
	// memory store, say), so each process still limits on its own.
	FailToStore
)

// String names the policy.
func (p FailurePolicy) String() string {
	switch p {
	case FailError:
		return "fail with error"
	case FailOpen:
		return "fail open"
	case FailClosed:
		return "fail closed"
	case FailToStore:
		return "fail to fallback store"
	}
	return "unknown policy"
}

// Options configure a store. The zero value is usable.
type Options struct {
	// Prefix scopes the keys, as in ulule's stores: two stores with
	// different prefixes never share a counter. Defaults to ulule's
	// limiter.DefaultPrefix ("limiter").
	Prefix string
	// ReadableKeys stores "prefix@<period in µs>us:key" (the name
	// ratelimit.RateName(prefix, period), ':', the key) in the table
	// instead of a 16-byte digest of it, with keys of at most
	// ratelimit.MaxReadableKeyBytes. Defaults to false: keys are hashed, so
	// no e-mail or IP address is stored. The prefix must not contain ':'
	// then.
	ReadableKeys bool
	// OnFailure is the failure policy. Defaults to FailError.
	OnFailure FailurePolicy
	// Fallback is the store FailToStore asks. Required with FailToStore,
	// ignored otherwise.
	Fallback limiter.Store
	// Timeout bounds each call's time in the database, whatever the
	// caller's context; when it passes, the failure policy answers. It is
	// the store's ratelimit.DatabaseOptions.Timeout. Defaults to
	// ratelimit.DefaultTimeout (500ms), so that a stalled database never
	// stalls the application. Pair a short timeout with the server's
	// statement_timeout.
	Timeout time.Duration
	// Logger receives one warning each time the failure policy answers,
	// and what the store's ratelimit.Database logs (an outage and its end,
	// once each; SQL the server does not support, once per period).
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// Store is a limiter.Store whose counters are pgrl's fixed-window counters
// in PostgreSQL, kept through package ratelimit. It is safe for concurrent
// use.
type Store struct {
	db   DB
	opts Options
	// counter is the fixed-window limit every call goes through, at the
	// call's period (AtRate): Limit math.MaxInt64 and Penalty, so that it
	// counts every hit and never refuses one; the store applies ulule's
	// limit to the count it reports (contextOf).
	counter *ratelimit.Limiter
}

var _ limiter.Store = (*Store)(nil)

// NewStore returns a store on db with the default options: prefix
// "limiter", hashed keys, errors returned to the caller.
func NewStore(db DB) (limiter.Store, error) {
	return NewStoreWithOptions(db, Options{})
}

// NewStoreWithOptions returns a store on db with the given options. It
// does not touch the database.
func NewStoreWithOptions(db DB, opts Options) (*Store, error) {
	if db == nil || isNilPointer(db) {
		return nil, ErrNilDB
	}
	if opts.Prefix == "" {
		opts.Prefix = limiter.DefaultPrefix
	}
	if opts.ReadableKeys && strings.Contains(opts.Prefix, ":") {
		return nil, fmt.Errorf("%w: %q contains ':', which readable keys use as the separator; rename it or keep keys hashed", ErrInvalidPrefix, opts.Prefix)
	}
	switch opts.OnFailure {
	case FailError, FailOpen, FailClosed:
	case FailToStore:
		if opts.Fallback == nil {
			return nil, fmt.Errorf("%w: FailToStore needs Options.Fallback, such as memory.NewStore()", ErrInvalidPolicy)
		}
	default:
		return nil, fmt.Errorf("%w: %d; use FailError, FailOpen, FailClosed or FailToStore", ErrInvalidPolicy, opts.OnFailure)
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("%w: %v; use a positive timeout, or 0 for the default %v", ErrInvalidTimeout, opts.Timeout, ratelimit.DefaultTimeout)
	}
	if opts.Timeout == 0 {
		opts.Timeout = ratelimit.DefaultTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	limits, err := ratelimit.NewDatabase(db, ratelimit.DatabaseOptions{
		Timeout: opts.Timeout,
		// The partitioned layout works without partitions made ahead: a
		// check that finds none for its window creates it (the role must
		// then own pgrl's tables, as for any DDL).
		CreatePartitions: true,
		Logger:           opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("pgrl ulule store: %w", err)
	}
	counter, err := limits.Limiter(ratelimit.Config{
		Name:      opts.Prefix,
		Algorithm: ratelimit.FixedWindow,
		// Every hit counts and none is refused: ulule's limit comes with
		// each call and the store applies it to the count.
		Limit:   math.MaxInt64,
		Penalty: true,
		// Each call gives its own period (AtRate); this one is never used.
		Window: time.Minute,
		// Counters of the prefix at period p are stored under the name
		// ratelimit.RateName(prefix, p): periods never share a counter.
		KeyByWindow: true,
		KeyMode:     keyMode(opts.ReadableKeys),
		// The store's own policy (Options.OnFailure) answers outages, so
		// ratelimit returns them.
		OnFailure:     ratelimit.FailError,
		DenyCacheSize: -1, // nothing is ever denied
	})
	if errors.Is(err, ratelimit.ErrInvalidName) {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPrefix, err)
	}
	if err != nil {
		return nil, fmt.Errorf("pgrl ulule store: %w", err)
	}
	return &Store{db: db, opts: opts, counter: counter}, nil
}

func keyMode(readable bool) ratelimit.KeyMode {
	if readable {
		return ratelimit.ReadableKeys
	}
	return ratelimit.HashedKeys
}

func isNilPointer(db DB) bool {
	v := reflect.ValueOf(db)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// Get counts one hit for key and returns the key's state after it.
func (s *Store) Get(ctx context.Context, key string, rate limiter.Rate) (limiter.Context, error) {
	return s.Increment(ctx, key, 1, rate)
}

// Increment counts count hits for key and returns the key's state after
// them. Every hit counts, also past the limit, as in ulule's stores. A
// negative count takes hits back (Redis's INCRBY does the same); 0 counts
// nothing.
func (s *Store) Increment(ctx context.Context, key string, count int64, rate limiter.Rate) (limiter.Context, error) {
	at, err := atRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	var (
		used int64
		end  time.Time
	)
	switch {
	case count > 0:
		var d ratelimit.Decision
		d, err = s.counter.Allow(ctx, key, ratelimit.Cost(count), at)
		used, end = d.Used, d.ResetAt
	case count == 0:
		var d ratelimit.Decision
		d, err = s.counter.Peek(ctx, key, at)
		used, end = d.Used, d.ResetAt
	default:
		used, end, err = s.takeBack(ctx, key, count, rate, at)
	}
	if err != nil {
		return s.fail(ctx, "increment", err, rate, func(f limiter.Store) (limiter.Context, error) {
			return f.Increment(ctx, key, count, rate)
		})
	}
	return contextOf(rate, used, end), nil
}

// takeBack adds count (negative) hits to key's current window: the one
// statement the store sends itself (queries.go), on the row ratelimit
// counts in. When it fails, ratelimit reads the same counter to tell a
// setup error or an outage (typed as for any other call), and makes the
// window's partition in the partitioned layout, before the statement is
// sent once more.
func (s *Store) takeBack(ctx context.Context, key string, count int64, rate limiter.Rate, at ratelimit.Option) (int64, time.Time, error) {
	if s.opts.ReadableKeys && len(key) > ratelimit.MaxReadableKeyBytes {
		// ratelimit's own check of a readable key, as its calls make it.
		return 0, time.Time{}, fmt.Errorf("%w: %d bytes; readable keys hold at most %d bytes: shorten the key, or keep keys hashed",
			ErrKeyTooLong, len(key), ratelimit.MaxReadableKeyBytes)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	windowUs := rate.Period.Microseconds()
	k := ratelimit.StoredKey(keyMode(s.opts.ReadableKeys), ratelimit.RateName(s.opts.Prefix, rate.Period), key)
	used, end, err := takeBack(ctx, s.db, k, count, windowUs)
	if err == nil || ctx.Err() != nil {
		return used, end, err
	}
	if _, perr := s.counter.Peek(ctx, key, at); perr != nil {
		return 0, time.Time{}, perr
	}
	lim, lerr := s.counter.WithRate(counterRate(rate))
	if lerr != nil {
		return 0, time.Time{}, lerr
	}
	if perr := ratelimit.EnsurePartitions(ctx, s.db, lim); perr != nil {
		return 0, time.Time{}, perr
	}
	used, end, err = takeBack(ctx, s.db, k, count, windowUs)
	var pgErr *pgconn.PgError
	if err != nil && errors.As(err, &pgErr) {
		// PostgreSQL answered, and refused this statement only.
		return 0, time.Time{}, fmt.Errorf("%w: adding %d to the count of %q: %w", ErrInvalidCount, count, key, err)
	}
	return used, end, err
}

// Peek returns the key's state without counting.
func (s *Store) Peek(ctx context.Context, key string, rate limiter.Rate) (limiter.Context, error) {
	at, err := atRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	d, err := s.counter.Peek(ctx, key, at)
	if err != nil {
		return s.fail(ctx, "peek", err, rate, func(f limiter.Store) (limiter.Context, error) {
			return f.Peek(ctx, key, rate)
		})
	}
	return contextOf(rate, d.Used, d.ResetAt), nil
}

// Reset forgets every count of key at this rate's period and returns the
// key's state: nothing counted, Reset at the end of the current window. A
// database error is always returned, whatever the failure policy: a reset
// cannot be pretended. With FailToStore the fallback store is reset too.
func (s *Store) Reset(ctx context.Context, key string, rate limiter.Rate) (limiter.Context, error) {
	at, err := atRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	if s.opts.OnFailure == FailToStore {
		if _, err := s.opts.Fallback.Reset(ctx, key, rate); err != nil {
			return limiter.Context{}, err
		}
	}
	// One Timeout for both statements.
	call, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	if err := s.counter.Reset(call, key, at); err != nil {
		return limiter.Context{}, wrap(ctx, err)
	}
	// A second statement learns the current window's end on the database's
	// clock. It reports nothing counted even if another caller has counted
	// a hit in between: this answer is the reset's.
	d, err := s.counter.Peek(call, key, at)
	if err != nil {
		return limiter.Context{}, wrap(ctx, err)
	}
	return contextOf(rate, 0, d.ResetAt), nil
}

// contextOf turns a window's count and end into ulule's answer with ulule's
// own arithmetic: Reached when the count is over the limit, Remaining the
// limit less the count (never negative), Reset the window's end in Unix
// seconds.
func contextOf(rate limiter.Rate, count int64, end time.Time) limiter.Context {
	return common.GetContextFromState(time.Time{}, rate, end, count)
}

// atRate validates the rate's period and returns the option that counts
// at it. ulule's rates come with each call, so each call checks its own.
func atRate(rate limiter.Rate) (ratelimit.Option, error) {
	p := rate.Period
	if p < ratelimit.MinWindow || p > ratelimit.MaxWindow {
		return ratelimit.Option{}, fmt.Errorf("%w: period %v; use a period between %v and %v, such as time.Minute", ErrInvalidRate, p, ratelimit.MinWindow, ratelimit.MaxWindow)
	}
	if p%time.Microsecond != 0 {
		return ratelimit.Option{}, fmt.Errorf("%w: period %v; use a whole number of microseconds", ErrInvalidRate, p)
	}
	return ratelimit.AtRate(counterRate(rate)), nil
}

// counterRate is the ratelimit rate the store counts ulule's rate at: its
// period, and no limit of its own (see Store.counter). One rate per
// period, whatever ulule's limit: limits of one period share a counter, as
// in ulule's stores.
func counterRate(rate limiter.Rate) ratelimit.Rate {
	return ratelimit.Rate{Limit: math.MaxInt64, Window: rate.Period}
}

// wrap names the store in err and keeps the caller's own context's end in
// the chain.
func wrap(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return fmt.Errorf("pgrl ulule store: %w: %w", cerr, err)
	}
	return fmt.Errorf("pgrl ulule store: %w", err)
}

// fail answers a call the database could not: errors the caller or the
// setup caused are returned; an outage goes to the failure policy.
func (s *Store) fail(ctx context.Context, op string, cause error, rate limiter.Rate, fallback func(limiter.Store) (limiter.Context, error)) (limiter.Context, error) {
	err := wrap(ctx, cause)
	if ctx.Err() != nil || isSetupError(err) || s.opts.OnFailure == FailError {
		return limiter.Context{}, err
	}
	s.opts.Logger.Warn("pgrl ulule store: database unavailable; the failure policy answers",
		"op", op, "policy", s.opts.OnFailure.String(), "error", cause)
	switch s.opts.OnFailure {
	case FailOpen:
		return common.GetContextFromState(time.Time{}, rate, time.Now().Add(rate.Period), 0), nil
	case FailClosed:
		return common.GetContextFromState(time.Time{}, rate, time.Now().Add(rate.Period), rate.Limit+1), nil
	default: // FailToStore
		return fallback(s.opts.Fallback)
	}
}

// isSetupError reports errors that a failure policy must not hide: they
// come from the input or the setup, not from a passing outage
// (ratelimit.IsConfigError: a missing migration, grant or partition, a
// read-only database, SQL the server does not support, input PostgreSQL
// refused, a readable key too long).
func isSetupError(err error) bool {
	return ratelimit.IsConfigError(err) || errors.Is(err, ErrInvalidCount)
}
