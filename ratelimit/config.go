package ratelimit

import (
	"regexp"
	"strings"
	"time"
)

// Algorithm selects how a limiter counts.
type Algorithm string

const (
	// FixedWindow counts units in windows of Window aligned on the clock
	// (multiples of Window since the Unix epoch) and admits at most Limit
	// per window.
	FixedWindow Algorithm = "fixed_window"
	// TokenBucket holds up to Burst tokens and refills Limit tokens per
	// Window, continuously; a check spends its cost in tokens.
	TokenBucket Algorithm = "token_bucket"
	// SlidingWindow estimates the units counted in the Window that ends now
	// from the current and the previous fixed window, weighting the previous
	// one by how much of it the sliding window still covers, and admits at
	// most Limit.
	SlidingWindow Algorithm = "sliding_window"
	// Concurrency is not a rate: at most Limit slots of a key held at once,
	// across every process, each taken by Limiter.Acquire and given back by
	// Slot.Release. Window is a slot's lease: its holder extends it while it
	// holds the slot, and a slot whose holder stopped extending it (a
	// process killed) lapses a Window later. See docs/CONCURRENCY.md.
	Concurrency Algorithm = "concurrency"
)

// Algorithms lists the three algorithms.
var Algorithms = []Algorithm{FixedWindow, TokenBucket, SlidingWindow}

// ParseAlgorithm accepts an algorithm's name as written in Algorithms.
func ParseAlgorithm(s string) (Algorithm, error) {
	for _, a := range Algorithms {
		if string(a) == s {
			return a, nil
		}
	}
	return "", invalid(ErrInvalidAlgorithm, "%q; use fixed_window, token_bucket or sliding_window", s)
}

// KeyMode says how keys are stored in the counter tables.
type KeyMode int

const (
	// HashedKeys stores a 16-byte digest (truncated SHA-256) of the
	// limiter's name and the key. The table never holds the raw identifier
	// (an email, an IP). This is the default.
	HashedKeys KeyMode = iota
	// ReadableKeys stores "name:key" as bytes, so the table can be read by
	// a person: `SELECT encode(key, 'escape') FROM pgrl_fixed_window`.
	// The raw identifiers are then in the database; choose it only when
	// that is acceptable. Names may not contain ':' in this mode.
	ReadableKeys
)

// FailurePolicy says what a check answers when the database cannot.
type FailurePolicy int

const (
	// FailToMemory decides in process memory with the same algorithm and
	// FallbackLimit, so each process still limits on its own. The default.
	FailToMemory FailurePolicy = iota
	// FailOpen allows every check: availability over protection.
	FailOpen
	// FailClosed denies every check: protection over availability (for
	// paid third-party calls, say).
	FailClosed
	// FailError returns the error to the caller, who decides.
	FailError
)

// String names the policy.
func (p FailurePolicy) String() string {
	switch p {
	case FailToMemory:
		return "fail to memory"
	case FailOpen:
		return "fail open"
	case FailClosed:
		return "fail closed"
	case FailError:
		return "fail with error"
	}
	return "unknown policy"
}

// Minimum and maximum windows a limiter accepts.
const (
	MinWindow = time.Millisecond
	MaxWindow = 366 * 24 * time.Hour
)

// Defaults of Config's optional fields: the value a field takes when left
// zero.
const (
	// DefaultAlgorithm is Config.Algorithm when it is empty.
	DefaultAlgorithm = FixedWindow
	// DefaultDenyCacheSize is Config.DenyCacheSize when it is 0 and
	// Penalty is not set (with Penalty the cache is off by default).
	DefaultDenyCacheSize = 10_000
	// DefaultBreakerThreshold is DatabaseOptions.BreakerThreshold when it is 0.
	DefaultBreakerThreshold = 5
	// DefaultBreakerCooldown is DatabaseOptions.BreakerCooldown when it is 0.
	DefaultBreakerCooldown = 500 * time.Millisecond
	// DefaultSpread is Config.Spread when it is 0: one row per key.
	DefaultSpread = 1
	// DefaultMaxBatch is DatabaseOptions.MaxBatch when it is 0.
	DefaultMaxBatch = 256
	// DefaultMaxInFlight is DatabaseOptions.MaxInFlight when it is 0.
	DefaultMaxInFlight = 2
	// DefaultShareMinRetryAfter is DatabaseOptions.ShareMinRetryAfter when it
	// is 0.
	DefaultShareMinRetryAfter = time.Second
	// DefaultTimeout is DatabaseOptions.Timeout when it is 0: how long a check waits
	// for PostgreSQL before the failure policy answers. It is more than five
	// times the p99 of healthy checks measured on an overloaded two-core
	// machine (64 callers on one key, both cores busy with other work;
	// docs/RESILIENCE.md has the figures), so a healthy but busy database
	// keeps deciding, and a fraction of the seconds a person or a client
	// waits for a request.
	DefaultTimeout = 500 * time.Millisecond
)

