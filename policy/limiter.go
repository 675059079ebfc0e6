package policy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgrl/pgrl/ratelimit"
)

// Options configures NewLimiter.
type Options struct {
	// Config supplies what a limit holds and a policy does not:
	// OnFailure, FallbackLimit, Shadow, Spread, DenyCacheSize and the
	// sharing of denials. Its Name, Algorithm, Limit, Window, Burst,
	// Penalty and KeyMode are replaced by the policy's. What is per
	// database (Timeout, Observer, Logger, Now, ...) is Database's.
	Config ratelimit.Config
	// Cache is where the limiter reads its policy. Share one Cache among
	// all limiters of a schema, kept current by one Listener (Watch).
	// When nil, NewLimiter makes and loads a cache of its own, which
	// nothing refreshes but the limiter itself (see FromCache).
	Cache *Cache
	// FromCache makes checks use the policy and override as last loaded
	// into the Cache, instead of reading them in each check's statement.
	// By default (false) every check reads its policy and the key's
	// override in the statement that counts (ratelimit.Config.Policy): a
	// change made by plain SQL is obeyed by the very next check of every
	// process, listener or not, for two primary-key lookups more per
	// statement (docs/POLICIES.md has the measured cost). With FromCache
	// a change reaches a process when its Listener reloads the Cache
	// (milliseconds), or never without one; in exchange, concurrent checks
	// of the policy are coalesced (a hot key's checks share one row update)
	// and Spread may be used.
	FromCache bool
	// Database is where the policy's limits are kept: each load of the
	// policy makes its limiter with Database.Limiter, so that it shares
	// the Database's coalescer, breaker (kept across reloads), Timeout,
	// Observer and Logger with every other limit there. It must be db's
	// database. When nil, NewLimiter makes a Database of its own on db
	// with the default options, which shares nothing with the
	// application's other limits: pass the application's Database so that
	// all its limits share one coalescer and one breaker.
	Database *ratelimit.Database
}

// Limiter is a ratelimit.Limiter whose limit is a stored policy. Each check
// is one statement, as a ratelimit.Limiter's is, which by default reads the
// policy and the key's override itself (Options.FromCache). The Cache
// tells the limiter which counter row a key uses (the algorithm, key mode
// and window); when the statement finds the policy changed in a way that
// moves the row, the limiter reloads the policy and checks again, once.
// A key with an override in force is checked at the override's rate
// (ratelimit.AtRate), so what the key has used carries over as
// ratelimit.Rate describes. A Limiter is safe for concurrent use.
type Limiter struct {
	name  string
	db    DB
	rdb   *ratelimit.Database // where the policy's limits are kept
	cache *Cache
	base  ratelimit.Config
	// inStatement: checks read the policy in their statement.
	inStatement bool
	mu          sync.Mutex // serialises rebuilds
	cur         atomic.Pointer[built]
	// warned remembers the overrides already logged as invalid, by
	// policy version and key, so that a bad one is logged once.
	warned sync.Map
}

var _ ratelimit.Checker = (*Limiter)(nil)

// citusLogged is set once NewLimiter has logged that it checks from the
// cache because the database is a Citus coordinator.
var citusLogged atomic.Bool

// onCitus reports whether the citus extension exists in db's database.
func onCitus(ctx context.Context, db DB) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')").Scan(&ok)
	return ok, err
}

// built is the ratelimit.Limiter of one load of the policy: it is built
// again whenever the cache entry is replaced (the policy or one of its
// overrides reloaded), so that no deny cache outlives a change.
type built struct {
	entry  *entry
	policy Policy
	lim    *ratelimit.Limiter
}

