package ulule

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/ulule/limiter/v3"
	"github.com/ulule/limiter/v3/drivers/store/common"

	"github.com/pgrl/pgrl/internal/pgerr"
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
	// ErrInvalidPrefix: with ReadableKeys, the prefix contains ':'.
	ErrInvalidPrefix = errors.New("pgrl ulule store: invalid prefix")
	// ErrInvalidPolicy: OnFailure is not one of the policies, or
	// FailToStore has no Fallback.
	ErrInvalidPolicy = errors.New("pgrl ulule store: invalid failure policy")
	// ErrInvalidTimeout: a negative Timeout.
	ErrInvalidTimeout = errors.New("pgrl ulule store: invalid timeout")
	// ErrInvalidRate: the rate's period is not one pgrl can count in.
	ErrInvalidRate = errors.New("pgrl ulule store: invalid rate")
	// ErrInvalidCount: an increment the database refused as data out of
	// range (a window's count would leave the bigint range).
	ErrInvalidCount = errors.New("pgrl ulule store: invalid count")
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
// passed). It never applies to bad input, to a missing migration, to a
// missing grant, to a read-only standby, to SQL the server does not
// support (ErrUnsupported), or to a call whose own context ended: those
// errors are always returned.
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
	// ReadableKeys stores "prefix:period_us:key" in the table instead of a
	// 16-byte digest of it. Defaults to false: keys are hashed, so no
	// e-mail or IP address is stored. The prefix must not contain ':' then.
	ReadableKeys bool
	// OnFailure is the failure policy. Defaults to FailError.
	OnFailure FailurePolicy
	// Fallback is the store FailToStore asks. Required with FailToStore,
	// ignored otherwise.
	Fallback limiter.Store
	// Timeout bounds each call's time in the database, whatever the
	// caller's context; when it passes, the failure policy answers.
	// Defaults to ratelimit.DefaultTimeout (500ms), so that a stalled
	// database never stalls the application. Pair a short timeout with the
	// server's statement_timeout.
	Timeout time.Duration
	// Logger receives one warning each time the failure policy answers.
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// Store is a limiter.Store whose counters are pgrl's fixed-window counters
// in PostgreSQL. It is safe for concurrent use.
type Store struct {
	db   DB
	opts Options
	// unsupportedLogged: an ErrUnsupported was logged (fail).
	unsupportedLogged atomic.Bool
}

var _ limiter.Store = (*Store)(nil)

// NewStore returns a store on db with the default options: prefix
// "limiter", hashed keys, errors returned to the caller.
func NewStore(db DB) (limiter.Store, error) {
	return NewStoreWithOptions(db, Options{})
}

// NewStoreWithOptions returns a store on db with the given options.
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
	return &Store{db: db, opts: opts}, nil
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
// negative count takes hits back (Redis's INCRBY does the same).
func (s *Store) Increment(ctx context.Context, key string, count int64, rate limiter.Rate) (limiter.Context, error) {
	windowUs, err := checkRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	call, cancel := s.callContext(ctx)
	defer cancel()
	w, err := incrementWindow(call, s.db, s.storedKey(key, windowUs), count, windowUs)
	if err != nil {
		return s.fail(ctx, "increment", err, rate, func(f limiter.Store) (limiter.Context, error) {
			return f.Increment(ctx, key, count, rate)
		})
	}
	return contextOf(rate, w), nil
}

// Peek returns the key's state without counting.
func (s *Store) Peek(ctx context.Context, key string, rate limiter.Rate) (limiter.Context, error) {
	windowUs, err := checkRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	call, cancel := s.callContext(ctx)
	defer cancel()
	w, err := peekWindow(call, s.db, s.storedKey(key, windowUs), windowUs)
	if err != nil {
		return s.fail(ctx, "peek", err, rate, func(f limiter.Store) (limiter.Context, error) {
			return f.Peek(ctx, key, rate)
		})
	}
	return contextOf(rate, w), nil
}

// Reset forgets every count of key at this rate's period and returns the
// key's state: nothing counted, Reset at the end of the current window. A
// database error is always returned, whatever the failure policy: a reset
// cannot be pretended. With FailToStore the fallback store is reset too.
func (s *Store) Reset(ctx context.Context, key string, rate limiter.Rate) (limiter.Context, error) {
	windowUs, err := checkRate(rate)
	if err != nil {
		return limiter.Context{}, err
	}
	if s.opts.OnFailure == FailToStore {
		if _, err := s.opts.Fallback.Reset(ctx, key, rate); err != nil {
			return limiter.Context{}, err
		}
	}
	call, cancel := s.callContext(ctx)
	defer cancel()
	k := s.storedKey(key, windowUs)
	if err := resetKey(call, s.db, k); err != nil {
		return limiter.Context{}, s.explain(ctx, mapErr(err))
	}
	// A second statement learns the current window's end on the database's
	// clock. It reports nothing counted even if another caller has counted
	// a hit in between: this answer is the reset's.
	w, err := peekWindow(call, s.db, k, windowUs)
	if err != nil {
		return limiter.Context{}, s.explain(ctx, mapErr(err))
	}
	w.count = 0
	return contextOf(rate, w), nil
}