// Config describes one limit.
type Config struct {
	// Name identifies the limit, such as "login:email+ip". Keys are scoped
	// by it: two limiters with different names never share a counter, even
	// for the same key. Required.
	Name string

	// Algorithm chooses how to count. Defaults to DefaultAlgorithm
	// (FixedWindow).
	Algorithm Algorithm

	// Limit is the most units admitted per Window (fixed and sliding
	// window), or the token bucket's refill: Limit tokens per Window.
	// Required; from 1 to math.MaxInt64 (every value is exact: counts are
	// bigint in PostgreSQL, compared without overflow; a penalised count
	// stops at math.MaxInt64).
	Limit int64

	// Window is the window's length, or the token bucket's refill period.
	// Required; between MinWindow and MaxWindow, in whole microseconds.
	Window time.Duration

	// Burst is the token bucket's capacity: the most units it admits at
	// once after being idle. Defaults to Limit. At most MaxTokens (2^53),
	// and an empty bucket must refill within 1,000 years (Burst/Limit ×
	// Window); Database.Limiter refuses anything else with ErrInvalidBurst,
	// so a token bucket with Limit above 2^53 needs an explicit Burst.
	// Ignored by the window algorithms.
	Burst int64

	// Penalty counts every attempt, denied ones included, so that a client
	// that keeps trying stays locked out until it stops (as in a login
	// form). With Penalty false (the default), a denied check consumes
	// nothing. With the token bucket, a penalised balance may fall to
	// -Burst: the client must wait for the debt to refill.
	Penalty bool

	// KeyMode chooses how keys are stored. Defaults to HashedKeys, which
	// take keys of any length and any bytes. With ReadableKeys, Name is at
	// most MaxReadableNameBytes (256) and every key at most
	// MaxReadableKeyBytes (2048) bytes: a longer key gets ErrKeyTooLong.
	KeyMode KeyMode

	// KeyByWindow stores the window algorithms' counters under the name
	// RateName(Name, Window) instead of Name, so that the counts of one
	// name at two window lengths never meet. Without it, changing a
	// limiter's Window keeps its counts in the rows of the same key, and a
	// fixed-window row is identified by its window's end: a 1-hour and a
	// 2-hour window ending at the same instant share their count. With
	// it, a new window always starts afresh, and WithRate keeps Name for
	// rates at other windows (their rows differ anyway). The token bucket
	// (one bucket per key whatever its rate) ignores it. Package policy
	// sets it: a stored policy's window can change at any time. Defaults to
	// false, which is how counters have always been stored.
	KeyByWindow bool

	// Policy, when set, names a row of pgrl_policy (migration 7) that each
	// check reads in its own statement: the check's Limit, Burst and
	// Penalty, and its Window (for the token bucket; the window algorithms
	// count the window in Window, see below), are the policy's, or those of
	// the key's pgrl_policy_override while one is in force. A change made
	// by plain SQL is obeyed by the very next check of every process, with
	// no extra round trip: primary-key lookups join the counter's
	// statement. While the policy holds the limiter's own figures, a check
	// of a key without an override reads the policy's row alone: while the
	// policy has no override at all (pgrl_policy.has_overrides, migration
	// 000020), or, once the keys of the policy's overrides were read (at
	// most 10,000; the limiters of one Database share them), while their
	// set is the one read (pgrl_policy.overrides_revision, migration
	// 000021). A check that finds otherwise counts nothing in that
	// statement and goes on with the one that reads the key's override
	// too, and the keys are read again; a key with an override always
	// reads it. The limiter's own figures remain what it believes the
	// policy to be: they size the memory tier, check costs, and fill
	// decisions that PostgreSQL did not make.
	//
	// The counter row is the one the limiter names: Name, KeyMode and, for
	// the window algorithms, Window. A check whose policy no longer matches
	// them (deleted; another algorithm or key mode; for the window
	// algorithms another window for this key) counts nothing and returns
	// ErrPolicyChanged. Package policy builds such limiters from its cache
	// and rebuilds them on that error; use it unless you manage policies
	// yourself.
	//
	// Only single checks read the policy: Allow and AllowTx (at AtRate's
	// rate, the rate only chooses the window's rows). UpTo,
	// AllowAll and Peek use the limiter's own figures. Concurrent Allow
	// checks are coalesced as any others are, each key's policy and
	// override read in the batch's statement; a batch that finds a key's
	// policy changed sends its checks again one by one, so that only that
	// key's check gets ErrPolicyChanged. Spread must be 1. Empty (the
	// default) uses the limiter's own figures for everything.
	Policy string

	// OnFailure chooses the answer when the database cannot give one in
	// time (down, slow, connection killed, breaker open). Defaults to
	// FailToMemory.
	OnFailure FailurePolicy

	// FallbackLimit is the limit of the in-process limiter that answers
	// under FailToMemory, per process. Set it to Limit divided by the
	// number of instances you run to keep the total near Limit. A check
	// costing more than the in-process limiter can ever admit (but no more
	// than Limit) is denied by it, counting nothing, with RetryAfter the
	// BreakerCooldown. Defaults to Limit.
	FallbackLimit int64

	// DenyCacheSize caps the keys the local deny cache remembers. When
	// PostgreSQL denies a key until T, this process answers "denied" for
	// that key without a round trip until T. Negative disables the cache.
	// Defaults to DefaultDenyCacheSize (10,000 keys), or to disabled when
	// Penalty is set (a cached denial is not counted, which would soften
	// the penalty).
	DenyCacheSize int

	// ShareDenials sends the denials PostgreSQL makes for this limiter to
	// the application's other processes, which put them in their deny
	// caches (policy.Listener with ListenerOptions.Denials, Register), so
	// that their checks of a denied key stop reaching the database. A
	// denial is sent at most once per key and deadline, only when
	// PostgreSQL made it (never one answered from a cache) and its
	// RetryAfter is at least the Database's
	// DatabaseOptions.ShareMinRetryAfter, as a NOTIFY on
	// DenyChannel carrying the stored key (a digest, never the caller's
	// key), the cost, the deadline and the rate; see SharedDenial for what
	// a receiver does with it. Sending never slows a check: it happens on
	// another goroutine, one statement at a time per limiter and at most
	// one every 20ms, and marks that do not fit its queue of 256 are
	// dropped and counted (ShareStats). Each statement is one round trip
	// on the limiter's database, and NOTIFY serialises the commits of
	// every transaction that sends one, server-wide: share the limits
	// whose denials last (logins, signups, expensive calls), not
	// per-second ones. Needs the deny cache, HashedKeys (a readable stored
	// key is the caller's key, and any role of the database may LISTEN),
	// one row per key (Spread 1), and a pool (a *pgx.Conn or pgx.Tx
	// cannot run a statement beside the caller's); Database.Limiter refuses anything
	// else with ErrInvalidOption. With Penalty, whose deny cache is off by
	// default, nothing is sent. With DatabaseOptions.Now set nothing is
	// sent either (the deadline would not be on the database's clock).
	// Defaults to false.
	ShareDenials bool

	// Shadow makes the limiter decide, report and log, but never deny: a
	// check the limit would deny is allowed, with Decision.ShadowDenied
	// set and Decision.Granted 0 (the limit took nothing for it), on every
	// path: checks in the caller's transaction, AllowAll, the failure
	// policies and a MemoryLimiter too. Use it to roll out a new limit and
	// watch what it would do. Defaults to false.
	Shadow bool

	// Spread splits the limit over this many rows, for a key so hot (a
	// global ceiling checked by every request) that one row's lock becomes
	// the bottleneck: every check then serialises on it. Each check goes
	// to one row (the rows in turn, from a random start in each process),
	// which holds Limit/Spread of the limit (and of Burst). The trade-off:
	// the total admitted never exceeds Limit, but a check can be denied by
	// its row while other rows still have room (several processes, uneven
	// costs), so under a burst the limit can start denying somewhat before
	// Limit is reached; once traffic has exhausted every row the total is
	// Limit exactly. Remaining and Peek are estimates (a row's
	// figure times Spread; the sum over rows). The deny cache keeps each
	// row's denials apart, so a denied row never answers for the others.
	// Defaults to DefaultSpread (1, one row). Negative values are refused
	// with ErrInvalidOption.
	Spread int
}

