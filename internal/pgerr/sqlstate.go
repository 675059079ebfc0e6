package pgerr

import (
	"errors"
	"slices"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// This file is the one place where pgrl reads a SQLSTATE: Classify for the
// kinds every package maps to its typed errors, and the predicates below for
// the few codes one operation handles on its own. Codes are named with
// pgerrcode; other packages call these and compare no codes themselves.

// Kind is what a database error means to pgrl.
type Kind int

// The kinds of Classify.
const (
	// Other: none of the kinds below, such as an outage or a timeout.
	Other Kind = iota
	// Undefined: a table, schema or pgrl_ function is not found (42P01,
	// 3F000, 42883 naming pgrl_). Migrations may be missing, or a schema
	// lacks USAGE and hides them: Diagnose tells which.
	Undefined
	// Permission: 42501, a privilege is missing.
	Permission
	// ReadOnly: the server or the session refuses writes (25006, or 0A000
	// on a standby during recovery).
	ReadOnly
	// NoPartition: no partition of a partitioned table accepts the row
	// (23514 "no partition").
	NoPartition
	// Input: the statement's input is refused, a data exception, a
	// constraint or a program limit (classes 22, 23 and 54).
	Input
	// Unsupported: the statement does not fit this server, a setup error
	// and never an outage: class 0A (feature not supported, such as Citus
	// refusing an upsert on a distributed table) or class 42 (syntax error
	// or access rule violation: an ambiguous operator or function, an
	// undefined function or operator naming no pgrl_ function, a datatype
	// mismatch, a wrong object type), as when the schema was migrated by
	// another pgrl version or the server is not a supported PostgreSQL.
	// The more specific kinds above take precedence (42501 is Permission,
	// 42P01 and 42883 naming pgrl_ are Undefined, 0A000 during recovery is
	// ReadOnly). A 0A000 "cached plan must not change result type" is
	// Other: a schema change under a prepared statement, which pgx drops,
	// so the next attempt prepares it again.
	Unsupported
)

// Classify returns the Kind of err and the *pgconn.PgError in its chain
// (Other and nil when it holds none).
func Classify(err error) (Kind, *pgconn.PgError) {
	pgErr := pgError(err)
	if pgErr == nil {
		return Other, nil
	}
	code, class := pgErr.Code, ""
	if len(code) >= 2 {
		class = code[:2]
	}
	switch {
	case code == pgerrcode.UndefinedTable, code == pgerrcode.InvalidSchemaName,
		code == pgerrcode.UndefinedFunction && strings.Contains(pgErr.Message, "pgrl_"):
		return Undefined, pgErr
	case code == pgerrcode.InsufficientPrivilege:
		return Permission, pgErr
	case code == pgerrcode.ReadOnlySQLTransaction,
		code == pgerrcode.FeatureNotSupported && strings.Contains(pgErr.Message, "during recovery"):
		return ReadOnly, pgErr
	case code == pgerrcode.CheckViolation && strings.Contains(pgErr.Message, "no partition"):
		return NoPartition, pgErr
	case class == pgerrcode.DataException[:2], class == pgerrcode.IntegrityConstraintViolation[:2],
		class == pgerrcode.ProgramLimitExceeded[:2]:
		return Input, pgErr
	case code == pgerrcode.FeatureNotSupported && strings.Contains(pgErr.Message, "cached plan must not change result type"):
		return Other, pgErr
	case class == pgerrcode.FeatureNotSupported[:2], class == pgerrcode.SyntaxErrorOrAccessRuleViolation[:2]:
		// By class, not pgerrcode's Is… lists, which name only the codes
		// it knew of: a newer server's code of the class counts too.
		return Unsupported, pgErr
	}
	return Other, pgErr
}

// pgError returns the *pgconn.PgError in err's chain, or nil.
func pgError(err error) *pgconn.PgError {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr
	}
	return nil
}

// hasCode reports whether err holds a *pgconn.PgError of one of codes.
func hasCode(err error, codes ...string) bool {
	pgErr := pgError(err)
	return pgErr != nil && slices.Contains(codes, pgErr.Code)
}

// IsLockTimeout reports a statement abandoned by lock_timeout (55P03).
func IsLockTimeout(err error) bool { return hasCode(err, pgerrcode.LockNotAvailable) }

// IsQueryCanceled reports a statement canceled by statement_timeout or a
// cancel request (57014).
func IsQueryCanceled(err error) bool { return hasCode(err, pgerrcode.QueryCanceled) }

// IsDeadlock reports a transaction canceled to break a deadlock (40P01),
// which Citus also raises for a distributed one.
func IsDeadlock(err error) bool { return hasCode(err, pgerrcode.DeadlockDetected) }

// IsAuthFailure reports a connection refused for its user or password
// (28P01, 28000).
func IsAuthFailure(err error) bool {
	return hasCode(err, pgerrcode.InvalidPassword, pgerrcode.InvalidAuthorizationSpecification)
}

// IsMissingDatabase reports a connection to a database that does not exist
// (3D000).
func IsMissingDatabase(err error) bool { return hasCode(err, pgerrcode.InvalidCatalogName) }

// IsMissingFunction reports a pgrl_ function that is not found (42883
// naming pgrl_), one case of Kind Undefined.
func IsMissingFunction(err error) bool {
	kind, pgErr := Classify(err)
	return kind == Undefined && pgErr.Code == pgerrcode.UndefinedFunction
}

// IsForeignKeyViolation reports a row that refers to one that does not
// exist (23503), one case of Kind Input.
func IsForeignKeyViolation(err error) bool { return hasCode(err, pgerrcode.ForeignKeyViolation) }

// IsConstraintViolation reports a row refused by a constraint (class 23),
// the part of Kind Input (and all of NoPartition) that is not a data
// exception or a program limit.
func IsConstraintViolation(err error) bool {
	pgErr := pgError(err)
	return pgErr != nil && strings.HasPrefix(pgErr.Code, pgerrcode.IntegrityConstraintViolation[:2])
}

// IsTooManyPartitions reports pgrl_fixed_window_set_layout refusing a
// partition width that would need more partitions than it makes at once
// (22023 about partitions).
func IsTooManyPartitions(err error) bool {
	pgErr := pgError(err)
	return pgErr != nil && pgErr.Code == pgerrcode.InvalidParameterValue && strings.Contains(pgErr.Message, "partitions")
}

// IsPendingDetach reports a DETACH PARTITION refused because an earlier
// DETACH ... CONCURRENTLY was interrupted (55000, with a hint that asks for
// FINALIZE).
func IsPendingDetach(err error) bool {
	pgErr := pgError(err)
	return pgErr != nil && pgErr.Code == pgerrcode.ObjectNotInPrerequisiteState && strings.Contains(pgErr.Hint, "FINALIZE")
}

// IsRequestRace reports the unique_violation of a check whose request id
// another check stored first (pgrl_request's primary key, migration
// 000017): the statement counted nothing, and sent again it finds that
// check's answer.
func IsRequestRace(err error) bool {
	pgErr := pgError(err)
	return pgErr != nil && pgErr.Code == pgerrcode.UniqueViolation && pgErr.ConstraintName == "pgrl_request_pkey"
}
