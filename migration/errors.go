package migration

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
)

// ErrDirty is matched (with errors.Is) by every error reporting that the
// migrations table is marked dirty: a migration stopped part-way and someone
// must look at the database and then record its true version with Force
// (`rl-migrate force N`).
var ErrDirty = errors.New("pgrl migrations table is dirty")

// ErrUnknownVersion is matched (with errors.Is) by every *UnknownVersionError.
var ErrUnknownVersion = errors.New("unknown pgrl migration version")

// ErrLockWait is matched (with errors.Is) by the error returned when another
// migrator held the migration lock for longer than Config.LockWait.
var ErrLockWait = errors.New("timed out waiting for the pgrl migration lock")

// ErrNotMigrated is matched (with errors.Is) by the error SetLayout returns
// when the migrations it needs have not been applied. It is the same value
// as ratelimit.ErrNotMigrated and cleanup.ErrNotMigrated, so errors.Is
// matches whichever of them a caller tests against.
var ErrNotMigrated = notmigrated.Err

// DirtyError reports a dirty migrations table.
type DirtyError struct {
	// Version is the version recorded in the migrations table.
	Version uint
	// Table is the schema-qualified migrations table.
	Table string
}

// Error names the fix.
func (e *DirtyError) Error() string {
	return fmt.Sprintf("the migrations table %s is dirty at version %d (a migration stopped part-way): "+
		"check the database by hand, then run `rl-migrate force %d` if migration %d is fully applied, "+
		"or `rl-migrate force %d` if it is not, and run the command again",
		e.Table, e.Version, e.Version, e.Version, previous(e.Version))
}

// Is reports whether target is ErrDirty.
func (e *DirtyError) Is(target error) bool { return target == ErrDirty }

// UnknownVersionError reports a version that no embedded migration has.
type UnknownVersionError struct {
	// Version is the version asked for (or found in the database).
	Version uint
	// Available lists the embedded migrations.
	Available []Migration
	// InDatabase is true when the version was read from the migrations
	// table: the database was migrated by a newer pgrl.
	InDatabase bool
}

// Error lists the versions that exist.
func (e *UnknownVersionError) Error() string {
	if e.InDatabase {
		return fmt.Sprintf("the database is at pgrl migration version %d, which this build does not know (it has %s): use a newer rl-migrate",
			e.Version, versionList(e.Available))
	}
	return fmt.Sprintf("no pgrl migration has version %d; available versions: %s", e.Version, versionList(e.Available))
}

// Is reports whether target is ErrUnknownVersion.
func (e *UnknownVersionError) Is(target error) bool { return target == ErrUnknownVersion }

// FailedError reports a migration file that the database rejected. Every pgrl
// migration file runs as one transaction, so the file left nothing behind
// and the migrations table was set back to the version before it.
type FailedError struct {
	// Migration is the file that failed.
	Migration Migration
	// Direction is Up or Down.
	Direction Direction
	// Version is the version the database is at now.
	Version uint
	// Err is the database's error (a *pgconn.PgError).
	Err error
}

// Error says what failed and that nothing changed.
func (e *FailedError) Error() string {
	return fmt.Sprintf("migration %s %s failed and was rolled back, the database stays at version %d: %v",
		e.Migration, e.Direction, e.Version, e.Err)
}

// Unwrap returns the database's error.
func (e *FailedError) Unwrap() error { return e.Err }

// previous returns the embedded version before v, or 0.
func previous(v uint) uint {
	var p uint
	for _, m := range Available() {
		if m.Version < v {
			p = m.Version
		}
	}
	return p
}

// ErrInvalidConfig is matched (with errors.Is) by every error New and
// NewWithConnConfig return for a Config field they refuse, and by the errors
// SetLayout and Grant return for arguments they refuse. Nothing was done.
var ErrInvalidConfig = errors.New("invalid pgrl migration config")

// ErrPermission is matched (with errors.Is) by every *PermissionError. It
// is the same value as ratelimit.ErrPermission, policy.ErrPermission and
// cleanup.ErrPermission, so errors.Is matches whichever of them a caller
// tests against.
var ErrPermission = pgerr.ErrPermission

