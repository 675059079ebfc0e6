package lease

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/ratelimit"
)

// Defaults of Options' optional fields.
const (
	// DefaultShare is Options.Share when it is 0.
	DefaultShare = 8
	// DefaultIdle is Options.Idle when it is 0.
	DefaultIdle = time.Second
	// MinIdle is the shortest Options.Idle.
	MinIdle = time.Millisecond
)

// Errors returned for a bad setup or a bad call. Test with errors.Is; the
// error's text adds the offending value and the fix.
var (
	// ErrNilLimiter: New was given no *ratelimit.Limiter.
	ErrNilLimiter = errors.New("pgrl lease: nil limiter; pass the *ratelimit.Limiter whose quota is leased")
	// ErrInvalidSize: Options.Size is below 1 or above the limit.
	ErrInvalidSize = errors.New("pgrl lease: invalid slice size")
	// ErrInvalidShare: Options.Share is negative.
	ErrInvalidShare = errors.New("pgrl lease: invalid share")
	// ErrInvalidDB: Options.DB is a nil pointer (a nil *pgxpool.Pool, say).
	ErrInvalidDB = errors.New("pgrl lease: invalid database")
	// ErrInvalidIdle: Options.Idle is negative or below MinIdle.
	ErrInvalidIdle = errors.New("pgrl lease: invalid idle time")
	// ErrUnsupported: the limiter's configuration cannot be leased: a
	// token bucket with Penalty, Spread above 1, or a stored Policy read in
	// each statement. The text says why and what to use instead.
	ErrUnsupported = errors.New("pgrl lease: limit not supported by leases")
	// ErrClosed: a check made after Close.
	ErrClosed = errors.New("pgrl lease: limiter closed; make a new one with lease.New, or check with the *ratelimit.Limiter directly")
)

// Options configure a lease limiter.
type Options struct {
	// Size is the largest slice, in units, that one statement takes for a
	// key. Required: from 1 to the limiter's Limit (a slice never exceeds
	// the limit). A larger Size saves more statements and can leave more
	// units unused in a process while another is denied (docs/LEASES.md).
	Size int64
	// Share is the fair-share divisor: the statement that grants a slice
	// grants ceil(left/Share) of what the key has left (ratelimit.Slice),
	// at least what the check needs and at most Size, so slices shrink as
	// the key nears its limit and the last units go one by one. Set it near
	// the number of processes that check a key. Defaults to DefaultShare
	// (8). Negative is refused.
	Share int
	// Idle is how long a key's slice may go without a check before its
	// unused units are returned. Defaults to DefaultIdle (1s); at least
	// MinIdle.
	Idle time.Duration
	// DB is the database unused units are returned on: the one the
	// limiter's ratelimit.Database was made on (a *pgxpool.Pool). Nil:
	// units are never returned; they expire with their window.
	DB ratelimit.DB
	// Eager takes a slice at a key's first check. By default a key's
	// first check, and its first after it went idle, is sent as the
	// check itself (coalesced with other checks, as without a lease), and
	// slices start with its next check within Idle: keys checked once, of
	// a large key space, then cost no more than without a lease, and hold
	// no units.
	Eager bool
	// Now is the local clock a slice's expiry and idle time are measured
	// on, for tests (with ratelimit.DatabaseOptions.Now pinned to the same
	// clock). Defaults to time.Now, whose monotonic reading is what makes
	// an expiry independent of the database's and this machine's wall
	// clocks.
	Now func() time.Time
}

// Stats counts what a lease limiter did since New.
type Stats struct {
	// Slices is how many statements took a slice of at least one unit.
	Slices int64
	// Leased is the units those slices took.
	Leased int64
	// UsedLocally is the leased units given to checks.
	UsedLocally int64
	// Returned is the leased units given back to the database (idle,
	// Close).
	Returned int64
	// Dropped is the leased units given to no check and not returned:
	// their window ended, the key was Reset, there was no Options.DB, or
	// under Penalty they paid for a denied check.
	Dropped int64
	// LocalDecisions is how many checks a slice answered, with no
	// statement.
	LocalDecisions int64
	// DatabaseDecisions is how many checks PostgreSQL answered (a slice's
	// ask, or the caller's own check while the breaker is open).
	DatabaseDecisions int64
	// OtherDecisions is how many checks the limiter answered without
	// PostgreSQL: its deny cache (no statement), or its failure policy.
	OtherDecisions int64
}

