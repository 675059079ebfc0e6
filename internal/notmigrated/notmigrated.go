// Package notmigrated holds the one error value that every pgrl package
// returns when pgrl's tables are missing or older than the code needs.
// ratelimit.ErrNotMigrated, migration.ErrNotMigrated and
// cleanup.ErrNotMigrated are this same value, so errors.Is matches whichever
// of them a caller tests against.
//
// A command that holds the connection it looked on reports where it looked
// with an *Error: the database, the user and the schema, and whether the
// connection was configured at all. errors.Is(e, Err) holds for it.
package notmigrated

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Err is returned (wrapped, with the details) when pgrl's migrations have
// not been applied to the database the caller uses.
var Err = errors.New("pgrl's tables are missing or out of date; run `rl-migrate up` against this database " +
	"(with the same --schema as the connection's search_path)")

// Location is where a connection looks for pgrl's tables.
type Location struct {
	// Database is current_database().
	Database string
	// User is current_user.
	User string
	// Schema is current_schema(): the first schema of the search_path that
	// exists, where pgrl's tables would be created. "" when none exists.
	Schema string
	// SearchPath is the session's search_path setting.
	SearchPath string
}

// Querier is what Locate reads from: a *pgx.Conn, a pgx.Tx or a pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Locate reads the Location of the connection q.
func Locate(ctx context.Context, q Querier) (Location, error) {
	var l Location
	err := q.QueryRow(ctx, "SELECT current_database()::text, current_user::text, coalesce(current_schema()::text, ''), current_setting('search_path')").
		Scan(&l.Database, &l.User, &l.Schema, &l.SearchPath)
	return l, err
}

// Error is Err with where the connection looked. Its message names the
// database, the user and the schema, and the fix.
type Error struct {
	Location
	// Missing lists the tables that were looked for and not found, when the
	// caller knows them; empty means all of pgrl's tables.
	Missing []string
	// NoURL is set by a command that connected with libpq's defaults alone
	// (see DefaultsOnly): then the likely cause is the missing URL, not a
	// missing migration, and the message says so first.
	NoURL bool
}

// Error implements error.
func (e *Error) Error() string {
	var b strings.Builder
	if e.Schema == "" {
		fmt.Fprintf(&b, "pgrl's tables are missing: no schema of search_path %q exists in database %q (user %q)",
			e.SearchPath, e.Database, e.User)
	} else {
		fmt.Fprintf(&b, "pgrl's tables are missing in schema %q of database %q (user %q)", e.Schema, e.Database, e.User)
	}
	if len(e.Missing) > 0 {
		fmt.Fprintf(&b, " (not found: %s)", strings.Join(e.Missing, ", "))
	}
	if e.NoURL {
		b.WriteString("; no database URL is configured (neither --database-url nor DATABASE_URL is set, nor any PG* variable), " +
			"so the connection used libpq's defaults: pass --database-url or set DATABASE_URL to pgrl's database " +
			"(in a crontab, a DATABASE_URL=... line above the job)")
		return b.String()
	}
	schema := e.Schema
	if schema == "" {
		schema = firstSchema(e.SearchPath)
	}
	fmt.Fprintf(&b, ": run `rl-migrate up --schema %s` against this database, or point --database-url and --schema "+
		"(or the URL's search_path) at the database and schema that hold pgrl's tables", shellWord(schema))
	return b.String()
}

// firstSchema is the first schema that search_path names, other than
// $user, read as PostgreSQL reads it: a quoted name keeps its case, spaces
// and commas ("" is a quote), an unquoted one is folded to lower case.
func firstSchema(path string) string {
	for rest := strings.TrimSpace(path); rest != ""; rest = strings.TrimSpace(rest) {
		var name string
		if rest[0] == '"' {
			var b strings.Builder
			i := 1
			for ; i < len(rest); i++ {
				if rest[i] == '"' {
					if i+1 < len(rest) && rest[i+1] == '"' {
						b.WriteByte('"')
						i++
						continue
					}
					break
				}
				b.WriteByte(rest[i])
			}
			name, rest = b.String(), rest[min(i+1, len(rest)):]
			_, rest, _ = strings.Cut(rest, ",")
		} else {
			name, rest, _ = strings.Cut(rest, ",")
			name = strings.ToLower(strings.TrimSpace(name))
		}
		if name != "" && name != "$user" {
			return name
		}
	}
	return "<schema>"
}

// shellWord quotes s for a POSIX shell when it holds anything but letters,
// digits and _ . -.
func shellWord(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Is reports whether target is Err, so that errors.Is(e, Err) holds.
func (e *Error) Is(target error) bool { return target == Err }

// At returns an *Error for the connection q, listing missing tables when
// they are known. When q cannot say where it is, At returns Err.
func At(ctx context.Context, q Querier, missing ...string) error {
	l, err := Locate(ctx, q)
	if err != nil {
		return Err
	}
	return &Error{Location: l, Missing: missing}
}

// connectionVars are the libpq variables that choose a server, a database
// or a user.
var connectionVars = []string{"PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE", "PGSERVICEFILE"}

// DefaultsOnly reports whether a connection string of connString ("" when
// neither --database-url nor DATABASE_URL gave one) leaves everything to
// libpq's defaults: it is empty and no PG* variable names a host, port,
// database, user or service. Such a connection reaches the local socket as
// a user and database named after the Unix user, which is rarely pgrl's.
func DefaultsOnly(connString string) bool {
	if strings.TrimSpace(connString) != "" {
		return false
	}
	for _, v := range connectionVars {
		if os.Getenv(v) != "" {
			return false
		}
	}
	return true
}
