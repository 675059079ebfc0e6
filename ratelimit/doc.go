// Package ratelimit limits how often a key (a user, an IP address, an API
// key) may do something, with counters shared by every instance of an
// application through the PostgreSQL database it already runs.
//
//	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{}) // once per database
//	...
//	lim, err := limits.Limiter(ratelimit.Config{
//		Name:   "login:ip",
//		Limit:  20,
//		Window: time.Minute,
//	})
//	...
//	d, err := lim.Allow(ctx, clientIP)
//	if err != nil { ... }
//	if !d.Allowed {
//		w.Header().Set("Retry-After", d.RetryAfterHeader())
//		w.WriteHeader(http.StatusTooManyRequests)
//		return
//	}
//
// # One statement, one round trip
//
// Every check is a single SQL statement sent in one round trip (the queries
// are in sql/queries, generated into package gen). There is no read before
// the write and no transaction around it: the row lock PostgreSQL takes on the
// key's counter is the only lock, so concurrent checks of one key, from any
// number of processes, are serialised by the database and admit exactly the
// limit. Checks of different keys do not wait for each other.
//
// Concurrent checks share statements. The limits of one Database share
// one coalescer: a check goes out at once, alone,
// when fewer than MaxInFlight of its round trips are running and no check
// of its key is in flight, so a lone caller pays nothing (the
// same statement: p50 0.96 to 1.09 times the raw SQL in rl-bench);
// otherwise it waits for the next round trip, which decides up to MaxBatch
// waiting checks of every limiter sharing it in one statement per
// algorithm. The waiting checks of one key, a hot key, are decided by one
// update of its row, one after another in arrival order, with exactly the
// arithmetic of the single-check statement: each caller gets its own
// Decision. DatabaseOptions.DisableCoalescing turns it off. An AllowAll
// decision whose limits share one algorithm rides the same statements: the
// statement decides its checks together and applies them only when all
// allow (AllOrNothing), so a login costs no round trip of its own. One that
// spans algorithms runs in a transaction of its own, one statement per
// algorithm, rolled back when a limit denies.
//
// # Partial grants
//
// UpTo(n), an option of Allow, takes as many of n units as the key has left and reports how
// many in Decision.Granted: the bytes an upload may still send, the rows a
// batch job may still process. n is a ceiling, not a cost: any n >= 1 is
// valid, and an n above the limit's capacity (Limit, or Burst for the token
// bucket) is an ask of the capacity on every path (single and coalesced
// checks, transactions, the memory tier, Spread rows, FailOpen), so
// math.MaxInt64 asks for all that is left. Under Penalty the ask is counted,
// as for any denied check: n, at most the capacity. A shadow-mode denial
// proceeds with Granted 0, what the limit took.
//
// # Time
//
// The database's clock decides: windows, refill and retry times come from
// the transaction's timestamp (now(): for a check sent on its own, the
// statement's; for a check in the caller's transaction, the transaction's start),
// never from the
// application servers' clocks, which disagree. DatabaseOptions.Now (and
// MemoryOptions.Now for a MemoryLimiter) exists only so that tests can pin
// the instant; production leaves it nil.
//
// A statement that waited on a row lock can find the row updated by a
// statement whose timestamp is later than its own. Elapsed time is clamped at
// zero in that case: a token bucket never refills backwards, and the sliding
// window never moves back to an earlier window.
//
// # Algorithms
//
// FixedWindow counts units in windows of Config.Window aligned on multiples
// of the window since the Unix epoch (a one-minute window starts on every
// minute of the database clock). A check costing n is allowed when
// count + n <= Limit. ResetAt is the window's end. It is exact and cheap, but
// a client can spend Limit at the end of one window and Limit again at the
// start of the next.
//
// TokenBucket holds up to Burst tokens (default Limit) and refills
// continuously at Limit tokens per Window:
//
//	available = min(Burst, tokens + elapsed × Limit/Window)
//
// A check costing n is allowed when available >= n, and then spends n. The
// refill, the check and the spend happen in one UPDATE (the update arm of an
// upsert, so a key's first check needs no second statement). ResetAt is when
// the bucket will be full again; RetryAfter is when n tokens will be there.
//
// SlidingWindow keeps, per key, the count of the current aligned window and
// of the previous one, and estimates the units in the Window that ends now as
//
//	estimate = previous × (Window − elapsed)/Window + current
//
// where elapsed is how far now is into the current window; a check costing n
// is allowed when estimate + n <= Limit (compared exactly, in integers). The
// estimate assumes the previous window's units were spread evenly. Its error
// bound: no aligned window ever admits more than Limit, so any span of one
// Window admits at most 2×Limit; when traffic is steady the estimate is close
// to the true count, and it smooths the burst a fixed window allows at every
// boundary. The estimate can also deny slightly early, when the previous
// window's units came early in it.
//
// # Denied requests
//
// By default a denied check consumes nothing, for every algorithm: a client
// that retries too early does not push its own reset further away. With
// Config.Penalty every attempt counts (as a login form wants, so that a
// script that keeps hammering stays locked out): the fixed and sliding
// windows count denied units too, and the token bucket charges them, its
// balance falling to at most −Burst, a debt that refills like any balance.
//
// # Keys
//
// Any bytes are a valid key: empty, NUL, invalid UTF-8, megabytes long. By
// default the table holds a 16-byte digest of the limiter's name and the key,
// never the identifier itself (an email or an IP address is personal data).
// Config.KeyMode = ReadableKeys stores "name:key" instead, for teams that want
// to read the table; PostgreSQL's index then bounds them: keys up to
// MaxReadableKeyBytes (2,048) and names up to MaxReadableNameBytes (256), a
// longer key giving ErrKeyTooLong before any round trip. Because the name is part of the stored key, two
// limiters with different names never share a counter.
//
// # Per-call limits
//
// AtRate checks a key at a Rate given with the call (Limit, Window,
// Burst) instead of the limiter's own: a plan's quota, a tenant's
// override. A rate is validated as Config is. With the limiter's window
// it uses the limiter's rows, so the key's count carries over; another
// window of a fixed or sliding window counts in rows of its own (the
// stored key of RateName); a token bucket keeps one balance per key at any
// rate. Check.Rate gives a rate to one check of AllowAll. Package
// policy keeps such limits in the database.
//
// # Transactions
//
// AllowTx, PeekTx, ResetTx and AllowAllTx run in the caller's
// pgx.Tx: when the transaction rolls back, the units are refunded (a failed
// signup does not count against the signup limit). AllowAllTx works under a
// savepoint, so a denial or a failure leaves the transaction usable. The key's row stays locked until the
// transaction ends, so other checks of that key wait for it: keep such
// transactions short.
//
// # Connections
//
// A limiter runs on a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx, in any of pgx's
// query exec modes (the default cached prepared statements, exec, describe,
// or the simple protocol used behind PgBouncer without prepared statement
// support). No session setting changes a decision: the statements return
// instants as microseconds since the Unix epoch and balances as float8 bits,
// so DateStyle, IntervalStyle, TimeZone, extra_float_digits, bytea_output and
// a search_path with other schemas first are all safe.
//
// # Ranges
//
// Every accepted value decides exactly: Limit and costs up to math.MaxInt64
// for the window algorithms; for the token bucket, Burst up to MaxTokens
// (2^53) and an empty bucket refilling within 1,000 years. Database.Limiter refuses
// anything else with a typed error that names the fix.
//
// # Failures and the database
//
// Missing tables give ErrNotMigrated (run `rl-migrate up`); missing grants
// give ErrPermission, naming the role and the grant (a schema without
// USAGE, whose tables PostgreSQL hides, included); a read-only standby gives
// ErrReadOnly; input PostgreSQL refuses gives ErrInvalidInput; SQL the
// server refuses as such (SQLSTATE class 0A or 42: a schema another pgrl
// version migrated, Citus refusing an upsert) gives ErrUnsupported, logged
// once per limiter. None of them is answered by the failure policy or
// counts towards the breaker; IsConfigError reports them and the other
// errors that are the caller's to fix.
//
// The database's errors cross into this package at one boundary: every
// SQLSTATE is read in one place, shared with pgrl's other packages and
// tools, and mapped there to one of the errors above, with the
// *pgconn.PgError kept in the chain for errors.As. Any other database error
// is an outage, answered by the failure policy. Test with errors.Is and
// IsConfigError, not with SQLSTATEs.
//
// The counter tables are UNLOGGED: PostgreSQL empties them after a crash,
// and a standby promoted by a failover starts with empty counters, so every
// limit starts afresh. For a rate limiter that is
// the right trade: writes skip the WAL and cost about half as much.
//
// In the partitioned layout of the fixed-window table (`rl-migrate layout
// partitioned`), checks run no DDL: the partitions are made ahead by the
// layout switch, rl-cleanup --partitions and EnsurePartitions. A check whose
// window has no partition returns ErrNoPartition (a setup error, never
// answered by the failure policy), unless DatabaseOptions.CreatePartitions lets it
// create the partition and check again.
package ratelimit
