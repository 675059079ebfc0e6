// Package ulule is a store for github.com/ulule/limiter/v3 whose counters
// live in PostgreSQL, in pgrl's fixed-window table: services that already
// limit with ulule's middlewares (net/http, gin, fasthttp) move their
// counters from Redis to the PostgreSQL they run by changing the line that
// builds the store.
//
//	store, err := ulule.NewStore(pool) // was: sredis.NewStore(redisClient)
//	if err != nil { ... }
//	lim := limiter.New(store, limiter.Rate{Period: time.Minute, Limit: 100})
//
// The tables come from pgrl's migrations: run `rl-migrate up` against the
// database first (ErrNotMigrated otherwise), and grant the store's role
// USAGE on the schema and SELECT, INSERT, UPDATE, DELETE on
// pgrl_fixed_window (ErrPermission, naming the grant, otherwise).
//
// # Semantics
//
// The store answers exactly as ulule's Redis store does, and passes ulule's
// own store test suite (drivers/store/tests):
//
//   - every Get and Increment counts, also past the limit (ulule has no
//     notion of a refused hit);
//   - Reached is true when the count is over the limit (count > Limit), so
//     the Limit-th hit is the last one not reached;
//   - Remaining is Limit minus the count, never below 0;
//   - Reset is the Unix second at which the window ends: never more than
//     one period away;
//   - Peek reports the same figures without counting; Reset (the method)
//     forgets the key's counts at that period.
//
// One difference: ulule's Redis store starts a key's window at the key's
// first hit, pgrl aligns windows on multiples of the period since the Unix
// epoch (a one-minute window ends on a whole minute), on the database's
// clock, so every instance of an application agrees on them whatever its
// own clock says. Both are fixed windows: in either, a client can spend the
// limit at the end of one window and again at the start of the next.
//
// Keys are scoped by the prefix and the period (limits of different periods
// never share a counter; limits of the same period and prefix do, as in
// ulule's stores), and stored as a 16-byte digest unless
// Options.ReadableKeys is set: the table holds no e-mail or IP address.
//
// Only the fixed window is offered. pgrl's token bucket and sliding window
// cannot meet ulule's contract exactly: a token bucket has a balance, not a
// count of hits, so "count > limit" has no exact meaning, and with every
// hit counted its debt can push the time it is full again beyond one
// period; the sliding window's counts reach up to two windows back, so its
// reset time can be two periods away.
//
// # Failures
//
// By default a database error is returned, as the Redis store returns
// Redis's. Options.OnFailure chooses otherwise for outages (FailOpen,
// FailClosed, or FailToStore with another limiter.Store such as ulule's
// memory store); bad input, a missing migration and a read-only standby are
// always returned as typed errors.
//
// # Dependencies
//
// The store uses four of pgrl's generated fixed-window queries (package
// gen, in queries.go) and pgrl's key hashing (ratelimit.StoredKey).
package ulule
