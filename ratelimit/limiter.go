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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// DB runs a limiter's statements: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB = gen.DBTX

// Limiter is one limit kept in PostgreSQL. Every check is one SQL statement
// in one round trip; the row lock on the key's counter is the only lock. A
// Limiter is safe for concurrent use.
type Limiter struct {
	shape
	db           DB
	q            *gen.Queries
	breaker      *breaker
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
	// citus is whether db is a Citus coordinator (citusUnknown until an
	// AllOrNothing decision asks; multi.go).
	citus atomic.Int32
}

// New returns a limiter that keeps its counters in db, which must have
// pgrl's tables (run `rl-migrate up`, or migration.Up at start-up). New
// validates cfg and does not touch the database.
func New(db DB, cfg Config) (*Limiter, error) {
	if cfg.KeyMode == ReadableKeys && len(cfg.Name) > MaxReadableNameBytes {
		return nil, invalid(ErrInvalidName, "%d bytes with readable keys; use a name of at most %d bytes, or HashedKeys (the default)", len(cfg.Name), MaxReadableNameBytes)
	}
	return newLimiter(db, cfg)
}

// newLimiter is New without the name's length check, which a spread
// limit's rows (named "name#i") would fail.
func newLimiter(db DB, cfg Config) (*Limiter, error) {
	if isNil(db) {
		return nil, ErrNilDB
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if pool, ok := db.(*pgxpool.Pool); ok {
		// Checks hold at most their share of the pool (PoolShareDivisor).
		db = sharedPoolFor(pool)
	}
	l := &Limiter{shape: newShape(cfg), db: db, q: gen.New()}
	l.breaker = newBreaker(cfg)
	fb := cfg
	fb.Limit = cfg.FallbackLimit
	fb.Observer = nil // the limiter observes its own decisions, fallbacks included
	fb.Shadow = false // and applies shadow mode to them
	fb = l.alg.fallbackConfig(cfg, fb)
	if l.memory, err = NewMemory(fb, MemoryOptions{}); err != nil {
		return nil, err
	}
	if cfg.DenyCacheSize > 0 && cfg.Spread <= 1 {
		// A spread limit's rows keep their own: a denial by one row says
		// nothing of the others.
		l.deny = newDenyCache(cfg.DenyCacheSize)
	}
	if err := l.initShare(); err != nil {
		return nil, err
	}
	if !cfg.DisableCoalescing {
		// A *pgx.Conn or a pgx.Tx serves one statement at a time; anything
		// else (a pool, or a wrapper around one that traces or counts
		// statements) can run several round trips at once. A spread
		// limit's rows coalesce on their own.
		// A check that reads a stored policy goes out alone: the queue
		// statements take their figures from the caller.
		if !singleConn(db) && cfg.Spread <= 1 && cfg.Policy == "" {
			l.coalescer = sharedCoalescer(db, cfg.MaxBatch, cfg.MaxInFlight)
		}
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
			shard, err := newLimiter(db, sc)
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
func (l *Limiter) BreakerOpen() bool { return l.breaker.open.Load() }

// Config returns the limiter's configuration, defaults filled in.
func (l *Limiter) Config() Config { return l.cfg }

// Allow checks and counts one unit for key.
func (l *Limiter) Allow(ctx context.Context, key string) (Decision, error) {
	return l.AllowN(ctx, key, 1)
}

// AllowN checks and counts n units (a cost, such as bytes or tokens) for key.
// Either all n are admitted or none.
//
// When the database fails or takes longer than Config.Timeout, the failure
// policy answers (Decision.Store and Reason say so) and the error is nil,
// unless the policy is FailError. Errors that mean the setup is wrong
// (ErrNotMigrated, ErrReadOnly) and bad arguments are always returned, as is
// the caller's own context ending.
func (l *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	return l.observe(ctx, key, ask{n: n})
}

// AllowUpTo is a partial grant: it takes as many of n units as key has
// left, possibly none, and reports how many in Decision.Granted (Allowed
// when at least one). Use it to hand out what is left of a quota: the bytes
// an upload may still send, the rows a batch job may still process.
//
// n is a ceiling, not a cost: any n of at least 1 is valid (0 or less is
// ErrInvalidCost), and an n above what the limit holds at once (Limit, or
// Burst for the token bucket; a row's share with Spread) is an ask of that
// capacity in every respect, so AllowUpTo(ctx, key, math.MaxInt64) takes
// all that is left. Under Penalty the ask is counted whatever is granted,
// as for any denied check: n, or the capacity when n is above it (as an
// AllowN of the whole capacity would be), so one huge ask cannot push a
// count further than the largest valid AllowN. Concurrent AllowUpTo and
// AllowN checks of one key are decided one after another, as AllowN checks
// are. The failure policy answers as for AllowN: the memory tier grants
// from its own count (its capacity is FallbackLimit's), FailOpen grants the
// whole ask (at most the capacity), FailClosed none. A shadow-mode denial
// proceeds with Granted 0.
func (l *Limiter) AllowUpTo(ctx context.Context, key string, n int64) (Decision, error) {
	return l.observe(ctx, key, ask{n: n, upTo: true})
}

// observe runs allowN and reports it to the Observer.
func (l *Limiter) observe(ctx context.Context, key string, a ask) (Decision, error) {
	a = l.cfg.ceiling(a)
	if l.cfg.Observer == nil {
		d, err := l.allowN(ctx, key, a)
		return a.settle(d), err
	}
	start := time.Now()
	d, err := l.allowN(ctx, key, a)
	d = a.settle(d)
	l.cfg.Observer.ObserveDecision(l.cfg.Name, d, time.Since(start), err)
	return d, err
}

func (l *Limiter) allowN(ctx context.Context, key string, a ask) (Decision, error) {
	if err := l.cfg.checkAsk(a); err != nil {
		return Decision{}, err
	}
	if err := l.cfg.checkKey(key); err != nil {
		return Decision{}, err
	}
	// The row that decides: the limiter's own, or with Spread one of its
	// rows, whose deny cache answers for that row only.
	row := l
	if l.shards != nil {
		row = l.pickShard(a.retryCost())
	}
	sent := l.localNow()
	if row.deny != nil {
		if d, ok := row.deny.get(key, a.retryCost(), sent); ok {
			return l.shadow(key, l.asWhole(row, d)), nil
		}
		if d, ok := row.sharedDenied(key, a.retryCost(), sent); ok {
			return l.shadow(key, l.asWhole(row, d)), nil
		}
	}
	probe, ok := l.breaker.allow(sent)
	if !ok {
		return l.fallback(ctx, key, a, errBreakerOpen)
	}
	d, err := row.allowWithin(ctx, key, a)
	if err != nil {
		if callerDone(ctx) {
			return Decision{}, fmt.Errorf("ratelimit: %w", callerErr(ctx))
		}
		err = l.explain(ctx, err)
		if IsConfigError(err) {
			l.breaker.success(probe) // the database answered
			return Decision{}, err
		}
		l.breaker.failure(time.Now(), err, l.cfg.OnFailure, probe)
		return l.fallback(ctx, key, a, err)
	}
	l.breaker.success(probe)
	if row.deny != nil && !d.Allowed {
		row.deny.put(key, a.retryCost(), d, sent)
		row.shareDenial(key, a.retryCost(), d, sent)
	}
	d = l.asWhole(row, d)
	if l.cfg.Cleanup != nil {
		if p, ok := l.db.(*pooled); ok {
			l.cfg.Cleanup.Maybe(ctx, p.pool)
		}
	}
	return l.shadow(key, d), nil
}

// allowWithin asks PostgreSQL, answering by Config.Timeout at the latest,
// whatever the caller's context. The statement runs on the caller's
// goroutine under a context that ends at the Timeout: pgx stops at a
// context's deadline (it sets the connection's deadline, and waiting for a
// pooled connection or for a coalesced batch ends with the context too), so
// handing each check to a goroutine of its own, which cost 30 to 45 µs per
// check at one caller (docs/BENCHMARKS.md), buys nothing;
// TestStallDefaultConfigBounded holds it to the bound against a server that
// stops answering.
func (l *Limiter) allowWithin(ctx context.Context, key string, a ask) (Decision, error) {
	cctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	d, err := l.allowDB(cctx, key, a)
	if err != nil && cctx.Err() != nil {
		// The statement may still reach the database and count.
		return Decision{}, cctx.Err()
	}
	return d, err
}

// asWhole reports a decision of row (l itself, or one of its spread rows)
// in terms of the whole limit.
func (l *Limiter) asWhole(row *Limiter, d Decision) Decision {
	if row == l {
		return d
	}
	return l.spreadDecision(d)
}

// allowDB asks PostgreSQL, and with Config.CreatePartitions creates a
// missing partition and asks once more. A spread
// limit's caller passes the row that decides (see allowN).
func (l *Limiter) allowDB(ctx context.Context, key string, a ask) (Decision, error) {
	take := func() (Decision, error) {
		if l.coalescer != nil {
			return l.coalescer.take(ctx, l, key, a)
		}
		return l.take(ctx, l.db, key, a)
	}
	d, err := take()
	if err != nil && l.cfg.CreatePartitions && l.alg.partitioned() && isMissingPartition(err) {
		// Partitioned layout and nobody created this window's partition
		// yet (cleanup creates them ahead; it may not have run). Create it
		// and check again.
		if herr := l.heal(ctx, l.db); herr != nil {
			return Decision{}, herr
		}
		d, err = take()
	}
	return d, err
}

// AllowTx is Allow inside the caller's transaction: AllowNTx with a cost
// of one.
func (l *Limiter) AllowTx(ctx context.Context, tx pgx.Tx, key string) (Decision, error) {
	return l.AllowNTx(ctx, tx, key, 1)
}

// AllowNTx is AllowN inside the caller's transaction: rolling the
// transaction back refunds the units. The key's counter row stays locked
// until the transaction ends, so other checks of the same key wait for it:
// keep such transactions short. Config.Observer sees the decision, whether
// the transaction commits or not.
func (l *Limiter) AllowNTx(ctx context.Context, tx pgx.Tx, key string, n int64) (Decision, error) {
	return l.observeTx(ctx, tx, key, ask{n: n})
}

// AllowUpToTx is AllowUpTo inside the caller's transaction, under the rules
// of AllowNTx.
func (l *Limiter) AllowUpToTx(ctx context.Context, tx pgx.Tx, key string, n int64) (Decision, error) {
	return l.observeTx(ctx, tx, key, ask{n: n, upTo: true})
}

// observeTx runs allowNTx and reports it to the Observer.
func (l *Limiter) observeTx(ctx context.Context, tx pgx.Tx, key string, a ask) (Decision, error) {
	a = l.cfg.ceiling(a)
	if l.cfg.Observer == nil {
		d, err := l.allowNTx(ctx, tx, key, a)
		return a.settle(d), err
	}
	start := time.Now()
	d, err := l.allowNTx(ctx, tx, key, a)
	d = a.settle(d)
	l.cfg.Observer.ObserveDecision(l.cfg.Name, d, time.Since(start), err)
	return d, err
}

func (l *Limiter) allowNTx(ctx context.Context, tx pgx.Tx, key string, a ask) (Decision, error) {
	if tx == nil {
		return Decision{}, ErrNilDB
	}
	if err := l.cfg.checkAsk(a); err != nil {
		return Decision{}, err
	}
	if err := l.cfg.checkKey(key); err != nil {
		return Decision{}, err
	}
	d, err := l.take(ctx, tx, key, a)
	if err != nil && l.cfg.CreatePartitions && l.alg.partitioned() && isMissingPartition(err) {
		// The failed statement has aborted the caller's transaction; create
		// the partition outside it so that a retry succeeds.
		if herr := l.heal(ctx, l.db); herr != nil {
			return Decision{}, mapErr(herr)
		}
		return Decision{}, fmt.Errorf("%w: %w", ErrPartitionMissing, err)
	}
	if err != nil {
		return Decision{}, l.explain(ctx, err)
	}
	return l.shadow(key, d), nil
}

// Peek reports the key's state, as a check costing one unit would see it,
// without counting anything.
func (l *Limiter) Peek(ctx context.Context, key string) (Decision, error) {
	if err := l.cfg.checkKey(key); err != nil {
		return Decision{}, err
	}
	cctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	d, err := l.peek(cctx, l.db, key)
	return d, l.explain(ctx, err)
}

// PeekTx is Peek inside the caller's transaction.
func (l *Limiter) PeekTx(ctx context.Context, tx pgx.Tx, key string) (Decision, error) {
	if tx == nil {
		return Decision{}, ErrNilDB
	}
	if err := l.cfg.checkKey(key); err != nil {
		return Decision{}, err
	}
	d, err := l.peek(ctx, tx, key)
	return d, l.explain(ctx, err)
}

// Reset forgets everything counted for key under this limiter (in
// PostgreSQL, in this process's memory fallback and in its deny cache).
//
// Reset returns no Decision: afterwards the key is in the state of a key
// never seen (Used 0, Remaining Limit, or Burst for the token bucket,
// Allowed true), known without asking the database, and a Decision built
// by Reset would lack what only a check knows (ResetAt on the database's
// clock). Peek reports it in full if you need it. Keeping the signature
// also keeps existing callers compiling.
func (l *Limiter) Reset(ctx context.Context, key string) error {
	if err := l.cfg.checkKey(key); err != nil {
		return err
	}
	l.forgetLocal(ctx, key)
	cctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	return l.explain(ctx, l.reset(cctx, l.db, key))
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

// ResetTx is Reset inside the caller's transaction.
func (l *Limiter) ResetTx(ctx context.Context, tx pgx.Tx, key string) error {
	if tx == nil {
		return ErrNilDB
	}
	if err := l.cfg.checkKey(key); err != nil {
		return err
	}
	l.forgetLocal(ctx, key)
	return l.explain(ctx, l.reset(ctx, tx, key))
}

// localNow is the process's clock (with its monotonic reading), or the
// pinned clock in tests.
func (l *Limiter) localNow() time.Time {
	if l.cfg.Now != nil {
		return l.cfg.Now()
	}
	return time.Now()
}

func (l *Limiter) at() *time.Time {
	if l.cfg.Now == nil {
		return nil
	}
	t := l.cfg.Now()
	return &t
}

// atUs is at in microseconds since the Unix epoch, NULL for the database's
// clock: for the internal statements, which take instants as integers (a
// timestamptz in text would be read by the session's DateStyle).
func (l *Limiter) atUs() pgtype.Int8 {
	if l.cfg.Now == nil {
		return pgtype.Int8{}
	}
	return pgtype.Int8{Int64: l.cfg.Now().UnixMicro(), Valid: true}
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

func (l *Limiter) take(ctx context.Context, db DB, key string, a ask) (Decision, error) {
	if l.shards != nil {
		d, err := l.pickShard(a.retryCost()).take(ctx, db, key, a)
		return l.spreadDecision(d), err
	}
	if l.cfg.Policy != "" && !a.upTo {
		k := l.key(key)
		return l.alg.takePolicy(ctx, l, db, k, l.policyKey(key, k), a.n)
	}
	return l.takeKey(ctx, db, l.key(key), a)
}

// policyKey is key as pgrl_policy_override stores it: under the policy's
// name, which is k (the counter's stored key) when the counters are stored
// under that name too.
func (l *Limiter) policyKey(key string, k []byte) []byte {
	if l.cfg.Policy == l.counterName() {
		return k
	}
	return StoredKey(l.cfg.KeyMode, l.cfg.Policy, key)
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

// takeKey is take for a key already in its stored form.
func (l *Limiter) takeKey(ctx context.Context, db DB, k []byte, a ask) (Decision, error) {
	if a.upTo {
		// l may be one row of a spread limit, whose capacity is its share.
		return l.alg.takeUpTo(ctx, l, db, k, l.cfg.ceiling(a).n)
	}
	return l.alg.take(ctx, l, db, k, a.n)
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

func (l *Limiter) heal(ctx context.Context, db DB) error {
	_, err := sqlops.New().FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{
		AtUs: l.atUs(), WindowUs: l.windowUs,
	})
	return err
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

// isMissingPartition reports a row that no partition accepts.
func isMissingPartition(err error) bool {
	kind, _ := pgerr.Classify(err)
	return kind == pgerr.NoPartition
}

// mapErr turns the database errors a user can cause into typed errors that
// name the fix, by pgerr's classification, which every pgrl package
// shares. The *pgconn.PgError stays in the chain for errors.As, the typed
// error for errors.Is. An error already mapped is returned as is.
func mapErr(err error) error {
	if err == nil || IsConfigError(err) {
		return err
	}
	kind, pgErr := pgerr.Classify(err)
	switch kind {
	case pgerr.NoPartition:
		return fmt.Errorf("%w: %w", ErrNoPartition, pgErr)
	case pgerr.Undefined:
		return fmt.Errorf("%w: %w", ErrNotMigrated, pgErr)
	case pgerr.ReadOnly:
		return fmt.Errorf("%w: %w", ErrReadOnly, pgErr)
	case pgerr.Permission:
		return fmt.Errorf("ratelimit: %w", pgerr.Denied(pgErr, missingGrant(nil)))
	case pgerr.Input:
		return fmt.Errorf("%w (a bad request, not an outage: no failure policy answers it): %w", ErrInvalidInput, pgErr)
	case pgerr.Unsupported:
		if pgErr.Severity == "FATAL" {
			// Refused while connecting: a setting the connection string
			// passes (options=-c name=value, a runtime parameter) is wrong.
			return fmt.Errorf("%w (a setup error, not an outage: the server refused the connection's settings; fix the "+
				"connection string's options or runtime parameters): %w", ErrUnsupported, pgErr)
		}
		return fmt.Errorf("%w (a setup error, not an outage: no failure policy answers it; run `rl-migrate up` with this "+
			"version of pgrl, use PostgreSQL 13 to 18, and on Citus see docs/SCALING.md): %w", ErrUnsupported, pgErr)
	}
	return fmt.Errorf("ratelimit: %w", err)
}

// missingGrant is what a check of l needs on pgrl's tables: all the
// counter tables when l is nil.
func missingGrant(l *Limiter) pgerr.Need {
	tables := []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"}
	if l != nil {
		tables = []string{l.alg.table()}
	}
	return pgerr.Need{Tables: tables, Privileges: []string{"SELECT", "INSERT", "UPDATE", "DELETE"}}
}

// explain is mapErr, and asks the limiter's database (one more query, only
// on these error paths) which grant is missing: a schema without USAGE
// hides pgrl's tables, so a missing table may be a missing grant, and a
// 42501 names an object, not the grant. Truly missing tables are reported
// with where the connection looked.
func (l *Limiter) explain(ctx context.Context, err error) error {
	err = mapErr(err)
	if errors.Is(err, ErrUnsupported) {
		l.logUnsupported(err)
		return err
	}
	if errors.Is(err, ErrReadOnly) {
		return l.explainReadOnly(ctx, err)
	}
	if !errors.Is(err, ErrNotMigrated) && !errors.Is(err, ErrPermission) {
		return err
	}
	kind, pgErr := pgerr.Classify(err)
	if kind != pgerr.Undefined && kind != pgerr.Permission {
		return err // explained already
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	if pe := pgerr.Diagnose(ctx, l.db, missingGrant(l), pgErr); pe != nil {
		return fmt.Errorf("ratelimit: %w", pe)
	}
	if kind == pgerr.Permission {
		return err
	}
	// The tables are missing. Say where the connection looked, when it
	// can tell.
	var where *notmigrated.Error
	if errors.As(notmigrated.At(ctx, l.db), &where) {
		return fmt.Errorf("ratelimit: %w: %w", where, pgErr)
	}
	return err
}

// logUnsupported logs err, an ErrUnsupported, at error level the first time
// the limiter meets one: every check fails alike until the schema or the
// server is fixed, and the caller gets each error.
func (l *Limiter) logUnsupported(err error) {
	if l.unsupportedLogged.CompareAndSwap(false, true) {
		l.cfg.Logger.Error("pgrl: the check's SQL does not fit this server; checks fail with ErrUnsupported, "+
			"and no failure policy answers them, until it does (logged once per limiter)",
			"limiter", l.cfg.Name, "error", err.Error())
	}
}

// explainReadOnly says why the database refused a write: a standby, or a
// read-only session on a primary.
func (l *Limiter) explainReadOnly(ctx context.Context, err error) error {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	var standby bool
	if qerr := l.db.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&standby); qerr != nil {
		return fmt.Errorf("%w: it is a read-only standby (point the limiter at the primary), or the session is read-only (set default_transaction_read_only to off for the limiter's role or connections): %w", ErrReadOnly, unwrapMapped(err))
	}
	if standby {
		return fmt.Errorf("%w: it is a read-only standby; point the limiter at the primary: %w", ErrReadOnly, unwrapMapped(err))
	}
	return fmt.Errorf("%w: the session is read-only on a primary (default_transaction_read_only is on for the limiter's role, database or connection); turn it off for the limiter's connections, e.g. ALTER ROLE <role> SET default_transaction_read_only = off, or RuntimeParams in the pool's config: %w", ErrReadOnly, unwrapMapped(err))
}

// unwrapMapped returns the *pgconn.PgError inside an error mapErr made, or
// the error itself.
func unwrapMapped(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr
	}
	return err
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
