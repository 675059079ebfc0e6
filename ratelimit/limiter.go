package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
)

// DB runs a limiter's statements: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB = gen.DBTX

// Limiter is one limit kept in PostgreSQL. Every check is one SQL statement
// in one round trip; the row lock on the key's counter is the only lock. A
// Limiter is safe for concurrent use.
//
// Its methods are one matrix. Three verbs: Allow checks and counts, Peek
// reads without counting, Reset forgets. Each has a …Tx twin (AllowTx,
// PeekTx, ResetTx) that runs in the caller's transaction. Each takes the
// same options: AtRate(r) counts against rate r instead of the limiter's
// own, and for Allow, Cost(n) asks for n units at once and UpTo(n) for as
// many of n as are left. AllowAll and AllowAllTx decide several limits
// together, each Check with its Cost and Rate. MemoryLimiter and package
// policy's Limiter have the same verbs (Checker), without the twins.
type Limiter struct {
	shape
	st           *Database // the database, its coalescer and breaker
	name         string    // in metrics and shared denials: Name, or a rate's limiter's
	q            *gen.Queries
	memory       *MemoryLimiter // answers under FailToMemory
	deny         *denyCache     // nil when disabled
	shadowLogged atomic.Int64
	// unsupportedLogged: an ErrUnsupported was logged (logUnsupported).
	unsupportedLogged atomic.Bool
	shards            []*Limiter // with Spread > 1: one limiter per row
	nextShard         atomic.Uint64
	coalescer         *coalescer // nil when coalescing is off
	rates             rateCache  // limiters for per-call rates (rate.go)
	share             denyShare  // denials shared with other processes (denyshare.go)
	// overrides is what the Database knows of the stored policy's
	// overrides (Config.Policy; nil without one), so that a check of a key
	// without one reads the policy's row alone (takeStored).
	overrides *policyOverrides
	// overridesOff: the policy's row does not hold the limiter's own
	// figures, or has too many overrides to hold, so every check reads the
	// key's override in its statement (takePolicy). It stays set: package
	// policy builds a new limiter when its policy changes.
	overridesOff atomic.Bool
}

// newLimiter is Database.Limiter without the name's length check, which a
// spread limit's rows, named "name#i", would fail.
func newLimiter(st *Database, cfg Config) (*Limiter, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	l := &Limiter{shape: newShape(cfg), st: st, name: cfg.Name, q: gen.New()}
	if cfg.Policy != "" {
		l.overrides = st.policyOverrides(cfg.Policy)
	}
	fb := cfg
	fb.Limit = cfg.FallbackLimit
	fb.Shadow = false // the limiter applies shadow mode to its fallback's decisions
	fb = l.alg.fallbackConfig(cfg, fb)
	// No Observer: the limiter observes its own decisions, fallbacks included.
	if l.memory, err = NewMemory(fb, MemoryOptions{Logger: st.opts.Logger, Now: st.opts.Now}); err != nil {
		return nil, err
	}
	l.memory.cooldown = st.opts.BreakerCooldown
	if cfg.DenyCacheSize > 0 && cfg.Spread <= 1 {
		// A spread limit's rows keep their own: a denial by one row says
		// nothing of the others.
		l.deny = newDenyCache(cfg.DenyCacheSize)
	}
	if err := l.initShare(); err != nil {
		return nil, err
	}
	if cfg.Spread <= 1 && cfg.Algorithm != Concurrency {
		// The store's coalescer (nil for a *pgx.Conn or a pgx.Tx, which
		// serve one statement at a time). A spread limit's rows coalesce
		// on their own. A check that reads a stored policy reads it in the
		// batch's statement (the …TakePolicyChecks statements). An Acquire
		// goes out alone: it holds a slot, it counts nothing.
		l.coalescer = st.coalescer
	}
	if cfg.Spread > 1 {
		s := int64(cfg.Spread)
		for i := range s {
			sc := cfg
			sc.Name = fmt.Sprintf("%s#%d", cfg.Name, i)
			sc.Spread = 1
			// Share Limit and Burst out, the remainder to the first rows.
			sc.Limit = cfg.Limit/s + b2i(i < cfg.Limit%s)
			sc.Burst = cfg.Burst/s + b2i(i < cfg.Burst%s)
			sc = l.alg.spreadRow(sc)
			shard, err := newLimiter(st, sc)
			if err != nil {
				return nil, err
			}
			l.shards = append(l.shards, shard)
		}
		l.nextShard.Store(rand.Uint64())
	}
	return l, nil
}

