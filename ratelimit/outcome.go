package ratelimit

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// Outcome says what a check that returned an error did to its counters:
// whether the units it asked for were spent although the caller got no
// decision. Every error a check returns (Allow with any options,
// AllowAll, the …Tx variants, checks of a stored policy, coalesced or
// not) carries one;
// OutcomeOf reads it, and errors.Is matches ErrNotConsumed, ErrConsumed and
// ErrOutcomeUnknown. Each is the strongest claim that is certainly true:
// a check is never reported as not consumed when it may have been, nor as
// consumed when it may not have been. docs/CERTAINTY.md has the table of
// failures and their outcomes.
type Outcome uint8

const (
	// OutcomeUnknown: the statement reached PostgreSQL (or may have) and
	// its answer was lost: it may have committed or not. A client-side
	// deadline while the statement ran, a connection cut after sending and
	// a server that went away are all unknown. Setting statement_timeout
	// below DatabaseOptions.Timeout (StatementTimeoutParam) turns the most
	// common of them, a check waiting on a locked row, into a server-side
	// error, which is OutcomeNotConsumed.
	OutcomeUnknown Outcome = iota
	// OutcomeNotConsumed: nothing was counted. Nothing reached PostgreSQL
	// (the check was refused before sending, the caller's context ended
	// while it waited for a connection or for a coalesced batch, the
	// connection could not be made), or PostgreSQL rolled the statement
	// back (an error of the statement itself, statement_timeout,
	// lock_timeout, the connection ended before the statement finished),
	// or the check ran in a transaction that failed with it (the …Tx
	// variants: a failed statement aborts the caller's transaction).
	OutcomeNotConsumed
	// OutcomeConsumed: the statement committed and its units were
	// counted, but the decision did not reach the caller.
	OutcomeConsumed
)

// String returns "unknown", "not consumed" or "consumed".
func (o Outcome) String() string {
	switch o {
	case OutcomeNotConsumed:
		return "not consumed"
	case OutcomeConsumed:
		return "consumed"
	default:
		return "unknown"
	}
}

var (
	// ErrNotConsumed matches (errors.Is) every check error whose Outcome
	// is OutcomeNotConsumed: retrying cannot count the check twice.
	ErrNotConsumed = errors.New("ratelimit: the check counted nothing")
	// ErrConsumed matches every check error whose Outcome is
	// OutcomeConsumed: the units were counted, the decision was lost.
	ErrConsumed = errors.New("ratelimit: the check was counted, its decision lost")
	// ErrOutcomeUnknown matches every check error whose Outcome is
	// OutcomeUnknown: the check may or may not have been counted.
	ErrOutcomeUnknown = errors.New("ratelimit: the check may or may not have been counted")
)

// OutcomeOf returns the outcome that err, returned by a check, carries.
// Test err against nil first: a nil error means the check was decided, and
// its Decision says what it counted (OutcomeOf(nil) is OutcomeUnknown, as
// for any error that carries no outcome, one not returned by a check).
func OutcomeOf(err error) Outcome {
	var oe *outcomeError
	if errors.As(err, &oe) {
		return oe.outcome
	}
	return OutcomeUnknown
}

// outcomeError is an error of a check with its outcome.
type outcomeError struct {
	err     error
	outcome Outcome
}

func (e *outcomeError) Error() string { return e.err.Error() }
func (e *outcomeError) Unwrap() error { return e.err }

// Is matches the sentinel of e's outcome.
func (e *outcomeError) Is(target error) bool {
	switch target {
	case ErrNotConsumed:
		return e.outcome == OutcomeNotConsumed
	case ErrConsumed:
		return e.outcome == OutcomeConsumed
	case ErrOutcomeUnknown:
		return e.outcome == OutcomeUnknown
	}
	return false
}