// Limiter answers checks of a *ratelimit.Limiter's keys, or a stored
// policy's, from slices of their quota counted in PostgreSQL ahead of use.
// It is safe for concurrent use. Make one with New or NewPolicy and Close
// it.
type Limiter struct {
	c    ratelimit.Checker // what Peek, Reset and Config answer from
	id   uint64            // AllowAll holds several limiters' entries in the order of id
	name string
	// source returns the limiter that decides key's checks now: always
	// the same for New; for NewPolicy, the policy's as its Cache holds it,
	// which a change of the policy or of the key's override replaces.
	source func(key string) (*source, error)
	opts   Options
	now    func() time.Time
	seed   maphash.Seed
	shards [shardCount]shard

	closed    atomic.Bool
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once

	slices, leased, usedLocally, returned, dropped, local, remote, other atomic.Int64

	// afterSweep, when set (tests), is called after each sweep of the
	// background goroutine.
	afterSweep atomic.Pointer[func()]
}

var _ ratelimit.Checker = (*Limiter)(nil)

const shardCount = 64

type shard struct {
	mu sync.Mutex
	m  map[string]*entry
}

// source is a limiter slices are taken from, with what the lease derives
// from its configuration.
type source struct {
	l        *ratelimit.Limiter
	cfg      ratelimit.Config
	windowUs int64
	stored   string // the name the counter rows are stored under
	bucket   bool   // a token bucket
	capacity int64  // the most one check can take: Limit, or a bucket's Burst
}

// expiry is the local instant a slice taken with the local instant start
// before its statement, and answered by d, may be used until. The
// statement ran after start, so the slice never outlives, on any clock,
// what PostgreSQL counted its units for: the window they were counted in,
// or a token bucket's ratelimit.TokenBucketLeaseTime.
func (src *source) expiry(start time.Time, d ratelimit.Decision) time.Time {
	if src.bucket {
		return start.Add(ratelimit.TokenBucketLeaseTime)
	}
	end := windowEnd(d.Now, src.windowUs)
	if src.cfg.Algorithm == ratelimit.FixedWindow && d.ResetAt.Before(end) {
		end = d.ResetAt
	}
	return start.Add(end.Sub(d.Now))
}

// newSource checks that l can be leased and derives what the lease needs.
func newSource(l *ratelimit.Limiter) (*source, error) {
	cfg := l.Config()
	switch {
	case cfg.Algorithm == ratelimit.TokenBucket && cfg.Penalty:
		return nil, fmt.Errorf("%w: %q is a token bucket with Penalty: while units are out on lease the bucket's debt is bounded by the capacity less those units, so denied attempts would be charged less than without a lease. Check it directly, or lease it without Penalty", ErrUnsupported, cfg.Name)
	case cfg.Spread > 1:
		return nil, fmt.Errorf("%w: %q has Spread %d; a slice is taken from one row. Use Spread 1 with a lease: a lease already takes most checks off the row", ErrUnsupported, cfg.Name, cfg.Spread)
	case cfg.Policy != "":
		return nil, fmt.Errorf("%w: %q reads stored policy %q in each statement, but a slice counts at the figures it was taken at. Lease the policy with NewPolicy and policy.Options.FromCache", ErrUnsupported, cfg.Name, cfg.Policy)
	}
	stored := cfg.Name
	if cfg.KeyByWindow {
		stored = ratelimit.RateName(cfg.Name, cfg.Window)
	}
	src := &source{l: l, cfg: cfg, windowUs: cfg.Window.Microseconds(), stored: stored, capacity: cfg.Limit}
	if cfg.Algorithm == ratelimit.TokenBucket {
		src.bucket, src.capacity = true, cfg.Burst
	}
	return src, nil
}

