package ratelimit

import (
	"context"
	"crypto/sha512"
	"hash/maphash"
	"log/slog"
	"math"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// MemoryOptions bound a MemoryLimiter's memory.
type MemoryOptions struct {
	// MaxKeys is the most keys the limiter remembers at once. When it is
	// full, a new key evicts the least recently used one, which starts
	// afresh if it comes back. Defaults to 100_000.
	MaxKeys int

	// Shards is how many independently locked parts the keys are spread
	// over, to keep concurrent checks of different keys from waiting on one
	// another. Each shard holds at most MaxKeys/Shards keys. Capped at
	// MaxKeys. Defaults to 64.
	Shards int

	// Observer receives every decision, for metrics. Defaults to nil
	// (none).
	Observer Observer

	// Logger receives shadow denials (Config.Shadow). Defaults to
	// slog.Default().
	Logger *slog.Logger

	// Now pins the instant each check is decided at, for tests that replay
	// a sequence of instants. Defaults to nil: the limiter's monotonic
	// clock.
	Now func() time.Time
}

// Defaults for MemoryOptions.
const (
	// DefaultMemoryMaxKeys is MemoryOptions.MaxKeys when it is not set.
	DefaultMemoryMaxKeys = 100_000
	// DefaultMemoryShards is MemoryOptions.Shards when it is not set.
	DefaultMemoryShards = 64
)

// maxInlineKey is the longest key a MemoryLimiter or a deny cache stores as
// given. A longer key is stored as its SHA-512 digest followed by one marker
// byte: 65 bytes, a length no key stored as given can have, so the two forms
// never meet. This keeps the memory per key bounded whatever the keys are
// (a 1 MB key costs 65 bytes, not 1 MB).
const maxInlineKey = 64

// lookupKey returns the form of key that the maps are indexed by: key
// itself when it is short, else its digest form (a new string).
func lookupKey(key string) string {
	if len(key) <= maxInlineKey {
		return key
	}
	sum := sha512.Sum512([]byte(key))
	return string(append(sum[:], 0))
}

// ownedKey returns the string to store for key, whose lookup form is k: a
// copy of a short key, so that the map never pins a larger buffer the
// caller's key was sliced from, or k itself, already a string of its own.
func ownedKey(key, k string) string {
	if len(key) <= maxInlineKey {
		return strings.Clone(key)
	}
	return k
}

// MemoryLimiter is one limit kept in process memory: the same three
// algorithms, the same arithmetic, the same penalty semantics and the same
// shadow mode (Config.Shadow) as Limiter, without a database. Use it alone
// for high-volume, low-stakes limits that must never write to the database
// (an analytics beacon), or as the fallback of a limiter whose database is
// down. Each process counts on its own, so a limit of N per instance
// admits up to N times the instance count in all.
//
// Memory is bounded: at most MaxKeys keys are kept, the least recently
// checked key being evicted first (it starts afresh if it returns), and
// keys whose state has died (a window that has ended, a bucket that has
// refilled) are swept a few at a time during ordinary checks. No background
// goroutine is needed. Keys of up to 64 bytes are stored as given; longer
// ones as a 65-byte digest. See docs/MEMORY.md for the measured cost per key.
//
// Time comes from a monotonic clock: wall time read once when the limiter
// is created, advanced by the monotonic clock since, so a step of the
// system clock neither refills buckets nor rewinds windows. Windows are
// aligned on multiples of Window since the Unix epoch, as in PostgreSQL.
// MemoryOptions.Now replaces that clock for tests.
//
// A MemoryLimiter is safe for concurrent use.
type MemoryLimiter struct {
	shape    // decision arithmetic shared with the Postgres limiter
	capacity float64
	start    time.Time // wall and monotonic reading at creation
	startUs  int64     // start in microseconds since the Unix epoch
	keys     shardedLRU[memState]
	observer Observer
	logger   *slog.Logger
	now      func() time.Time // MemoryOptions.Now: nil for the monotonic clock
	// cooldown is the RetryAfter of a cost this fallback can never admit:
	// its limiter's breaker cool-down (fallbackAsk).
	cooldown time.Duration
	// shadowLogged is when a shadow denial was last logged (Config.Shadow).
	shadowLogged atomic.Int64
}

// memState is one key's counter. The fields mean, per algorithm:
// fixed window: at is the window's end, count the units counted in it;
// token bucket: at is the last update, tokens the balance then;
// sliding window: at is the current window's start, count and prev the
// units counted in it and in the one before.
type memState struct {
	at     int64 // microseconds since the Unix epoch
	count  int64
	prev   int64
	tokens float64
}

// NewMemory returns a limiter that keeps its counters in process memory. It
// validates cfg as Database.Limiter does; cfg.KeyMode is ignored (keys never leave the
// process).
func NewMemory(cfg Config, opts MemoryOptions) (*MemoryLimiter, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if opts.MaxKeys <= 0 {
		opts.MaxKeys = DefaultMemoryMaxKeys
	}
	if opts.Shards <= 0 {
		opts.Shards = DefaultMemoryShards
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	m := &MemoryLimiter{
		shape:    newShape(cfg),
		capacity: float64(cfg.Burst),
		start:    time.Now(),
		observer: opts.Observer,
		logger:   opts.Logger,
		now:      opts.Now,
		cooldown: DefaultBreakerCooldown,
	}
	m.startUs = m.start.UnixMicro()
	m.keys.init(opts.MaxKeys, opts.Shards)
	return m, nil
}

// Config returns the limiter's configuration, defaults filled in.
func (m *MemoryLimiter) Config() Config { return m.cfg }

// Len reports how many keys the limiter holds, including dead ones not yet
// swept. It never exceeds MaxKeys.
func (m *MemoryLimiter) Len() int { return m.keys.len() }

// Allow checks and counts units for key: one, or what Cost or UpTo asks
// for, as Limiter.Allow does. A MemoryLimiter counts at its own rate only:
// AtRate is ErrInvalidOption (make a MemoryLimiter per rate). Under Cost,
// all n are admitted or none (unless Penalty is set: then a denied check
// is counted too); UpTo is a partial grant, its n a ceiling. ctx is
// accepted for symmetry with Limiter and not consulted: a memory check
// never waits on I/O, and a fallback must answer even when the context of a
// failed database check has expired.
func (m *MemoryLimiter) Allow(_ context.Context, key string, opts ...Option) (Decision, error) {
	a, err := m.options(opts, true)
	if err != nil {
		return Decision{}, WithOutcome(err, OutcomeNotConsumed)
	}
	d, err := m.observe(key, a)
	return d, WithOutcome(err, OutcomeNotConsumed)
}

// options is what opts ask of m, which takes no AtRate.
func (m *MemoryLimiter) options(opts []Option, counts bool) (ask, error) {
	a, _, rated, err := options(m.cfg.Name, opts, counts)
	if err == nil && a.slice {
		err = invalid(ErrInvalidOption, "Slice for %q, a MemoryLimiter; a slice leases a PostgreSQL limit's quota (package lease): use UpTo", m.cfg.Name)
	}
	if err == nil && a.id != nil {
		err = invalid(ErrInvalidOption, "RequestID for %q, a MemoryLimiter; request ids are kept in PostgreSQL: use a Limiter", m.cfg.Name)
	}
	if err == nil && rated {
		err = invalid(ErrInvalidOption, "AtRate for %q, a MemoryLimiter, which counts at its own rate; make a MemoryLimiter per rate", m.cfg.Name)
	}
	return a, err
}

// observe runs allowAsk and reports it to the Observer.
func (m *MemoryLimiter) observe(key string, a ask) (Decision, error) {
	if m.observer == nil {
		return m.allowAsk(key, a)
	}
	start := time.Now()
	d, err := m.allowAsk(key, a)
	m.observer.ObserveDecision(m.cfg.Name, d, time.Since(start), err)
	return d, err
}

func (m *MemoryLimiter) allowAsk(key string, a ask) (Decision, error) {
	if err := m.cfg.checkAsk(a); err != nil {
		return Decision{}, err
	}
	now := m.nowUs()
	k := lookupKey(key)
	sh := m.keys.shard(k)
	sh.mu.Lock()
	m.sweep(sh, now)
	node := sh.get(k)
	if node == nil {
		node = sh.insert(ownedKey(key, k))
		node.val = m.alg.fresh(m, now)
	} else {
		sh.touch(node)
	}
	// The step caps a partial grant's ask at the capacity (see
	// Config.ceiling) and charges it whole under Penalty.
	st, allowed, granted := m.alg.takeMemory(m, node.val, now, a.n, a.upTo)
	node.val = st
	sh.mu.Unlock()
	if !a.upTo {
		return a.settle(shadowed(&m.cfg, m.logger, &m.shadowLogged, m.decide(allowed, st, now, a.n))), nil
	}
	return shadowed(&m.cfg, m.logger, &m.shadowLogged, m.decide(allowed, st, now, 1).granting(granted)), nil
}

// fallbackAsk is allowAsk for the limiter m answers for under
// FailToMemory, which has checked a against its own capacity: that can
// exceed m's (FallbackLimit below Limit, as Config.FallbackLimit
// recommends). A cost m can never admit is then a denial that counts
// nothing, to be retried after the breaker's cooldown (when the database
// may answer again), not an error: the request is valid.
func (m *MemoryLimiter) fallbackAsk(key string, a ask) (Decision, error) {
	if a.upTo || a.n <= m.cfg.capacity() {
		return m.allowAsk(key, a)
	}
	d := m.peek(key)
	d.Allowed = false
	d.RetryAfter = m.cooldown
	return d, nil
}

// Peek reports the key's state, as a check costing one unit would see it,
// without counting anything. It does not make the key more recently used.
// It takes no options but for symmetry with Limiter: any is
// ErrInvalidOption.
func (m *MemoryLimiter) Peek(_ context.Context, key string, opts ...Option) (Decision, error) {
	if _, err := m.options(opts, false); err != nil {
		return Decision{}, err
	}
	return m.peek(key), nil
}

// peek is Peek.
func (m *MemoryLimiter) peek(key string) Decision {
	now := m.nowUs()
	k := lookupKey(key)
	sh := m.keys.shard(k)
	sh.mu.Lock()
	m.sweep(sh, now)
	var st memState
	if node := sh.get(k); node != nil {
		st = node.val
	} else {
		st = m.alg.fresh(m, now)
	}
	sh.mu.Unlock()
	st = m.alg.roll(m, st, now)
	return m.peekDecision(st, now)
}

// Reset forgets everything counted for key. It fails only when given an
// option (ErrInvalidOption); the options are there for symmetry with
// Limiter.
func (m *MemoryLimiter) Reset(_ context.Context, key string, opts ...Option) error {
	if _, err := m.options(opts, false); err != nil {
		return err
	}
	m.keys.remove(lookupKey(key))
	return nil
}

// give gives back one slot of key that a concurrency limit's Acquire took
// from m (the fallback under FailToMemory); a key m no longer holds (reset,
// or evicted past MaxKeys) gives back nothing.
func (m *MemoryLimiter) give(key string) {
	now := m.nowUs()
	k := lookupKey(key)
	sh := m.keys.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if node := sh.get(k); node != nil {
		node.val, _, _ = m.alg.takeMemory(m, node.val, now, -1, false)
	}
}

// nowUs is the current instant in microseconds since the Unix epoch.
func (m *MemoryLimiter) nowUs() int64 {
	if m.now != nil {
		return m.now().UnixMicro()
	}
	return m.startUs + time.Since(m.start).Microseconds()
}

// windowEnd is the end of the aligned window holding now, as in SQL.
func (m *MemoryLimiter) windowEnd(now int64) int64 { return m.windowStart(now) + m.windowUs }

// windowStart is the start of the aligned window holding now, as in SQL
// (see windowStartUs).
func (m *MemoryLimiter) windowStart(now int64) int64 { return windowStartUs(now, m.windowUs) }

// sweepPerCall is how many dead keys a call may drop from the least
// recently used end of its shard.
const sweepPerCall = 2

// sweep drops up to sweepPerCall dead keys from the cold end of sh, stopping
// at the first live one. For the window algorithms a key's death time only
// grows with its last check, so the keys behind a live one are live too;
// for the token bucket the order is nearly so, and LRU eviction bounds what
// is left.
func (m *MemoryLimiter) sweep(sh *lruShard[memState], now int64) {
	for range sweepPerCall {
		node := sh.tail
		if node == nil || !m.alg.dead(m, node.val, now) {
			return
		}
		sh.remove(node)
	}
}

// satAdd adds two non-negative counts, saturating at math.MaxInt64.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// usTime converts microseconds since the Unix epoch to a time.
func usTime(us int64) time.Time { return time.UnixMicro(us) }

// decide builds the decision of a check from the state after it.
func (m *MemoryLimiter) decide(allowed bool, st memState, now, cost int64) Decision {
	d := m.alg.decideMemory(m, allowed, st, now, cost)
	d.Store = StoreMemory
	return d
}

// peekDecision builds a peek's decision from the state rolled to now, as
// Limiter.Peek does.
func (m *MemoryLimiter) peekDecision(st memState, now int64) Decision {
	d := m.alg.peekMemory(m, st, now)
	d.Store = StoreMemory
	return d
}

// lruNode is one key in an lruShard, linked into the shard's recency list.
// The links are in the node itself, so a key costs one allocation.
type lruNode[V any] struct {
	key        string
	prev, next *lruNode[V] // towards the head (most recent) and the tail
	val        V
}

// lruShard is a map with a recency list and a cap on its size. Its methods
// require mu to be held.
type lruShard[V any] struct {
	mu         sync.Mutex
	m          map[string]*lruNode[V]
	head, tail *lruNode[V]
	max        int
	_          [64]byte // keeps neighbouring shards' locks off one cache line
}

func (s *lruShard[V]) get(key string) *lruNode[V] { return s.m[key] }

// insert adds key (which must be absent, and owned: see ownedKey) at the
// head with a zero value, evicting the least recently used key when the
// shard is full.
func (s *lruShard[V]) insert(key string) *lruNode[V] {
	var node *lruNode[V]
	if len(s.m) >= s.max && s.tail != nil {
		// Reuse the evicted node: a full shard allocates nothing per key.
		node = s.tail
		s.remove(node)
		*node = lruNode[V]{}
	} else {
		node = new(lruNode[V])
	}
	node.key = key
	if s.m == nil {
		s.m = make(map[string]*lruNode[V])
	}
	s.m[node.key] = node
	s.pushFront(node)
	return node
}

// touch makes node the most recently used.
func (s *lruShard[V]) touch(node *lruNode[V]) {
	if s.head == node {
		return
	}
	s.unlink(node)
	s.pushFront(node)
}

// remove deletes node from the shard.
func (s *lruShard[V]) remove(node *lruNode[V]) {
	s.unlink(node)
	delete(s.m, node.key)
}

func (s *lruShard[V]) pushFront(node *lruNode[V]) {
	node.prev, node.next = nil, s.head
	if s.head != nil {
		s.head.prev = node
	}
	s.head = node
	if s.tail == nil {
		s.tail = node
	}
}

func (s *lruShard[V]) unlink(node *lruNode[V]) {
	if node.prev != nil {
		node.prev.next = node.next
	} else {
		s.head = node.next
	}
	if node.next != nil {
		node.next.prev = node.prev
	} else {
		s.tail = node.prev
	}
	node.prev, node.next = nil, nil
}

// shardedLRU spreads keys over shards by a seeded hash; each shard is an
// lruShard with its own lock and its share of the cap.
type shardedLRU[V any] struct {
	seed   maphash.Seed
	shards []lruShard[V]
}

// init sizes the shards so that together they never hold more than maxKeys.
func (l *shardedLRU[V]) init(maxKeys, shards int) {
	shards = max(min(shards, maxKeys), 1)
	l.seed = maphash.MakeSeed()
	l.shards = make([]lruShard[V], shards)
	for i := range l.shards {
		l.shards[i].max = max(maxKeys/shards, 1)
	}
}

// shard returns the shard that holds key (in its stored form).
func (l *shardedLRU[V]) shard(key string) *lruShard[V] {
	hi, _ := bits.Mul64(maphash.String(l.seed, key), uint64(len(l.shards)))
	return &l.shards[hi]
}

// remove drops key (in its stored form), if held.
func (l *shardedLRU[V]) remove(key string) {
	sh := l.shard(key)
	sh.mu.Lock()
	if node := sh.get(key); node != nil {
		sh.remove(node)
	}
	sh.mu.Unlock()
}

// len counts the keys held.
func (l *shardedLRU[V]) len() int {
	n := 0
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}