func isNil(db DB) bool {
	switch v := db.(type) {
	case nil:
		return true
	case *pgxpool.Pool:
		return v == nil
	case *pgx.Conn:
		return v == nil
	}
	return false
}

// singleConn reports whether db is one connection, which cannot run two
// statements at once.
func singleConn(db DB) bool {
	switch db.(type) {
	case *pgx.Conn, pgx.Tx:
		return true
	}
	return false
}

// BreakerOpen reports whether the breaker currently keeps checks away from
// the database.
func (l *Limiter) BreakerOpen() bool { return l.st.breaker.open.Load() }

// SameDatabase reports whether l and o send their statements to one
// database (their Databases were made on the same pool or connection), so
// that AllowAll may check them together.
func (l *Limiter) SameDatabase(o *Limiter) bool { return o != nil && l.st.db == o.st.db }

// Config returns the limiter's configuration, defaults filled in.
func (l *Limiter) Config() Config { return l.cfg }

// Allow checks and counts units for key: one, or what Cost or UpTo asks
// for, at the limiter's rate or AtRate's.
//
// When the database fails or takes longer than the Timeout, the failure
// policy answers (Decision.Store and Reason say so) and the error is nil,
// unless the policy is FailError. Errors that mean the setup is wrong
// (ErrNotMigrated, ErrReadOnly) and bad arguments are always returned, as is
// the caller's own context ending.
func (l *Limiter) Allow(ctx context.Context, key string, opts ...Option) (Decision, error) {
	lr, a, err := l.resolve(opts, true)
	if err != nil {
		return Decision{}, WithOutcome(err, OutcomeNotConsumed)
	}
	return lr.check(ctx, nil, key, a)
}

// check decides one check of l (in tx when it is not nil) through the
// stages of decide (pipeline.go) and reports it to the Observer.
func (l *Limiter) check(ctx context.Context, tx pgx.Tx, key string, a ask) (Decision, error) {
	start := time.Now()
	a = l.cfg.ceiling(a)
	req := &request{checks: []*pendingCheck{{l: l, key: key, ask: a}}, whole: []*Limiter{l}, tx: tx}
	decs, err := l.validate(req)
	if err == nil {
		decs, err = decide(ctx, req)
	}
	// decide attaches the outcome of what it sent; anything else was
	// refused before a statement went out.
	err = WithOutcome(err, OutcomeNotConsumed)
	decs = req.observe(decs, err, time.Since(start))
	if err != nil {
		return Decision{}, err
	}
	return decs[0], nil
}

// validate refuses a check whose ask or key is bad, and picks the row of
// a spread limit that decides it.
func (l *Limiter) validate(req *request) ([]Decision, error) {
	r := req.checks[0]
	if err := l.cfg.checkAsk(r.ask); err != nil {
		return nil, err
	}
	if err := l.cfg.checkKey(r.key); err != nil {
		return nil, err
	}
	if l.shards != nil {
		// A row's deny cache answers for that row only.
		r.l = l.pickShard(r.ask.retryCost())
	}
	return nil, nil
}

// asWhole reports a decision of row (l itself, or one of its spread rows)
// in terms of the whole limit.
func (l *Limiter) asWhole(row *Limiter, d Decision) Decision {
	if row == l {
		return d
	}
	return l.spreadDecision(d)
}

// AllowTx is Allow inside the caller's transaction: rolling the
// transaction back refunds the units. The key's counter row stays locked
// until the transaction ends, so other checks of the same key wait for it:
// keep such transactions short. There is no failure policy, breaker, deny
// cache or Timeout: errors are returned. The Observer sees the decision,
// whether the transaction commits or not.
func (l *Limiter) AllowTx(ctx context.Context, tx pgx.Tx, key string, opts ...Option) (Decision, error) {
	if tx == nil {
		return Decision{}, WithOutcome(ErrNilDB, OutcomeNotConsumed)
	}
	lr, a, err := l.resolve(opts, true)
	if err != nil {
		return Decision{}, WithOutcome(err, OutcomeNotConsumed)
	}
	return lr.check(ctx, tx, key, a)
}