// entry is one key's lease. Its fields are guarded by lock, a channel of
// one slot, so that a goroutine waiting for another's slice can give up
// when its context ends.
type entry struct {
	key  string
	lock chan struct{}
	dead bool // removed from its shard; look the key up again

	src       *source   // where the slice was taken; nil before the first
	left      int64     // units of the slice not yet given to a check
	expires   time.Time // local instant the slice's window ends
	local     time.Time // local instant taken before the slice's statement
	dbNow     time.Time // the slice's decision's Now (database clock)
	resetAt   time.Time // the slice's decision's ResetAt
	used      int64     // the slice's decision's Used (the slice counted)
	remaining int64     // the slice's decision's Remaining (the slice not counted)
	lastUse   time.Time // local instant of the last check
}

// New returns a lease limiter on l. It starts a goroutine that returns
// idle slices; Close stops it. l must not have Spread, a Policy read in
// each statement, or (a token bucket) Penalty: ErrUnsupported says why for
// each.
func New(l *ratelimit.Limiter, opts Options) (*Limiter, error) {
	if l == nil {
		return nil, ErrNilLimiter
	}
	src, err := newSource(l)
	if err != nil {
		return nil, err
	}
	if opts.Size < 1 || opts.Size > src.capacity {
		return nil, fmt.Errorf("%w: %d for %q; set Options.Size between 1 and the limit %d (a slice never exceeds the limit; a token bucket's is its Burst), such as %d", ErrInvalidSize, opts.Size, src.cfg.Name, src.capacity, max(src.capacity/100, 1))
	}
	return start(l, src.cfg.Name, func(string) (*source, error) { return src, nil }, opts)
}

