package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
)

// Errors returned for bad configuration or bad calls. Test with errors.Is;
// the returned error's text adds the offending value and the fix.
var (
	// ErrNilDB: NewDatabase, EnsurePartitions or a …Tx method was given no
	// database (or no transaction).
	ErrNilDB = errors.New("ratelimit: nil database; pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
	// ErrNilLimiter: a Check of AllowAll has no Limiter.
	ErrNilLimiter = errors.New("ratelimit: check without a limiter; set Check.Limiter")
	// ErrInvalidName: the limiter has no name, or (with readable keys) a
	// name containing ':' or longer than MaxReadableNameBytes.
	ErrInvalidName = errors.New("ratelimit: invalid limiter name")
	// ErrInvalidAlgorithm: the algorithm is not one of the three.
	ErrInvalidAlgorithm = errors.New("ratelimit: invalid algorithm")
	// ErrInvalidLimit: the limit (or FallbackLimit) is zero or negative, or
	// too small to spread over Spread rows.
	ErrInvalidLimit = errors.New("ratelimit: invalid limit")
	// ErrInvalidWindow: the window is zero, negative, shorter than a
	// millisecond, or longer than a year.
	ErrInvalidWindow = errors.New("ratelimit: invalid window")
	// ErrInvalidBurst: the token bucket's burst is negative, above
	// MaxTokens, or so large against Limit that an empty bucket would take
	// more than 1,000 years to refill.
	ErrInvalidBurst = errors.New("ratelimit: invalid burst")
	// ErrInvalidPolicy: OnFailure is not one of the policies.
	ErrInvalidPolicy = errors.New("ratelimit: invalid failure policy")
	// ErrInvalidTimeout: a negative Timeout or BreakerCooldown.
	ErrInvalidTimeout = errors.New("ratelimit: invalid timeout")
	// ErrInvalidOption: a negative count among the tuning options
	// (BreakerThreshold, MaxBatch, MaxInFlight, Spread).
	ErrInvalidOption = errors.New("ratelimit: invalid option")
	// ErrInvalidMultiMode: AllowAll was given a MultiMode that is neither
	// AllOrNothing nor ConsumeAll.
	ErrInvalidMultiMode = errors.New("ratelimit: invalid multi-limit mode")
	// ErrInvalidCost: a check asked for zero or fewer units.
	ErrInvalidCost = errors.New("ratelimit: invalid cost")
	// ErrCostExceedsLimit: a check asked for more units than the limit can
	// ever admit at once, so it could never succeed.
	ErrCostExceedsLimit = errors.New("ratelimit: cost exceeds limit")
	// ErrNotMigrated: pgrl's tables are missing from the database (or from
	// the connection's search_path). It is the same value as
	// migration.ErrNotMigrated and cleanup.ErrNotMigrated, so errors.Is
	// matches any of them.
	ErrNotMigrated = notmigrated.Err
	// ErrReadOnly: the database refuses the check's write. Either it is a
	// read-only standby, where counters can be neither written nor read
	// (UNLOGGED tables live on the primary only), or the session is
	// read-only (default_transaction_read_only on for the role, the
	// database or the connection). The error's text says which it found.
	ErrReadOnly = errors.New("ratelimit: the database refuses writes")
	// ErrEmptyMulti: a multi-limit decision was given no checks.
	ErrEmptyMulti = errors.New("ratelimit: no checks to decide; pass at least one")
	// ErrDuplicateCheck: one multi-limit decision names the same limiter and
	// key twice.
	ErrDuplicateCheck = errors.New("ratelimit: the same limiter and key appear twice in one decision")
	// ErrMixedDatabases: a multi-limit decision mixes limiters on different
	// databases, which one round trip cannot reach.
	ErrMixedDatabases = errors.New("ratelimit: the limiters of one decision must share a database")
	// ErrKeyTooLong: with ReadableKeys, a key longer than
	// MaxReadableKeyBytes, which PostgreSQL could not index. Hashed keys
	// have no limit.
	ErrKeyTooLong = errors.New("ratelimit: key too long for readable keys")
	// ErrInvalidInput: PostgreSQL refused a check because of its input (a
	// data exception, a program limit or a constraint: SQLSTATE classes 22,
	// 54 and 23), such as a pinned clock outside PostgreSQL's timestamp
	// range. The failure policy, the breaker and the memory fallback never
	// answer it: they are for outages, and one bad request must not move a
	// limiter's other keys off PostgreSQL. The *pgconn.PgError is wrapped.
	ErrInvalidInput = errors.New("ratelimit: PostgreSQL refused the check's input")
	// ErrUnsupported: the check's SQL does not fit this server. PostgreSQL
	// (or an extension such as Citus) refused the statement itself with an
	// error of SQLSTATE class 0A (feature not supported) or 42 (syntax error
	// or access rule violation: an ambiguous operator or function, an
	// undefined function or operator, a datatype mismatch, a wrong object
	// type), as when the schema was migrated by another version of pgrl or
	// the server is not a supported PostgreSQL. Run `rl-migrate up` with
	// this version of pgrl, check that the server is PostgreSQL 13 to 18,
	// and on Citus see docs/SCALING.md. It is a setup error, like
	// ErrNotMigrated: returned to the caller, logged once per limiter at
	// error level, never answered by the failure policy or the memory tier
	// and never counted by the breaker, since every check would fail alike.
	// (42501 is ErrPermission; a missing table, schema or pgrl_ function is
	// ErrNotMigrated; a standby's refusal is ErrReadOnly.) The
	// *pgconn.PgError is wrapped.
	ErrUnsupported = errors.New("ratelimit: the check's SQL does not fit this server")
	// ErrPermission: the database user lacks a privilege on pgrl's schema,
	// tables or functions (SQLSTATE 42501, or a schema without USAGE, which
	// makes its tables look missing). The message names the role and the
	// grants it lacks. It is the same value as policy.ErrPermission,
	// cleanup.ErrPermission and migration.ErrPermission, so errors.Is
	// matches any of them; the *pgconn.PgError, when there is one, is
	// wrapped.
	ErrPermission = pgerr.ErrPermission
	// ErrNoPartition: in the partitioned layout, no partition of
	// pgrl_fixed_window holds the end of this check's window, and the
	// limiter does not create partitions itself (DatabaseOptions.CreatePartitions).
	// It is a setup error, like ErrNotMigrated: returned to the caller,
	// never answered by the failure policy or counted by the breaker.
	ErrNoPartition = errors.New("ratelimit: no partition of pgrl_fixed_window holds this window's end; " +
		"run `rl-cleanup --partitions` with a --horizon longer than your longest fixed window (from cron), " +
		"call ratelimit.EnsurePartitions at start-up as the owner of pgrl's tables, " +
		"or set DatabaseOptions.CreatePartitions")
	// ErrPartitionMissing: in the partitioned layout, a check inside the
	// caller's transaction found no partition for its window. The limiter
	// has created it; retry the transaction.
	ErrPartitionMissing = errors.New("ratelimit: partition for this window was missing and has now been created; retry the transaction")
	// ErrPolicyChanged: a limiter whose figures are read from a stored
	// policy (Config.Policy) found the policy no longer matching it: the
	// policy was deleted, or its algorithm or key mode changed, or (for the
	// window algorithms) the window that applies to the key did. Nothing was
	// counted. Build the limiter again from the policy as it is now;
	// package policy's Limiter does this itself and checks again.
	ErrPolicyChanged = errors.New("ratelimit: the stored policy no longer matches the limiter; nothing was counted")
)

// configErrors are the errors IsConfigError reports.
var configErrors = []error{
	// The setup of the database.
	ErrNotMigrated, ErrReadOnly, ErrNoPartition, ErrPermission, ErrUnsupported, ErrPolicyChanged,
	// The request, refused by PostgreSQL or before it is sent.
	ErrInvalidInput, ErrKeyTooLong, ErrInvalidCost, ErrCostExceedsLimit,
	ErrNilDB, ErrNilLimiter, ErrEmptyMulti, ErrDuplicateCheck, ErrMixedDatabases, ErrInvalidMultiMode,
	// The limiter's configuration, refused by Database.Limiter.
	ErrInvalidName, ErrInvalidAlgorithm, ErrInvalidLimit, ErrInvalidWindow, ErrInvalidBurst,
	ErrInvalidPolicy, ErrInvalidTimeout, ErrInvalidOption,
}

// IsConfigError reports whether err is the caller's to fix: the setup of
// the database (ErrNotMigrated, ErrReadOnly, ErrNoPartition, ErrPermission,
// ErrUnsupported, ErrPolicyChanged), the request (ErrInvalidInput,
// ErrKeyTooLong, ErrInvalidCost, ...) or the limiter's configuration
// (ErrInvalidLimit, ...) is wrong. Retrying the same call fails the same way
// until that is fixed; the failure policy, the breaker and the memory tier
// never answer such an error, so a check returns it whatever OnFailure says.
//
// It is false for nil, for an outage (a check returns it only under
// FailError, and then a retry may succeed), for ErrPartitionMissing (retry
// the transaction) and for the caller's own context ending.
func IsConfigError(err error) bool {
	return err != nil && slices.ContainsFunc(configErrors, func(target error) bool { return errors.Is(err, target) })
}

func invalid(base error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", base, fmt.Sprintf(format, args...))
}

// mapErr turns the database errors a user can cause into typed errors that
// name the fix, by pgerr's classification, which every pgrl package
// shares. The *pgconn.PgError stays in the chain for errors.As, the typed
// error for errors.Is. An error already mapped is returned as is.
func mapErr(err error) error {
	if err == nil || IsConfigError(err) || errors.Is(err, ErrPartitionMissing) {
		return err
	}
	kind, pgErr := pgerr.Classify(err)
	switch kind {
	case pgerr.NoPartition:
		return fmt.Errorf("%w: %w", ErrNoPartition, pgErr)
	case pgerr.Undefined:
		return fmt.Errorf("%w: %w", ErrNotMigrated, pgErr)
	case pgerr.ReadOnly:
		return fmt.Errorf("%w: %w", ErrReadOnly, pgErr)
	case pgerr.Permission:
		return fmt.Errorf("ratelimit: %w", pgerr.Denied(pgErr, missingGrant(nil)))
	case pgerr.Input:
		return fmt.Errorf("%w (a bad request, not an outage: no failure policy answers it): %w", ErrInvalidInput, pgErr)
	case pgerr.Unsupported:
		if pgErr.Severity == "FATAL" {
			// Refused while connecting: a setting the connection string
			// passes (options=-c name=value, a runtime parameter) is wrong.
			return fmt.Errorf("%w (a setup error, not an outage: the server refused the connection's settings; fix the "+
				"connection string's options or runtime parameters): %w", ErrUnsupported, pgErr)
		}
		return fmt.Errorf("%w (a setup error, not an outage: no failure policy answers it; run `rl-migrate up` with this "+
			"version of pgrl, use PostgreSQL 13 to 18, and on Citus see docs/SCALING.md): %w", ErrUnsupported, pgErr)
	}
	return fmt.Errorf("ratelimit: %w", err)
}

// missingGrant is what a check of l needs on pgrl's tables: all the
// counter tables when l is nil.
func missingGrant(l *Limiter) pgerr.Need {
	tables := []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"}
	if l != nil {
		tables = []string{l.alg.table()}
	}
	return pgerr.Need{Tables: tables, Privileges: []string{"SELECT", "INSERT", "UPDATE", "DELETE"}}
}

// explain is mapErr, and asks the limiter's database (one more query, only
// on these error paths) which grant is missing: a schema without USAGE
// hides pgrl's tables, so a missing table may be a missing grant, and a
// 42501 names an object, not the grant. Truly missing tables are reported
// with where the connection looked.
func (l *Limiter) explain(ctx context.Context, err error) error {
	err = mapErr(err)
	if errors.Is(err, ErrUnsupported) {
		l.logUnsupported(err)
		return err
	}
	if errors.Is(err, ErrReadOnly) {
		return l.explainReadOnly(ctx, err)
	}
	if !errors.Is(err, ErrNotMigrated) && !errors.Is(err, ErrPermission) {
		return err
	}
	kind, pgErr := pgerr.Classify(err)
	if kind != pgerr.Undefined && kind != pgerr.Permission {
		return err // explained already
	}
	ctx, cancel := context.WithTimeout(ctx, l.st.opts.Timeout)
	defer cancel()
	if pe := pgerr.Diagnose(ctx, l.st.db, missingGrant(l), pgErr); pe != nil {
		return fmt.Errorf("ratelimit: %w", pe)
	}
	if kind == pgerr.Permission {
		return err
	}
	// The tables are missing. Say where the connection looked, when it
	// can tell.
	var where *notmigrated.Error
	if errors.As(notmigrated.At(ctx, l.st.db), &where) {
		return fmt.Errorf("ratelimit: %w: %w", where, pgErr)
	}
	return err
}

// logUnsupported logs err, an ErrUnsupported, at error level the first time
// the limiter meets one: every check fails alike until the schema or the
// server is fixed, and the caller gets each error.
func (l *Limiter) logUnsupported(err error) {
	if l.unsupportedLogged.CompareAndSwap(false, true) {
		l.st.opts.Logger.Error("pgrl: the check's SQL does not fit this server; checks fail with ErrUnsupported, "+
			"and no failure policy answers them, until it does (logged once per limiter)",
			"limiter", l.cfg.Name, "error", err.Error())
	}
}

// explainReadOnly says why the database refused a write: a standby, or a
// read-only session on a primary.
func (l *Limiter) explainReadOnly(ctx context.Context, err error) error {
	ctx, cancel := context.WithTimeout(ctx, l.st.opts.Timeout)
	defer cancel()
	var standby bool
	if qerr := l.st.db.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&standby); qerr != nil {
		return fmt.Errorf("%w: it is a read-only standby (point the limiter at the primary), or the session is read-only (set default_transaction_read_only to off for the limiter's role or connections): %w", ErrReadOnly, unwrapMapped(err))
	}
	if standby {
		return fmt.Errorf("%w: it is a read-only standby; point the limiter at the primary: %w", ErrReadOnly, unwrapMapped(err))
	}
	return fmt.Errorf("%w: the session is read-only on a primary (default_transaction_read_only is on for the limiter's role, database or connection); turn it off for the limiter's connections, e.g. ALTER ROLE <role> SET default_transaction_read_only = off, or RuntimeParams in the pool's config: %w", ErrReadOnly, unwrapMapped(err))
}

// unwrapMapped returns the *pgconn.PgError inside an error mapErr made, or
// the error itself.
func unwrapMapped(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr
	}
	return err
}