// ErrTooManyPartitions is matched (with errors.Is) by the error SetLayout
// returns when the partition width is too narrow for the lookahead or for the
// live windows: more than MaxPartitions partitions would be needed.
var ErrTooManyPartitions = errors.New("pgrl migration: too many partitions")

// configError is an ErrInvalidConfig with a message naming the fix.
type configError struct{ msg string }

func (e *configError) Error() string        { return "pgrl migration: " + e.msg }
func (e *configError) Is(target error) bool { return target == ErrInvalidConfig }

func invalidConfig(format string, args ...any) error {
	return &configError{fmt.Sprintf(format, args...)}
}

// PermissionError reports that the database user lacks a privilege an
// operation needs, and the statement that grants it.
type PermissionError struct {
	// User is the database user the migrator connected as.
	User string
	// Need says what the operation needs, e.g. "CREATE on schema app".
	Need string
	// Fix is the statement (or action) that gives it.
	Fix string
}

// Error names the missing privilege and the grant.
func (e *PermissionError) Error() string {
	return fmt.Sprintf("permission problem: the database user %s lacks %s; %s", e.User, e.Need, e.Fix)
}

// Is reports whether target is ErrPermission.
func (e *PermissionError) Is(target error) bool { return target == ErrPermission }

// MissingRoleError reports roles named to Grant (Config.GrantTo, rl-migrate
// --grant-to) that do not exist. Up and UpTo check every role before
// migrating, so nothing was done. It matches ErrInvalidConfig.
type MissingRoleError struct {
	// Roles are the roles that do not exist, in the order given.
	Roles []string
}

// Error names the roles and the statements that create them.
func (e *MissingRoleError) Error() string {
	quoted := make([]string, len(e.Roles))
	create := make([]string, len(e.Roles))
	for i, r := range e.Roles {
		quoted[i] = fmt.Sprintf("%q", r)
		create[i] = "CREATE ROLE " + pgx.Identifier{r}.Sanitize() + " LOGIN PASSWORD '...'"
	}
	what, it := "role "+quoted[0]+" does not exist", "it"
	if len(e.Roles) > 1 {
		what, it = "roles "+strings.Join(quoted, ", ")+" do not exist", "them"
	}
	return "pgrl migration: " + what + ", so nothing was done; create " + it + " first (" + strings.Join(create, "; ") + ")"
}

// Is reports whether target is ErrInvalidConfig.
func (e *MissingRoleError) Is(target error) bool { return target == ErrInvalidConfig }

// ErrPending is matched (with errors.Is) by every *PendingError: the schema
// lacks migrations this build carries.
var ErrPending = errors.New("pgrl migrations are pending")

// PendingError is what Check returns when migrations are pending. It
// matches ErrPending and ErrNotMigrated.
type PendingError struct {
	// Database is the database looked in (current_database()).
	Database string
	// User is the database user that looked (current_user).
	User string
	// Schema is the schema looked in.
	Schema string
	// Table is the migrations table, inside Schema.
	Table string
	// Version is the version recorded (0: none applied, or no table).
	Version uint
	// Pending lists the migrations not applied, oldest first.
	Pending []Migration
}

// Error names where it looked, what is missing and the command to run.
func (e *PendingError) Error() string {
	cmd := "rl-migrate --schema " + e.Schema
	if e.Table != "" && e.Table != DefaultTable {
		cmd += " --migrations-table " + e.Table
	}
	need := Latest().Version
	if n := len(e.Pending); n > 0 {
		need = e.Pending[n-1].Version
	}
	return fmt.Sprintf("pgrl migrations are pending in database %s, schema %s (looked in as user %s): it is at version %d, this build needs %d; pending: %s; "+
		"run `%s up` as the migration role (the owner of pgrl's tables) against this database",
		e.Database, e.Schema, e.User, e.Version, need, versionList(e.Pending), cmd)
}

// Is reports whether target is ErrPending or ErrNotMigrated.
func (e *PendingError) Is(target error) bool { return target == ErrPending || target == ErrNotMigrated }