// WithOutcome returns err carrying outcome o, or nil for nil; an error that
// carries an outcome already keeps it. For a Checker of your own that wraps
// pgrl's: an error it raises before checking is WithOutcome(err,
// OutcomeNotConsumed), so that its callers can rely on OutcomeOf.
func WithOutcome(err error, o Outcome) error {
	if err == nil {
		return nil
	}
	var oe *outcomeError
	if errors.As(err, &oe) {
		return err
	}
	return &outcomeError{err: err, outcome: o}
}

// carryOutcome returns replacement (the error a check reports instead of
// err, such as its context's) carrying err's outcome, classified as
// statementOutcome does when err carries none.
func carryOutcome(err, replacement error, inTx bool) error {
	return WithOutcome(replacement, statementOutcome(err, inTx))
}

// sendMark is what the code that sent a statement knows of an error that
// ended it, marked on the error (markedError) for statementOutcome.
type sendMark uint8

const (
	// unsent: the error ended the check before its statement was handed to
	// the driver: waiting for a connection or for a coalesced batch.
	unsent sendMark = iota + 1
	// uncommitted: the error ended a transaction of pgrl's own (a decision
	// over several algorithms) before its COMMIT was sent: the server rolls
	// it back whatever happened to the connection.
	uncommitted
	// beforeRow: the error ended a statement before the server had sent any
	// of its result rows, seen by a DB that watches for them (the share of
	// a pool, poolshare.go). Every statement that counts returns a row per
	// check it counts, and PostgreSQL sends a statement's rows before it
	// commits its transaction, and any error it reports after them: an
	// error the server ends the connection with (FATAL) before the first
	// row means the transaction did not commit, or committed nothing.
	beforeRow
)

// markedError is an error with what its sender knows of it.
type markedError struct {
	err  error
	mark sendMark
}

func (e *markedError) Error() string { return e.err.Error() }
func (e *markedError) Unwrap() error { return e.err }

// mark marks err (not nil) with m.
func mark(err error, m sendMark) error { return &markedError{err: err, mark: m} }

// marked reports whether any error in err's chain is marked m.
func marked(err error, m sendMark) bool {
	for err != nil {
		var me *markedError
		if !errors.As(err, &me) {
			return false
		}
		if me.mark == m {
			return true
		}
		err = me.err
	}
	return false
}

// statementOutcome classifies err, which ended a check's statement (inTx:
// in the caller's transaction), by what is certain:
//   - an outcome already attached is kept;
//   - in the caller's transaction nothing can commit after an error: the
//     statement aborts the transaction, or the connection is gone and the
//     server rolls it back;
//   - nothing sent (marked unsent, or pgconn.SafeToRetry), or a
//     transaction of pgrl's own that failed before its COMMIT: not
//     consumed;
//   - an error reported by the server at ERROR severity rolls back the
//     statement's transaction (autocommit: the statement is its
//     transaction), whenever it came: not consumed;
//   - the connection ended by the server (FATAL, PANIC) before any result
//     row arrived (marked beforeRow): the statement's transaction had not
//     committed anything: not consumed. After a row, or where no one
//     watched for rows, it may have: unknown;
//   - anything else after sending (a client-side deadline, a connection
//     cut, a server that went away): unknown.
func statementOutcome(err error, inTx bool) Outcome {
	var oe *outcomeError
	if errors.As(err, &oe) {
		return oe.outcome
	}
	if inTx || errors.Is(err, ErrPolicyChanged) {
		return OutcomeNotConsumed
	}
	if marked(err, unsent) || marked(err, uncommitted) || pgconn.SafeToRetry(err) {
		return OutcomeNotConsumed
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return OutcomeUnknown
	}
	if !connectionEnded(pgErr) {
		return OutcomeNotConsumed // ERROR: the statement's transaction rolled back
	}
	if marked(err, beforeRow) {
		return OutcomeNotConsumed
	}
	return OutcomeUnknown
}

// connectionEnded reports an error the server ended the connection with
// (FATAL or PANIC severity).
func connectionEnded(pgErr *pgconn.PgError) bool {
	severity := pgErr.SeverityUnlocalized
	if severity == "" {
		severity = pgErr.Severity
	}
	return severity == "FATAL" || severity == "PANIC"
}