// NewLimiter returns a limiter for the policy named name in db. It loads
// the cache when it has not been loaded, and fails with ErrNotFound when
// no such policy exists, or with ratelimit's error when opts.Config is
// invalid. On Citus (the citus extension exists in db) it checks as
// Options.FromCache says, whatever opts says: Citus does not run a check
// that reads its policy in the statement.
func NewLimiter(ctx context.Context, db DB, name string, opts Options) (*Limiter, error) {
	c := opts.Cache
	if c == nil {
		c = NewCache(db)
	}
	if c.LoadedAt().IsZero() {
		if err := c.Reload(ctx); err != nil {
			return nil, err
		}
	}
	if c.lookup(name) == nil {
		// Created after the last reload, perhaps.
		if err := c.ReloadPolicy(ctx, name); err != nil {
			return nil, err
		}
	}
	inStatement := !opts.FromCache
	citus := false
	if inStatement {
		var err error
		if citus, err = onCitus(ctx, db); err != nil {
			return nil, mapErr(err)
		}
		inStatement = !citus
	}
	rdb := opts.Database
	if rdb == nil {
		var err error
		if rdb, err = ratelimit.NewDatabase(db, ratelimit.DatabaseOptions{}); err != nil {
			return nil, err
		}
	}
	l := &Limiter{name: name, db: db, rdb: rdb, cache: c, base: opts.Config, inStatement: inStatement}
	if _, err := l.current(); err != nil {
		return nil, err
	}
	if citus && citusLogged.CompareAndSwap(false, true) {
		rdb.Options().Logger.Info("pgrl: on Citus, policy limiters check with the policy as last loaded into their Cache (Options.FromCache): a check that reads its policy in the statement does not run there; keep the Cache current with a Listener",
			"policy", name)
	}
	return l, nil
}

// Name is the policy's name.
func (l *Limiter) Name() string { return l.name }

// Policy returns the policy the limiter applies now.
func (l *Limiter) Policy() (Policy, error) {
	b, err := l.current()
	if err != nil {
		return Policy{}, err
	}
	return b.policy, nil
}

// current returns the limiter of the cached policy, building it when the
// policy changed.
func (l *Limiter) current() (*built, error) {
	b, _, err := l.currentEntry()
	return b, err
}