// contextOf turns a window into ulule's answer with ulule's own arithmetic:
// Reached when the count is over the limit, Remaining the limit less the
// count (never negative), Reset the window's end in Unix seconds.
func contextOf(rate limiter.Rate, w window) limiter.Context {
	return common.GetContextFromState(time.Time{}, rate, w.expiresAt, w.count)
}

// checkRate validates the rate's period and returns it in microseconds.
// ulule's rates come with each call, so each call checks its own.
func checkRate(rate limiter.Rate) (int64, error) {
	p := rate.Period
	if p < ratelimit.MinWindow || p > ratelimit.MaxWindow {
		return 0, fmt.Errorf("%w: period %v; use a period between %v and %v, such as time.Minute", ErrInvalidRate, p, ratelimit.MinWindow, ratelimit.MaxWindow)
	}
	if p%time.Microsecond != 0 {
		return 0, fmt.Errorf("%w: period %v; use a whole number of microseconds", ErrInvalidRate, p)
	}
	return p.Microseconds(), nil
}

// storedKey is the key column's value: pgrl's digest (or readable form) of
// the key under the name "prefix:period_us". The period is part of the
// name because pgrl aligns windows on multiples of the period, so counters
// of different periods must not meet; limits of one period share a counter,
// as in ulule's stores.
func (s *Store) storedKey(key string, windowUs int64) []byte {
	mode := ratelimit.HashedKeys
	if s.opts.ReadableKeys {
		mode = ratelimit.ReadableKeys
	}
	return ratelimit.StoredKey(mode, s.opts.Prefix+":"+strconv.FormatInt(windowUs, 10), key)
}

func (s *Store) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.opts.Timeout)
}

// fail answers a call the database could not: errors the caller or the
// setup caused are returned; an outage goes to the failure policy.
func (s *Store) fail(ctx context.Context, op string, cause error, rate limiter.Rate, fallback func(limiter.Store) (limiter.Context, error)) (limiter.Context, error) {
	err := mapErr(cause)
	if errors.Is(err, ErrUnsupported) && s.unsupportedLogged.CompareAndSwap(false, true) {
		s.opts.Logger.Error("pgrl ulule store: the store's SQL does not fit this server; calls fail with ErrUnsupported, "+
			"and no failure policy answers them, until it does (logged once per store)", "op", op, "error", err.Error())
	}
	if ctx.Err() != nil || isSetupError(err) || s.opts.OnFailure == FailError {
		return limiter.Context{}, s.explain(ctx, err)
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
// come from the input or the setup, not from a passing outage.
func isSetupError(err error) bool {
	return errors.Is(err, ErrNotMigrated) || errors.Is(err, ErrReadOnly) || errors.Is(err, ErrInvalidCount) ||
		errors.Is(err, ErrPermission) || errors.Is(err, ErrUnsupported)
}

// storeNeed is what the store needs on pgrl's tables.
var storeNeed = pgerr.Need{Tables: []string{"pgrl_fixed_window"}, Privileges: []string{"SELECT", "INSERT", "UPDATE", "DELETE"}}

// explain asks the database (one more query, on these error paths only)
// which grant is missing when err is a missing table or a permission
// error: a schema without USAGE hides pgrl_fixed_window, which then looks
// missing.
func (s *Store) explain(ctx context.Context, err error) error {
	if !errors.Is(err, ErrNotMigrated) && !errors.Is(err, ErrPermission) {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.Timeout)
	defer cancel()
	if pe := pgerr.Diagnose(ctx, s.db, storeNeed, err); pe != nil {
		return fmt.Errorf("pgrl ulule store: %w", pe)
	}
	return err
}

// mapErr turns the database errors a user can cause into typed errors that
// name the fix, keeping the original for errors.As.
func mapErr(err error) error {
	kind, pgErr := pgerr.Classify(err)
	switch {
	case kind == pgerr.Undefined:
		return fmt.Errorf("%w: %w", ErrNotMigrated, pgErr)
	case kind == pgerr.ReadOnly:
		return fmt.Errorf("%w: %w", ErrReadOnly, pgErr)
	case kind == pgerr.Permission:
		return fmt.Errorf("pgrl ulule store: %w", pgerr.Denied(pgErr, storeNeed))
	case kind == pgerr.Input && !pgerr.IsConstraintViolation(pgErr):
		return fmt.Errorf("%w: %w; keep each key's count within ±9.2e18 per window", ErrInvalidCount, err)
	case kind == pgerr.Unsupported:
		return fmt.Errorf("%w (a setup error, not an outage: no failure policy answers it; run `rl-migrate up` with this version of pgrl): %w",
			ErrUnsupported, pgErr)
	}
	return fmt.Errorf("pgrl ulule store: %w", err)
}