// Peek reports the key's state, as a check of one unit would see it
// (at AtRate's rate, when given), without counting anything.
func (l *Limiter) Peek(ctx context.Context, key string, opts ...Option) (Decision, error) {
	lr, err := l.reading(key, opts)
	if err != nil {
		return Decision{}, err
	}
	cctx, cancel := lr.st.deadlines.within(ctx, lr.st.opts.Timeout)
	defer cancel()
	d, err := lr.peek(cctx, lr.st.db, key)
	return d, lr.explain(ctx, err)
}

// PeekTx is Peek inside the caller's transaction.
func (l *Limiter) PeekTx(ctx context.Context, tx pgx.Tx, key string, opts ...Option) (Decision, error) {
	if tx == nil {
		return Decision{}, ErrNilDB
	}
	lr, err := l.reading(key, opts)
	if err != nil {
		return Decision{}, err
	}
	d, err := lr.peek(ctx, tx, key)
	return d, lr.explain(ctx, err)
}

// Reset forgets everything counted for key under this limiter (in
// PostgreSQL, in this process's memory fallback and in its deny cache); at
// AtRate's rate, it forgets the rows that rate uses (for the token bucket,
// the key's one bucket).
//
// Reset returns no Decision: afterwards the key is in the state of a key
// never seen (Used 0, Remaining Limit, or Burst for the token bucket,
// Allowed true), known without asking the database, and a Decision built
// by Reset would lack what only a check knows (ResetAt on the database's
// clock). Peek reports it in full if you need it.
func (l *Limiter) Reset(ctx context.Context, key string, opts ...Option) error {
	lr, err := l.reading(key, opts)
	if err != nil {
		return err
	}
	lr.forgetLocal(ctx, key)
	cctx, cancel := lr.st.deadlines.within(ctx, lr.st.opts.Timeout)
	defer cancel()
	return lr.explain(ctx, lr.reset(cctx, lr.st.db, key))
}

// ResetTx is Reset inside the caller's transaction.
func (l *Limiter) ResetTx(ctx context.Context, tx pgx.Tx, key string, opts ...Option) error {
	if tx == nil {
		return ErrNilDB
	}
	lr, err := l.reading(key, opts)
	if err != nil {
		return err
	}
	lr.forgetLocal(ctx, key)
	return lr.explain(ctx, lr.reset(ctx, tx, key))
}

// reading resolves the options of Peek and Reset (AtRate only) and checks
// key: it returns the limiter that reads or forgets key's rows.
func (l *Limiter) reading(key string, opts []Option) (*Limiter, error) {
	lr, _, err := l.resolve(opts, false)
	if err != nil {
		return nil, err
	}
	return lr, lr.cfg.checkKey(key)
}

func (l *Limiter) forgetLocal(ctx context.Context, key string) {
	if l.deny != nil {
		l.deny.forget(key)
	}
	l.forgetShared(key)
	for _, s := range l.shards {
		s.forgetLocal(ctx, key)
	}
	_ = l.memory.Reset(ctx, key)
}

// localNow is the process's clock (with its monotonic reading), or the
// pinned clock in tests.
func (l *Limiter) localNow() time.Time {
	if now := l.st.opts.Now; now != nil {
		return now()
	}
	return time.Now()
}

func (l *Limiter) at() *time.Time {
	if l.st.opts.Now == nil {
		return nil
	}
	t := l.st.opts.Now()
	return &t
}

// atUs is at in microseconds since the Unix epoch, NULL for the database's
// clock: for the internal statements, which take instants as integers (a
// timestamptz in text would be read by the session's DateStyle).
func (l *Limiter) atUs() pgtype.Int8 {
	if l.st.opts.Now == nil {
		return pgtype.Int8{}
	}
	return pgtype.Int8{Int64: l.st.opts.Now().UnixMicro(), Valid: true}
}