// PolicyNamePattern is the one pattern a stored policy's name matches: 1
// to 128 of A-Z a-z 0-9 _ . : / + -, starting with a letter or digit.
// Config.Policy, package policy, rl-policy and pgrl_policy.name's CHECK
// constraint (migration 000007) all apply it; a test holds the constraint
// to it.
const PolicyNamePattern = `^[A-Za-z0-9][A-Za-z0-9_.:/+-]{0,127}$`

var policyName = regexp.MustCompile(PolicyNamePattern)

// ValidPolicyName reports whether name matches PolicyNamePattern, so that
// it can name a stored policy.
func ValidPolicyName(name string) bool { return policyName.MatchString(name) }

// capacity is the most units one check can ask for.
func (c Config) capacity() int64 {
	return algorithmOf(c.Algorithm).capacity(c)
}

// withDefaults fills defaults and validates.
func (c Config) withDefaults() (Config, error) {
	if c.Algorithm == "" {
		c.Algorithm = DefaultAlgorithm
	}
	if c.Algorithm != Concurrency {
		if _, err := ParseAlgorithm(string(c.Algorithm)); err != nil {
			return c, err
		}
	}
	if c.Name == "" {
		return c, invalid(ErrInvalidName, "empty name; give every limiter a name such as \"login:ip\"")
	}
	if c.KeyMode == ReadableKeys && strings.Contains(c.Name, ":") {
		return c, invalid(ErrInvalidName, "%q contains ':', which readable keys use as the separator; rename it", c.Name)
	}
	if c.Limit <= 0 {
		return c, invalid(ErrInvalidLimit, "%d for %q; the limit must be at least 1", c.Limit, c.Name)
	}
	if c.Window <= 0 {
		return c, invalid(ErrInvalidWindow, "%v for %q; the window must be positive, such as time.Minute", c.Window, c.Name)
	}
	if c.Window < MinWindow || c.Window > MaxWindow {
		return c, invalid(ErrInvalidWindow, "%v for %q; use a window between %v and %v", c.Window, c.Name, MinWindow, MaxWindow)
	}
	if c.Window%time.Microsecond != 0 {
		return c, invalid(ErrInvalidWindow, "%v for %q; the window must be a whole number of microseconds", c.Window, c.Name)
	}
	if c.Burst < 0 {
		return c, invalid(ErrInvalidBurst, "%d for %q; the burst must be at least 1 (or 0 for the default, Limit)", c.Burst, c.Name)
	}
	if c.Burst == 0 {
		c.Burst = c.Limit
	}
	if err := algorithmOf(c.Algorithm).validate(c); err != nil {
		return c, err
	}
	switch c.OnFailure {
	case FailToMemory, FailOpen, FailClosed, FailError:
	default:
		return c, invalid(ErrInvalidPolicy, "%d for %q; use FailToMemory, FailOpen, FailClosed or FailError", c.OnFailure, c.Name)
	}
	if c.FallbackLimit < 0 {
		return c, invalid(ErrInvalidLimit, "fallback limit %d for %q; use a positive number, or 0 for Limit", c.FallbackLimit, c.Name)
	}
	if c.FallbackLimit == 0 {
		c.FallbackLimit = c.Limit
	}
	if err := c.checkShare(); err != nil {
		return c, err
	}
	if c.Algorithm == Concurrency {
		// A place frees whenever a holder releases it: a refusal says
		// nothing of the next acquire.
		c.DenyCacheSize = -1
	}
	if c.DenyCacheSize == 0 {
		c.DenyCacheSize = DefaultDenyCacheSize
		if c.Penalty {
			// Penalty counts every attempt, so every attempt must reach
			// PostgreSQL.
			c.DenyCacheSize = -1
		}
	}
	if c.Spread < 0 {
		return c, invalid(ErrInvalidOption, "Spread %d for %q; use 1 or more (0 means %d)", c.Spread, c.Name, DefaultSpread)
	}
	if c.Spread == 0 {
		c.Spread = DefaultSpread
	}
	if c.Policy != "" && !ValidPolicyName(c.Policy) {
		return c, invalid(ErrInvalidName, "policy %q for %q; a policy name is 1 to 128 of A-Z a-z 0-9 _ . : / + - (starting with a letter or digit), as pgrl_policy.name", c.Policy, c.Name)
	}
	if c.Policy != "" && c.Spread > 1 {
		return c, invalid(ErrInvalidOption, "Spread %d for %q, whose figures come from policy %q; a stored policy is read by single-row checks: use Spread 1", c.Spread, c.Name, c.Policy)
	}
	if c.Spread > 1 && (c.Limit < int64(c.Spread) || c.Burst < int64(c.Spread)) {
		return c, invalid(ErrInvalidLimit, "limit %d (burst %d) for %q cannot be spread over %d rows; each row needs at least 1", c.Limit, c.Burst, c.Name, c.Spread)
	}
	return c, nil
}

