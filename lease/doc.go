// Package lease answers a limit's checks from slices of its quota taken
// ahead of use: one statement takes up to Options.Size of a key's remaining
// units (a partial grant, ratelimit.UpTo), and the key's next checks in
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
// another is denied. Per process and key it is at most one slice (at most
// Size, and at most ceil(r/Share) once the process has seen the key's
// Remaining r in the window); a process killed while holding units loses
// them until the window ends. docs/LEASES.md gives the bound and how to
// choose Size, Share and Idle.
//
// A slice is used only within the window its units were counted in: its
// expiry is a local monotonic instant taken before the statement was sent
// plus the time the database's answer gave until that window's end, so it
// never outlives the window, whatever the clocks. Unused units of the
// fixed window are returned (Options.DB) when the key goes idle and at
// Close, by one statement pinned to the window they were counted in; the
// sliding window's are not returned (they expire with their window).
//
// This is a first step: the token bucket, Penalty, Spread and stored
// policies are refused (ErrUnsupported), as are AtRate and checks in a
// transaction (a Limiter has no …Tx methods).
//
// Limiter.Stats counts slices, units and decisions; package metrics exports
// them to Prometheus (metrics.NewLeaseCollector).
//
// It uses ratelimit's public API only (a check's options are read with
// ratelimit.Option.Value), and one public statement of package gen.
package lease
