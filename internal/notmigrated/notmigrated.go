// Package notmigrated holds the one error value that every pgrl package
// returns when pgrl's tables are missing or older than the code needs.
// ratelimit.ErrNotMigrated, migration.ErrNotMigrated and
// cleanup.ErrNotMigrated are this same value, so errors.Is matches whichever
// of them a caller tests against.
package notmigrated

import "errors"

// Err is returned (wrapped, with the details) when pgrl's migrations have
// not been applied to the database the caller uses.
var Err = errors.New("pgrl's tables are missing or out of date; run `rl-migrate up` against this database " +
	"(with the same --schema as the connection's search_path)")