// checkKey refuses a key the table could not hold.
func (c Config) checkKey(key string) error {
	if c.KeyMode == ReadableKeys && len(key) > MaxReadableKeyBytes {
		return invalid(ErrKeyTooLong, "%d bytes for %q; readable keys hold at most %d bytes: shorten the key, or use HashedKeys (the default), which takes keys of any length", len(key), c.Name, MaxReadableKeyBytes)
	}
	return nil
}

// checkAsk validates one check's ask: an all-or-nothing check's cost by
// checkCost; a partial grant's by its floor only, since its ask is a
// ceiling, not a cost: any n of at least 1, however far above the limit,
// is taken as the most it may get (see ceiling).
func (c Config) checkAsk(a ask) error {
	if c.Algorithm == Concurrency && a.slot == nil {
		return invalid(ErrInvalidOption, "a check of %q, a concurrency limit; a slot is held until it is given back: take it with Limiter.Acquire and give it back with Slot.Release", c.Name)
	}
	if a.id != nil {
		if err := c.checkRequestID(a); err != nil {
			return err
		}
	}
	if !a.upTo {
		return c.checkCost(a.n)
	}
	if a.n <= 0 {
		return invalid(ErrInvalidCost, "%d for %q; a partial grant asks for at least 1 unit", a.n, c.Name)
	}
	if a.slice {
		return c.checkSlice(a)
	}
	return nil
}

