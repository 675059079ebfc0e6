package ratelimit

import "context"

// BatchedChecks reports how many of l's checks were decided in coalesced
// statements of two or more checks.
func BatchedChecks(l *Limiter) uint64 {
	if l.coalescer == nil {
		return 0
	}
	return l.coalescer.batched.Load()
}

// OptionsOf returns the options of the Database l checks with.
func OptionsOf(l *Limiter) DatabaseOptions { return l.st.opts }

// Coalesces reports whether l coalesces concurrent checks.
func Coalesces(l *Limiter) bool { return l.coalescer != nil }

// TakeMany decides checks of distinct keys in one batched statement, as the
// coalescer does, and returns their decisions in order.
func TakeMany(ctx context.Context, l *Limiter, keys []string, costs []int64) ([]Decision, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: string(skey), ask: ask{n: costs[i]}}
	}
	if err := newCoalescer(len(keys), 1).takeMany(ctx, batch); err != nil {
		return nil, err
	}
	ds := make([]Decision, len(batch))
	for i, r := range batch {
		ds[i] = r.d
	}
	return ds, nil
}

// SendBatch sends checks as the coalescer sends one batch, skipping the
// per-call validation, and returns each check's decision and error as the
// caller would see them. A limiter with a stored policy reads it, as
// Allow's checks do.
func SendBatch(ctx context.Context, l *Limiter, keys []string, costs []int64) ([]Decision, []error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: string(skey), ask: ask{n: costs[i]},
			policy: l.cfg.Policy != ""}
	}
	newCoalescer(len(keys), 1).send(batch)
	ds := make([]Decision, len(batch))
	errs := make([]error, len(batch))
	for i, r := range batch {
		ds[i], errs[i] = r.ask.settle(r.d), mapErr(r.err)
	}
	return ds, errs
}

// TakeBatch decides checks as the coalescer decides one batch, several of
// one key included (upTo[i] makes check i a partial grant), and returns
// their decisions in order, as Allow with Cost and UpTo reports them.
func TakeBatch(ctx context.Context, l *Limiter, keys []string, costs []int64, upTo []bool) ([]Decision, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: string(skey), ask: ask{n: costs[i], upTo: upTo[i]}}
	}
	if err := newCoalescer(len(keys), 1).takeMany(ctx, batch); err != nil {
		return nil, err
	}
	ds := make([]Decision, len(batch))
	for i, r := range batch {
		ds[i] = r.ask.settle(r.d)
	}
	return ds, nil
}

// TakeRunsBatch is TakeBatch of checks of one unit, all or nothing, and
// also reports how many of them the run statement decided.
func TakeRunsBatch(ctx context.Context, l *Limiter, keys []string) ([]Decision, int, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: string(skey), ask: ask{n: 1}}
	}
	c := newCoalescer(len(keys), 1)
	if err := c.takeMany(ctx, batch); err != nil {
		return nil, 0, err
	}
	ds := make([]Decision, len(batch))
	for i, r := range batch {
		if r.err != nil {
			return nil, 0, r.err
		}
		ds[i] = r.ask.settle(r.d)
	}
	return ds, int(c.ranRuns.Load()), nil
}

// SharesCoalescer reports whether a and b coalesce their checks together.
func SharesCoalescer(a, b *Limiter) bool { return a.coalescer != nil && a.coalescer == b.coalescer }

// TakeMixed decides checks of several limiters as the shared coalescer
// decides one batch (checks[i] is of limiters[i]), and returns their
// decisions in order.
func TakeMixed(ctx context.Context, limiters []*Limiter, keys []string, costs []int64, upTo []bool) ([]Decision, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		l := limiters[i]
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: l.alg.table() + string(skey), ask: ask{n: costs[i], upTo: upTo[i]}}
	}
	newCoalescer(len(keys), 1).send(batch)
	ds := make([]Decision, len(batch))
	for i, r := range batch {
		if r.err != nil {
			return nil, r.err
		}
		ds[i] = r.ask.settle(r.d)
	}
	return ds, nil
}

// TakeMixedOptions is TakeMixed with each check's Cost, UpTo or Slice
// option (opts[i] is check i's), so that slices are coalesced with the
// other checks: the checks of one algorithm and clock go in one statement.
func TakeMixedOptions(ctx context.Context, limiters []*Limiter, keys []string, opts []Option) ([]Decision, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		l := limiters[i]
		a, _, _, err := options(l.cfg.Name, opts[i:i+1], true)
		if err != nil {
			return nil, err
		}
		skey := l.key(key)
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: l.alg.table() + string(skey), ask: a}
	}
	newCoalescer(len(keys), 1).send(batch)
	ds := make([]Decision, len(batch))
	for i, r := range batch {
		if r.err != nil {
			return nil, r.err
		}
		ds[i] = r.ask.settle(r.d)
	}
	return ds, nil
}

// FallbackKeys reports how many keys l's memory tier (the FailToMemory
// fallback) holds.
func FallbackKeys(l *Limiter) int { return l.memory.Len() }

// MapErr is mapErr: a database error as a check returns it.
var MapErr = mapErr

// TakeGroups decides checks in one check statement, in their order, as
// AllowAll decides an all-or-nothing group: checks with the same non-zero
// groups[i] (consecutive) are allowed together or not at all. It returns
// the decisions as Allow (Cost, UpTo) and AllowAll report them: a group
// that a check with a veto (not in shadow mode) denied grants nothing.
func TakeGroups(ctx context.Context, limiters []*Limiter, keys []string, costs []int64, upTo []bool, groups []int32) ([]Decision, error) {
	batch := make([]*pendingCheck, len(keys))
	for i, key := range keys {
		l := limiters[i]
		batch[i] = &pendingCheck{l: l, ctx: ctx, key: key, skey: l.key(key), ask: ask{n: costs[i], upTo: upTo[i]}, group: groups[i]}
	}
	decs, err := limiters[0].alg.takeQueue(ctx, limiters[0].st.db, newCheckQueue(batch))
	if err != nil {
		return nil, err
	}
	denied := map[int32]bool{}
	for i, d := range decs {
		if groups[i] != 0 && !d.Allowed && !limiters[i].cfg.Shadow {
			denied[groups[i]] = true
		}
	}
	for i, d := range decs {
		d.Store = StorePostgres
		d = batch[i].ask.settle(limiters[i].shadow(keys[i], d))
		if denied[groups[i]] {
			d.Granted = 0
		}
		decs[i] = d
	}
	return decs, nil
}
