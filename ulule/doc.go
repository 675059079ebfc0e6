// Package ulule is a store for github.com/ulule/limiter/v3 whose counters
// live in PostgreSQL, in pgrl's fixed-window table, kept through pgrl's
// public package ratelimit: services that already limit with ulule's
// middlewares (net/http, gin, fasthttp) move their counters from Redis to
// the PostgreSQL they run by changing the line that builds the store.
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
// ulule's stores): a key's counter is ratelimit's for the name
// ratelimit.RateName(prefix, period), such as "limiter@60000000us", stored
// as a 16-byte digest (ratelimit.StoredKey) unless Options.ReadableKeys is
// set: the table holds no e-mail or IP address. Readable keys are stored
// as "limiter@60000000us:key", up to ratelimit.MaxReadableKeyBytes
// (ErrKeyTooLong beyond).
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
// memory store); what ratelimit.IsConfigError reports (bad input, a
// missing migration, grant or partition, a read-only database, SQL the
// server does not support) is always returned as a typed error. After
// repeated failures ratelimit's circuit breaker keeps calls away from the
// database for a moment (ratelimit.DefaultBreakerCooldown); the failure
// policy answers them meanwhile.
//
// In pgrl's partitioned layout of the table (`rl-migrate layout
// partitioned`) a call that finds no partition for its window creates it
// (ratelimit.DatabaseOptions.CreatePartitions), so the store's role must
// then own pgrl's tables; rl-cleanup --partitions makes them ahead.
//
// # How it is built
//
// The store is one ratelimit.Database on the given pool (its Timeout is
// Options.Timeout) and one fixed-window ratelimit.Limiter named after the
// prefix, with Penalty, so that every hit counts, and no limit of its own
// (math.MaxInt64), so that none is refused: each call counts at its
// rate's period (ratelimit.AtRate), and the store applies ulule's limit to
// the count, with ulule's own arithmetic. Get and a positive Increment are
// Limiter.Allow with ratelimit.Cost; Peek is Limiter.Peek; Reset is
// Limiter.Reset, then Peek for the window's end. Concurrent calls are
// coalesced into shared statements, exactly, as ratelimit's checks are;
// they take at most half of a pool's connections (ratelimit's
// PoolShareDivisor).
//
// The one statement ratelimit does not offer is a negative increment (a
// cost is at least 1): the store sends it itself, through pgrl's generated
// query (package gen, in queries.go) on the same counter, and leaves it to
// ratelimit to explain an error.
package ulule
