// Package lease answers a limit's checks from slices of its quota taken
// ahead of use: one statement takes a fair share of a key's remaining
// units, at most Options.Size (ratelimit.Slice), and the key's next checks in
// this process are answered from them in memory, with no round trip,
// until the slice runs out, its window ends, or the key goes idle.
//
//	lim, err := limits.Limiter(ratelimit.Config{Name: "api", Limit: 10_000, Window: time.Minute})
//	...
//	leased, err := lease.New(lim, lease.Options{Size: 100, DB: pool})
//	...
//	defer leased.Close(ctx)
//	d, err := leased.Allow(ctx, apiKey)
//
// Units are counted in PostgreSQL before they are used, so the total
// admitted across every process never exceeds the limit. What a lease
// trades is a shortfall: units one process holds and does not use while
// another is denied. Per process and key it is at most one slice: at most
// Size, and at most ceil(r/Share) of the r units the key had left when the
// slice was taken, a share the statement itself decides; a process killed
// while holding units loses them until the window ends. docs/LEASES.md
// gives the bound and how to choose Size, Share and Idle.
//
// A slice is used only within the window its units were counted in (a
// token bucket's: within its lease time): its expiry is a local monotonic
// instant taken before the statement was sent plus the time the database's
// answer gave until that window's end, so it never outlives the window,
// whatever the clocks. Unused units are returned (Options.DB) when the key
// goes idle and at Close, by one statement, to the window (or lease epoch)
// they were counted in.
//
// All three algorithms can be leased. A token bucket's leased units count
// against its capacity for ratelimit.TokenBucketLeaseTime, so that it does
// not refill behind them. Under Penalty every attempt is charged its whole
// cost, as without a lease (a penalised token bucket is refused). Spread
// above 1 and limiters that read their policy in each statement are
// refused (ErrUnsupported): lease a stored policy with NewPolicy. AtRate is
// refused, and there are no checks in a transaction (a Limiter has no …Tx
// methods).
//
// AllowAll decides several leased limits of one request together, as
// ratelimit.AllowAll does (a login's per email and address, per address
// and per email limits): in memory when every key's slice holds what its
// check asks, all or nothing, a denied request taking no unit from any
// slice.
//
// Limiter.Stats counts slices, units and decisions; package metrics exports
// them to Prometheus (metrics.NewLeaseCollector).
//
// It checks through ratelimit's public API (a check's options are read
// with ratelimit.Option.Value); units go back by gen's fixed-window take
// and an internal sliding-window statement.
package lease