func (l *Limiter) key(key string) []byte { return StoredKey(l.cfg.KeyMode, l.counterName(), key) }

// counterName is the name the limiter's counters are stored under: Name,
// or with KeyByWindow (window algorithms) Name and the window.
func (l *Limiter) counterName() string {
	if l.cfg.KeyByWindow && l.cfg.Algorithm != TokenBucket {
		return RateName(l.cfg.Name, l.cfg.Window)
	}
	return l.cfg.Name
}

// applied returns the arithmetic of the rate a policy statement applied:
// the limiter's own when the policy still holds it.
func (l *Limiter) applied(r Rate) *shape {
	if r.Burst == 0 {
		r.Burst = r.Limit
	}
	if r == l.Rate() {
		return &l.shape
	}
	cfg := l.cfg
	cfg.Limit, cfg.Window, cfg.Burst = r.Limit, r.Window, r.Burst
	s := newShape(cfg)
	return &s
}

// policyErr turns a policy statement's empty answer into ErrPolicyChanged.
func (l *Limiter) policyErr(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: policy %q is missing, or no longer a %s storing %s keys with a %v window for this key; build the limiter again from it (package policy does)",
			ErrPolicyChanged, l.cfg.Policy, l.cfg.Algorithm, keyModeText(l.cfg.KeyMode), l.cfg.Window)
	}
	return err
}

// keyModeText is m as pgrl_policy.key_mode spells it.
func keyModeText(m KeyMode) string {
	if m == ReadableKeys {
		return "readable"
	}
	return "hashed"
}

func (l *Limiter) peek(ctx context.Context, db DB, key string) (Decision, error) {
	if l.shards != nil {
		var sum Decision
		for i, s := range l.shards {
			d, err := s.peek(ctx, db, key)
			if err != nil {
				return Decision{}, err
			}
			if i == 0 {
				sum = d
				continue
			}
			sum.Allowed = sum.Allowed || d.Allowed
			sum.Used = satAdd(sum.Used, d.Used)
			sum.Remaining += d.Remaining
			sum.ResetAt = maxTime(sum.ResetAt, d.ResetAt)
			sum.RetryAfter = min(sum.RetryAfter, d.RetryAfter)
		}
		sum.Limit = l.cfg.capacity()
		if sum.Allowed {
			sum.RetryAfter = 0
		}
		return sum, nil
	}
	return l.alg.peek(ctx, l, db, l.key(key))
}

func (l *Limiter) reset(ctx context.Context, db DB, key string) error {
	for _, s := range l.shards {
		if err := s.reset(ctx, db, key); err != nil {
			return err
		}
	}
	return l.alg.reset(ctx, l, db, l.key(key))
}

// pickShard picks the row a check of cost n goes to: the rows in turn (from
// a random start per process, so that processes spread differently), which
// fills them evenly, skipping rows whose share cannot hold n.
func (l *Limiter) pickShard(n int64) *Limiter {
	for range len(l.shards) {
		s := l.shards[l.nextShard.Add(1)%uint64(len(l.shards))]
		if n <= s.cfg.capacity() {
			return s
		}
	}
	return l.shards[0] // the first rows hold the largest shares
}

// spreadDecision reports a row's decision in terms of the whole limit.
func (l *Limiter) spreadDecision(d Decision) Decision {
	d.Limit = l.cfg.capacity()
	n := int64(len(l.shards))
	d.Remaining *= n
	d.Used = min(d.Used, math.MaxInt64/n) * n
	return d
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func usToDuration(us float64) time.Duration {
	if us >= float64(math.MaxInt64/int64(time.Microsecond)) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(math.Ceil(us)) * time.Microsecond
}

// mulDiv is a*b/c for non-negative a, b and positive c, computed in 128
// bits and capped at math.MaxInt64.
func mulDiv(a, b, c int64) int64 {
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi >= uint64(c) {
		return math.MaxInt64
	}
	q, _ := bits.Div64(hi, lo, uint64(c))
	return int64(min(q, math.MaxInt64))
}