// start validates opts and starts a lease limiter.
func start(c ratelimit.Checker, name string, src func(string) (*source, error), opts Options) (*Limiter, error) {
	if opts.Size < 1 {
		return nil, fmt.Errorf("%w: %d for %q; set Options.Size to at least 1 (and at most the limit), such as a hundredth of the limit", ErrInvalidSize, opts.Size, name)
	}
	if opts.Share < 0 {
		return nil, fmt.Errorf("%w: %d for %q; use 1 or more (0 means %d)", ErrInvalidShare, opts.Share, name, DefaultShare)
	}
	if opts.Share == 0 {
		opts.Share = DefaultShare
	}
	if opts.Idle < 0 || (opts.Idle > 0 && opts.Idle < MinIdle) {
		return nil, fmt.Errorf("%w: %v for %q; use at least %v (0 means %v)", ErrInvalidIdle, opts.Idle, name, MinIdle, DefaultIdle)
	}
	if opts.Idle == 0 {
		opts.Idle = DefaultIdle
	}
	if opts.DB != nil {
		if v := reflect.ValueOf(opts.DB); v.Kind() == reflect.Pointer && v.IsNil() {
			return nil, fmt.Errorf("%w: Options.DB for %q is a nil %T; pass the pool the limiter's Database was made on, or leave DB nil (units are then never returned)", ErrInvalidDB, name, opts.DB)
		}
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	lim := &Limiter{
		c: c, id: ids.Add(1), name: name, source: src, opts: opts, now: now, seed: maphash.MakeSeed(),
		stop: make(chan struct{}), done: make(chan struct{}),
	}
	for i := range lim.shards {
		lim.shards[i].m = make(map[string]*entry)
	}
	go lim.sweeper()
	return lim, nil
}

// Config is the leased limiter's configuration (for NewPolicy, the
// policy's as the limiter applies it now).
func (x *Limiter) Config() ratelimit.Config { return x.c.Config() }

// Stats reports what the limiter did since New.
func (x *Limiter) Stats() Stats {
	return Stats{
		Slices: x.slices.Load(), Leased: x.leased.Load(), UsedLocally: x.usedLocally.Load(),
		Returned: x.returned.Load(), Dropped: x.dropped.Load(),
		LocalDecisions: x.local.Load(), DatabaseDecisions: x.remote.Load(), OtherDecisions: x.other.Load(),
	}
}

// ask is what one check's options ask for.
type ask struct {
	n    int64
	upTo bool
}

// options reads a check's options: Cost or UpTo once; AtRate is refused.
func (x *Limiter) options(opts []ratelimit.Option, counts bool) (ask, error) {
	a := ask{n: 1}
	sized := false
	for _, o := range opts {
		v := o.Value()
		switch {
		case v.Sized:
			if !counts {
				return a, fmt.Errorf("%w: Cost or UpTo for %q where nothing is counted; Peek and Reset take no option on a lease limiter", ratelimit.ErrInvalidOption, x.name)
			}
			if sized {
				return a, fmt.Errorf("%w: Cost or UpTo given twice for %q; give one of them, once", ratelimit.ErrInvalidOption, x.name)
			}
			sized = true
			a = ask{n: v.Units, upTo: v.UpTo}
		case v.RequestID != "":
			return a, fmt.Errorf("%w: RequestID for %q, a lease limiter, which answers checks from its slices in memory; check requests that carry an id with the *ratelimit.Limiter", ratelimit.ErrInvalidOption, x.name)
		case v.Rated:
			return a, fmt.Errorf("%w: AtRate for %q, a lease limiter, whose slices are counted at the limiter's own rate; lease one limiter per rate, or check other rates with the *ratelimit.Limiter", ratelimit.ErrInvalidOption, x.name)
		default:
			return a, fmt.Errorf("%w: the zero Option for %q; use Cost or UpTo", ratelimit.ErrInvalidOption, x.name)
		}
	}
	if a.n <= 0 {
		return a, fmt.Errorf("%w: %d for %q; a check asks for at least 1 unit", ratelimit.ErrInvalidCost, a.n, x.name)
	}
	return a, nil
}

// Allow checks and counts what the options ask for (one unit by default,
// Cost(n), or UpTo(n)) for key: from the key's slice when it holds enough,
// with no statement; otherwise the slice's next ask goes to the database
// through the limiter's Allow with UpTo (its whole pipeline: deny cache,
// breaker, coalescing, failure policy). AtRate is refused
// (ratelimit.ErrInvalidOption).
//
// A check the slice and the database's grant together cannot cover is
// denied, and the units granted stay in the slice for smaller checks
// until the window ends. An answer that PostgreSQL did not make (memory
// fallback, failure policy, deny cache) is returned as the limiter made
// it and creates no slice; while the breaker is open the caller's own
// check is sent instead of a slice's ask.
func (x *Limiter) Allow(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	d, err := x.allow(ctx, key, opts)
	// Errors of the statements carry their outcomes; the others came
	// before any statement.
	return d, ratelimit.WithOutcome(err, ratelimit.OutcomeNotConsumed)
}

func (x *Limiter) allow(ctx context.Context, key string, opts []ratelimit.Option) (ratelimit.Decision, error) {
	a, err := x.options(opts, true)
	if err != nil {
		return ratelimit.Decision{}, err
	}
	for {
		if x.closed.Load() {
			return ratelimit.Decision{}, ErrClosed
		}
		e := x.entry(key)
		if err := e.acquire(ctx); err != nil {
			return ratelimit.Decision{}, err
		}
		if e.dead {
			e.release()
			continue
		}
		if x.closed.Load() {
			e.release()
			return ratelimit.Decision{}, ErrClosed
		}
		d, err := x.check(ctx, e, a, opts)
		e.release()
		return d, err
	}
}

// check decides one check with e held.
func (x *Limiter) check(ctx context.Context, e *entry, a ask, opts []ratelimit.Option) (ratelimit.Decision, error) {
	st, err := x.prepare(ctx, e, a)
	if err != nil {
		return ratelimit.Decision{}, err
	}
	if e.left >= a.n {
		return x.takeLocal(e, st.now, a.n), nil
	}
	if st.cold && !x.opts.Eager || st.src.l.BreakerOpen() {
		// A key's first check (or its first after it went idle) is the
		// caller's own, coalesced with other checks: a key checked once
		// costs what it costs without a lease. With the breaker open, the
		// failure policy answers the caller's own check too, so that the
		// memory tier counts what the caller asked, not a slice.
		d, err := st.src.l.Allow(ctx, e.key, opts...)
		x.count(d, err)
		return d, err
	}
	d, err := x.refill(ctx, e, a, st)
	if err != nil {
		return d, err
	}
	if d.Store != ratelimit.StorePostgres {
		return passThrough(d, a), nil
	}
	return x.settle(e, a, d, true), nil
}

// state is what prepare learnt of an entry before its check.
type state struct {
	src  *source
	now  time.Time // the local instant of the check
	cold bool      // the key's first check, or its first after Idle
	live bool      // the entry's units, if any, are of the current window
}

// prepare readies e, held, for a check of a: it follows a change of the
// key's source (NewPolicy), refuses a cost the limit can never admit,
// drops an expired slice's units and marks the key used.
func (x *Limiter) prepare(ctx context.Context, e *entry, a ask) (state, error) {
	src, err := x.source(e.key)
	if err != nil {
		return state{}, err
	}
	if e.src != src {
		// The policy or the key's override changed since the slice was
		// taken (NewPolicy): the slice ends, its units go back.
		if e.left > 0 {
			call, cancel := context.WithTimeout(ctx, ratelimit.DefaultTimeout)
			_ = x.giveBack(call, e) // what is not returned expires with its window
			cancel()
		}
		e.src, e.dbNow, e.expires = src, time.Time{}, time.Time{}
	}
	if !a.upTo && a.n > src.capacity {
		return state{}, fmt.Errorf("%w: cost %d for %q can never be admitted: the limit admits at most %d at once; raise the limit or split the work", ratelimit.ErrCostExceedsLimit, a.n, src.cfg.Name, src.capacity)
	}
	now := x.now()
	cold := e.lastUse.IsZero() || now.Sub(e.lastUse) >= x.opts.Idle
	e.lastUse = now
	if e.left > 0 && !now.Before(e.expires) {
		x.dropped.Add(e.left)
		e.left = 0
	}
	return state{src: src, now: now, cold: cold, live: now.Before(e.expires)}, nil
}

// takeLocal gives n of e's units to a check, with no statement.
func (x *Limiter) takeLocal(e *entry, now time.Time, n int64) ratelimit.Decision {
	e.left -= n
	x.usedLocally.Add(n)
	x.local.Add(1)
	return x.localDecision(e, now, n)
}

// refill asks the database for e's next slice, sized for a, and adds the
// units granted to e. A decision PostgreSQL did not make (the failure
// policy's) is returned as it is and leaves e as it was.
func (x *Limiter) refill(ctx context.Context, e *entry, a ask, st state) (ratelimit.Decision, error) {
	src, start := st.src, st.now
	d, err := src.l.Allow(ctx, e.key, x.slice(e, a, st.live))
	x.count(d, err)
	if err != nil || d.Store != ratelimit.StorePostgres {
		return d, err
	}
	if d.Granted > 0 {
		x.slices.Add(1)
		x.leased.Add(d.Granted)
	}
	expires := src.expiry(start, d)
	if src.bucket {
		// A token bucket's units are out on lease for a fixed time from
		// the instant they were taken: units left of an earlier slice
		// keep their earlier end, and so do the new ones with them.
		if e.left > 0 && e.expires.Before(expires) {
			expires = e.expires
		}
	} else if e.left > 0 && !windowEnd(e.dbNow, src.windowUs).Equal(windowEnd(d.Now, src.windowUs)) {
		// The leftover was counted in an earlier window than this grant
		// (the local clock has not reached that window's end yet, the
		// database's has): it may not be used in this one.
		x.dropped.Add(e.left)
		e.left = 0
	}
	e.left += d.Granted
	e.expires, e.local, e.dbNow, e.resetAt = expires, start, d.Now, d.ResetAt
	e.used, e.remaining = d.Used, d.Remaining
	return d, nil
}

// settle answers a check of a from e just after refill returned d: it
// takes the check's units from e when e holds them and take is set, and
// otherwise denies it (under Penalty the held units pay for the attempt).
// An all-or-nothing group whose other member denied settles with take
// unset: nothing is taken and the units stay for later checks, and Used
// and Remaining are what the check saw with its units taken, as
// ratelimit.AllowAll reports them.
func (x *Limiter) settle(e *entry, a ask, d ratelimit.Decision, take bool) ratelimit.Decision {
	n := a.n
	if a.upTo {
		n = min(a.n, e.left)
	}
	if n == 0 || e.left < n {
		if e.src.cfg.Penalty {
			// Every attempt counts its whole cost: the statement counted
			// what the held units did not cover, and the held units pay
			// the rest.
			x.dropped.Add(e.left)
			e.left = 0
		}
		return x.denied(e, d)
	}
	out := d
	out.Allowed, out.RetryAfter, out.ShadowDenied = true, 0, false
	left := e.left - n // as the check saw it: its units taken
	if take {
		e.left = left
		x.usedLocally.Add(n)
		out.Granted = n
	} else {
		out.Granted = 0
	}
	out.Used, out.Remaining = max(d.Used-left, 0), d.Remaining+left
	return out
}

// count counts a decision of the limiter.
func (x *Limiter) count(d ratelimit.Decision, err error) {
	switch {
	case err != nil:
	case d.Store == ratelimit.StorePostgres:
		x.remote.Add(1)
	default:
		x.other.Add(1)
	}
}

// slice is the slice a check of a asks the database for: the statement
// grants ceil(left/Share) of what the key has left, at most Size (or what
// an UpTo check asks, when that is more), and at least what the check
// still needs beyond the units e holds (live: e's units are of the
// current window); fewer than that left is a denial (under Penalty
// counting just that).
func (x *Limiter) slice(e *entry, a ask, live bool) ratelimit.Option {
	held := int64(0)
	if live {
		held = e.left
	}
	need := max(a.n-held, 1)
	if a.upTo {
		need = 1
	}
	limit := e.src.capacity
	need = min(need, limit)
	return ratelimit.Slice(need, max(x.opts.Size, min(a.n-held, limit)), int64(x.opts.Share))
}

// localDecision is the answer of a slice that gave n units.
func (x *Limiter) localDecision(e *entry, now time.Time, n int64) ratelimit.Decision {
	dbNow := e.dbNow.Add(now.Sub(e.local))
	return ratelimit.Decision{
		Allowed:   true,
		Granted:   n,
		Limit:     e.src.capacity,
		Used:      max(e.used-e.left, 0),
		Remaining: e.remaining + e.left,
		ResetAt:   e.resetAt,
		Now:       dbNow,
		Store:     ratelimit.StoreLease,
	}
}

// denied is the answer to a check that the slice and the database's
// grant d could not cover. RetryAfter is the database's, or the window's
// end when the grant left nothing (it was computed for one unit).
func (x *Limiter) denied(e *entry, d ratelimit.Decision) ratelimit.Decision {
	out := d
	out.Allowed, out.Granted = false, 0
	out.Used, out.Remaining = max(d.Used-e.left, 0), d.Remaining+e.left
	if out.RetryAfter <= 0 {
		out.RetryAfter = max(windowEnd(d.Now, e.src.windowUs).Sub(d.Now), time.Microsecond)
	}
	if d.ShadowDenied || e.src.cfg.Shadow {
		out.Allowed, out.ShadowDenied = true, true
	}
	return out
}

// passThrough is an answer PostgreSQL did not make, to the check a asked
// for: Granted is what the check would take, not the slice's ask.
func passThrough(d ratelimit.Decision, a ask) ratelimit.Decision {
	switch {
	case a.upTo:
		d.Granted = min(d.Granted, a.n)
	case d.Allowed && !d.ShadowDenied:
		d.Granted = a.n
	default:
		d.Granted = 0
	}
	return d
}

// windowEnd is the end of the aligned window of windowUs microseconds that
// holds t: windows are multiples of the window since the Unix epoch, on
// the database's clock.
func windowEnd(t time.Time, windowUs int64) time.Time {
	us := t.UnixMicro()
	start := us - ((us%windowUs)+windowUs)%windowUs
	return time.UnixMicro(start + windowUs)
}

// Peek reports key's state from the database (the limiter's Peek). Units
// out on lease, in this process or another, count as used. AtRate is
// refused.
func (x *Limiter) Peek(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	if _, err := x.options(opts, false); err != nil {
		return ratelimit.Decision{}, err
	}
	if x.closed.Load() {
		return ratelimit.Decision{}, ErrClosed
	}
	return x.c.Peek(ctx, key)
}

// Reset drops this process's slice of key (its units are not returned:
// the reset forgets them) and then forgets what was counted for key (the
// limiter's Reset). Slices other processes hold are theirs until their
// window ends. AtRate is refused.
func (x *Limiter) Reset(ctx context.Context, key string, opts ...ratelimit.Option) error {
	if _, err := x.options(opts, false); err != nil {
		return err
	}
	if x.closed.Load() {
		return ErrClosed
	}
	for {
		e := x.entry(key)
		if err := e.acquire(ctx); err != nil {
			return err
		}
		if e.dead {
			e.release()
			continue
		}
		x.dropped.Add(e.left)
		e.left, e.dbNow, e.expires = 0, time.Time{}, time.Time{}
		err := x.c.Reset(ctx, key)
		e.release()
		return err
	}
}

// Close returns every unused unit it can (fixed window, with Options.DB),
// drops the rest, stops the background goroutine, and makes further checks
// fail with ErrClosed. It waits for checks in flight. The first error of a
// return is reported; Close may be called again.
func (x *Limiter) Close(ctx context.Context) error {
	x.closed.Store(true)
	x.closeOnce.Do(func() { close(x.stop) })
	select {
	case <-x.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	var errs []error
	for i := range x.shards {
		for _, e := range x.snapshot(i) {
			if err := e.acquire(ctx); err != nil {
				return errors.Join(append(errs, err)...)
			}
			if !e.dead {
				if err := x.giveBack(ctx, e); err != nil {
					errs = append(errs, err)
				}
				x.remove(i, e)
			}
			e.release()
		}
	}
	return errors.Join(errs...)
}

// entry returns key's entry, made if new.
func (x *Limiter) entry(key string) *entry {
	s := &x.shards[maphash.String(x.seed, key)%shardCount]
	s.mu.Lock()
	e := s.m[key]
	if e == nil {
		e = &entry{key: key, lock: make(chan struct{}, 1)}
		s.m[key] = e
	}
	s.mu.Unlock()
	return e
}

// snapshot lists shard i's entries.
func (x *Limiter) snapshot(i int) []*entry {
	s := &x.shards[i]
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*entry, 0, len(s.m))
	for _, e := range s.m {
		out = append(out, e)
	}
	return out
}

// remove marks e dead and takes it out of shard i; e is held.
func (x *Limiter) remove(i int, e *entry) {
	e.dead = true
	s := &x.shards[i]
	s.mu.Lock()
	if s.m[e.key] == e {
		delete(s.m, e.key)
	}
	s.mu.Unlock()
}

func (e *entry) acquire(ctx context.Context) error {
	select {
	case e.lock <- struct{}{}:
		return nil
	default:
	}
	select {
	case e.lock <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *entry) tryAcquire() bool {
	select {
	case e.lock <- struct{}{}:
		return true
	default:
		return false
	}
}

func (e *entry) release() { <-e.lock }

// sweeper returns the slices of keys idle for Options.Idle, until Close.
func (x *Limiter) sweeper() {
	defer close(x.done)
	t := time.NewTicker(max(x.opts.Idle/4, MinIdle))
	defer t.Stop()
	for {
		select {
		case <-x.stop:
			return
		case <-t.C:
			x.sweep(context.Background())
			if f := x.afterSweep.Load(); f != nil {
				(*f)()
			}
		}
	}
}

// sweep gives back the slices of the keys idle for Options.Idle and forgets
// those keys. A key whose lock is held is in use: it is left alone.
func (x *Limiter) sweep(ctx context.Context) {
	now := x.now()
	for i := range x.shards {
		for _, e := range x.snapshot(i) {
			if !e.tryAcquire() {
				continue
			}
			if !e.dead && now.Sub(e.lastUse) >= x.opts.Idle {
				call, cancel := context.WithTimeout(ctx, ratelimit.DefaultTimeout)
				_ = x.giveBack(call, e) // a unit not returned expires with its window
				cancel()
				x.remove(i, e)
			}
			e.release()
		}
	}
}

var queries = gen.New()

// giveBack returns e's unused units to the database when it can: Options.DB
// set, and the slice's window still live on the local clock. The units go
// back to the window they were counted in, whatever the clocks, and never
// to a later window, which would over-admit: the fixed window's statement
// is pinned (At) to the instant they were counted at; the sliding window's
// lowers that window's count, or, once the row has moved one window on,
// its previous count (see sqlops.SlidingWindowReturnSlice). What it cannot
// return is dropped. e is held; its slice is empty afterwards.
func (x *Limiter) giveBack(ctx context.Context, e *entry) error {
	n := e.left
	e.left = 0
	if n == 0 {
		return nil
	}
	if x.opts.DB == nil || !x.now().Before(e.expires) {
		x.dropped.Add(n)
		return nil
	}
	src := e.src
	k := ratelimit.StoredKey(src.cfg.KeyMode, src.stored, e.key)
	if src.bucket {
		// Given back to the lease epoch of the slice's instant: what the
		// statement gives back stops counting against the capacity and is
		// tokens again (units of an earlier slice merged into this one
		// stay counted until their lease is over).
		back, err := sqlops.New().TokenBucketReturnSlice(ctx, x.opts.DB, sqlops.TokenBucketReturnSliceParams{
			Key: k, At: e.dbNow, N: n, Capacity: float64(src.capacity),
			RefillPerUs: float64(src.cfg.Limit) / float64(src.windowUs),
		})
		if err != nil {
			x.dropped.Add(n)
			return fmt.Errorf("pgrl lease: returning %d units of %q: %w", n, src.cfg.Name, err)
		}
		back = max(min(back, n), 0)
		x.returned.Add(back)
		x.dropped.Add(n - back)
		return nil
	}
	if src.cfg.Algorithm == ratelimit.SlidingWindow {
		rows, err := sqlops.New().SlidingWindowReturnSlice(ctx, x.opts.DB, sqlops.SlidingWindowReturnSliceParams{
			Key: k, N: n, WindowStartUs: windowEnd(e.dbNow, src.windowUs).UnixMicro() - src.windowUs, WindowUs: src.windowUs,
		})
		switch {
		case err != nil:
			x.dropped.Add(n)
			return fmt.Errorf("pgrl lease: returning %d units of %q: %w", n, src.cfg.Name, err)
		case rows == 0: // the row has moved two windows on, or was reset
			x.dropped.Add(n)
		default:
			x.returned.Add(n)
		}
		return nil
	}
	at := e.dbNow
	r, err := queries.FixedWindowTake(ctx, x.opts.DB, gen.FixedWindowTakeParams{
		Key: k, At: &at, WindowUs: src.windowUs, Cost: -n, MaxCount: math.MaxInt64, Penalty: true,
	})
	if err != nil {
		x.dropped.Add(n)
		return fmt.Errorf("pgrl lease: returning %d units of %q: %w", n, src.cfg.Name, err)
	}
	x.returned.Add(n)
	if r.Count < 0 {
		// The key was reset by another process while this one held units
		// counted before the reset: the count may not go below zero, which
		// would admit more than the limit after the reset.
		if _, err := queries.FixedWindowTake(ctx, x.opts.DB, gen.FixedWindowTakeParams{
			Key: k, At: &at, WindowUs: src.windowUs, Cost: -r.Count, MaxCount: math.MaxInt64, Penalty: true,
		}); err != nil {
			return fmt.Errorf("pgrl lease: restoring the count of %q after a reset: %w", src.cfg.Name, err)
		}
	}
	return nil
}