// checkRequestID refuses a RequestID where it cannot be kept.
func (c Config) checkRequestID(a ask) error {
	switch {
	case a.slice:
		return invalid(ErrInvalidOption, "RequestID with Slice for %q; a slice is a lease's, which answers its checks in memory", c.Name)
	case c.Spread > 1:
		return invalid(ErrInvalidOption, "RequestID for %q, which has Spread %d; a retry may pick another row: use Spread 1", c.Name, c.Spread)
	case c.Policy != "":
		return invalid(ErrInvalidOption, "RequestID for %q, which reads stored policy %q in its statement; check it from the policy's cache (policy.Options.FromCache)", c.Name, c.Policy)
	}
	return nil
}

// checkSlice validates a Slice ask (its n already checked).
func (c Config) checkSlice(a ask) error {
	switch {
	case a.min <= 0:
		return invalid(ErrInvalidCost, "Slice min %d for %q; min is the cost of the check the slice is for: at least 1", a.min, c.Name)
	case a.min > c.capacity():
		return invalid(ErrCostExceedsLimit, "Slice min %d for %q can never be granted: the limit admits at most %d at once", a.min, c.Name, c.capacity())
	case a.min > a.n:
		return invalid(ErrInvalidCost, "Slice min %d for %q is above n %d; a slice grants at most n: pass n >= min", a.min, c.Name, a.n)
	case a.share < 1:
		return invalid(ErrInvalidOption, "Slice share %d for %q; the share is how many holders split what is left: at least 1", a.share, c.Name)
	case c.Spread > 1:
		return invalid(ErrInvalidOption, "Slice for %q, which has Spread %d; a slice is taken from one row: use Spread 1", c.Name, c.Spread)
	case c.Policy != "":
		return invalid(ErrInvalidOption, "Slice for %q, which reads stored policy %q; a slice counts at the limiter's own figures: use a limiter without Policy", c.Name, c.Policy)
	case c.Algorithm == TokenBucket && c.Penalty:
		return invalid(ErrInvalidOption, "Slice for %q, a token bucket with Penalty: while units are out on lease the bucket's debt is bounded by the capacity less those units, so denied attempts would be charged less than without slices; check it with Cost or UpTo", c.Name)
	}
	return nil
}

// ceiling caps a partial grant's ask at the capacity, the most any check
// can take at once: an ask above it is an ask of the capacity in every
// respect (the grant, the Penalty charge, what FailOpen grants), and no
// figure derived from it can overflow. An all-or-nothing ask is returned
// as is.
func (c Config) ceiling(a ask) ask {
	if a.upTo {
		a.n = min(a.n, c.capacity())
	}
	return a
}

// checkCost validates one check's cost.
func (c Config) checkCost(n int64) error {
	if n <= 0 {
		return invalid(ErrInvalidCost, "%d for %q; a check costs at least 1", n, c.Name)
	}
	if c.Spread > 1 {
		// The first rows hold the largest share: ceil(capacity/Spread).
		if per := (c.capacity() + int64(c.Spread) - 1) / int64(c.Spread); n > per {
			return invalid(ErrCostExceedsLimit, "cost %d for %q can never be admitted: spread over %d rows, one row admits at most %d at once; lower Spread or split the work", n, c.Name, c.Spread, per)
		}
	}
	if n > c.capacity() {
		return invalid(ErrCostExceedsLimit, "cost %d for %q can never be admitted: the limit admits at most %d at once; raise the limit (or Burst) or split the work", n, c.Name, c.capacity())
	}
	return nil
}