// currentEntry is current, with the cache entry it was built from, so that
// a check reads the policy and the overrides of one reload.
func (l *Limiter) currentEntry() (*built, *entry, error) {
	e := l.cache.lookup(l.name)
	if e == nil {
		return nil, nil, fmt.Errorf("%w: policy %q does not exist (deleted, renamed, or never created); create it with `rl-policy set %s --limit N --window D`", ErrNotFound, l.name, l.name)
	}
	if b := l.cur.Load(); b != nil && b.entry == e {
		return b, e, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if b := l.cur.Load(); b != nil && b.entry == e {
		return b, e, nil
	}
	cfg := e.policy.Config(l.base)
	if l.inStatement {
		cfg.Policy = l.name
		if !l.cache.watched() && l.base.DenyCacheSize == 0 && !l.base.ShareDenials {
			// Nothing would tell this process that a denied key's limit
			// was raised: a cached denial could outlive the change. Unless
			// asked for, no deny cache.
			cfg.DenyCacheSize = -1
		}
	}
	lim, err := l.rdb.Limiter(cfg)
	if err != nil {
		return nil, nil, invalid(err, "")
	}
	b := &built{entry: e, policy: e.policy, lim: lim}
	l.cur.Store(b)
	return b, e, nil
}

// For returns the ratelimit.Limiter that decides for key now: the policy's,
// or with an override in force, the policy's at the override's rate. Put it
// in a ratelimit.Check to decide a policy's limit together with others
// (ratelimit.AllowAll).
func (l *Limiter) For(key string) (*ratelimit.Limiter, error) {
	lim, _, err := l.resolve(key)
	return lim, err
}

// resolve returns the limiter for key and the override that applies.
func (l *Limiter) resolve(key string) (*ratelimit.Limiter, *Override, error) {
	b, e, err := l.currentEntry()
	if err != nil {
		return nil, nil, err
	}
	lim, o := l.forKey(b, e, key)
	return lim, o, nil
}

// forKey returns the limiter of b (built from e) for key, and the override
// that applies.
func (l *Limiter) forKey(b *built, e *entry, key string) (*ratelimit.Limiter, *Override) {
	if len(e.overrides) == 0 {
		return b.lim, nil
	}
	sk := b.policy.StoredKey(key)
	o, ok := e.overrides[string(sk)]
	if !ok || !o.Applies(l.now()) {
		return b.lim, nil
	}
	lim, err := b.lim.WithRate(o.Rate(b.policy))
	if err != nil {
		// Valid when written (SetOverride and the constraints check it),
		// invalid for the policy as it is now: apply the policy.
		wk := fmt.Sprintf("%d/%x", b.policy.UpdatedAt.UnixNano(), sk)
		if _, seen := l.warned.LoadOrStore(wk, true); !seen {
			l.rdb.Options().Logger.Warn("pgrl: ignoring an override that the policy no longer admits; fix or delete it (rl-policy override list)",
				"policy", l.name, "key", fmt.Sprintf("%x", sk), "error", err)
		}
		return b.lim, nil
	}
	return lim, &o
}

func (l *Limiter) now() time.Time {
	if now := l.rdb.Options().Now; now != nil {
		return now()
	}
	return time.Now()
}

// Allow checks and counts units for key under the policy, or under the
// key's override when one is in force: one unit, or what ratelimit.Cost or
// ratelimit.UpTo asks for (ratelimit.Limiter.Allow describes the answer and
// the errors). A policy holds its rate: ratelimit.AtRate is refused with
// ratelimit.ErrInvalidOption. A policy deleted since the limiter was made
// gives ErrNotFound.
//
// When the check finds the policy changed under the cached one (its
// statement reports ratelimit.ErrPolicyChanged: the policy was deleted,
// or its algorithm, key mode or the key's window changed; or the cost
// exceeds the cached limit, which may have been raised), the limiter
// reloads the policy and checks once more. Nothing was counted by the
// first attempt.
func (l *Limiter) Allow(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	if err := l.noRate(opts); err != nil {
		return ratelimit.Decision{}, ratelimit.WithOutcome(err, ratelimit.OutcomeNotConsumed)
	}
	for attempt := 0; ; attempt++ {
		b, e, err := l.currentEntry()
		if err != nil {
			return ratelimit.Decision{}, ratelimit.WithOutcome(err, ratelimit.OutcomeNotConsumed)
		}
		lim, _ := l.forKey(b, e, key)
		d, err := lim.Allow(ctx, key, opts...)
		if attempt == 0 && l.inStatement && stale(err) {
			// The reload is bounded as the check is (DatabaseOptions.Timeout).
			rctx, cancel := context.WithTimeout(ctx, l.rdb.Options().Timeout)
			rerr := l.cache.refreshKey(rctx, l.name, b.policy.StoredKey(key), e)
			cancel()
			if rerr != nil {
				// The first attempt counted nothing (stale).
				return ratelimit.Decision{}, ratelimit.WithOutcome(rerr, ratelimit.OutcomeNotConsumed)
			}
			continue
		}
		return d, err
	}
}

// noRate refuses a rate given with a call: the policy holds the rate.
func (l *Limiter) noRate(opts []ratelimit.Option) error {
	for _, o := range opts {
		if o.Value().Rated {
			return fmt.Errorf("%w: AtRate for policy %q, whose rate is stored; change the policy or give the key an override (rl-policy)", ratelimit.ErrInvalidOption, l.name)
		}
	}
	return nil
}

// stale reports a check refused because the cached policy may be out of
// date.
func stale(err error) bool {
	return errors.Is(err, ratelimit.ErrPolicyChanged) || errors.Is(err, ratelimit.ErrCostExceedsLimit)
}

// Peek reports key's state under the rate that applies to it, counting
// nothing.
func (l *Limiter) Peek(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	if err := l.noRate(opts); err != nil {
		return ratelimit.Decision{}, err
	}
	lim, _, err := l.resolve(key)
	if err != nil {
		return ratelimit.Decision{}, err
	}
	return lim.Peek(ctx, key, opts...)
}

// Reset forgets what key counted under the rate that applies to it.
func (l *Limiter) Reset(ctx context.Context, key string, opts ...ratelimit.Option) error {
	if err := l.noRate(opts); err != nil {
		return err
	}
	lim, _, err := l.resolve(key)
	if err != nil {
		return err
	}
	return lim.Reset(ctx, key, opts...)
}

// Config returns the configuration of the policy's own limiter (the policy
// as last loaded, with Options.Config for the rest), or, when the policy no
// longer exists, Options.Config with the policy's name. With it, Allow,
// Peek and Reset a Limiter is a ratelimit.Checker (and so an
// httplimit.Checker), and with For an httplimit.KeyedLimiter:
// the middleware checks each request with For's limiter, so that its
// RateLimit-Policy and RateLimit fields report the rate in force for the
// request's key (the override's, when one applies, and the policy as last
// loaded).
func (l *Limiter) Config() ratelimit.Config {
	b, err := l.current()
	if err != nil {
		c := l.base
		c.Name = l.name
		return c
	}
	return b.lim.Config()
}
