package lease

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// BenchmarkLocalCheck compares a check answered from a slice with a
// ratelimit.MemoryLimiter check, one goroutine each. Beside ns/op each
// reports the median and 99th percentile of 100,000 single checks timed
// one by one (p50-ns, p99-ns, which include reading the clock twice).
func BenchmarkLocalCheck(b *testing.B) {
	ctx := context.Background()
	cfg := ratelimit.Config{Name: "bench", Limit: math.MaxInt64 / 2, Window: time.Hour}
	b.Run("lease", func(b *testing.B) {
		pool, _ := dbtest.Pool(b)
		l := testkit.NewLimiter(b, pool, cfg)
		x, err := New(l, Options{Eager: true, Size: 1 << 40, Idle: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = x.Close(ctx) }()
		if _, err := x.Allow(ctx, "k"); err != nil { // takes the slice
			b.Fatal(err)
		}
		benchChecks(b, func() (ratelimit.Decision, error) { return x.Allow(ctx, "k") })
		if s := x.Stats(); s.Slices != 1 {
			b.Fatalf("%d slices: some checks were not answered locally", s.Slices)
		}
	})
	b.Run("memory", func(b *testing.B) {
		m, err := ratelimit.NewMemory(cfg, ratelimit.MemoryOptions{})
		if err != nil {
			b.Fatal(err)
		}
		benchChecks(b, func() (ratelimit.Decision, error) { return m.Allow(ctx, "k") })
	})
}

// BenchmarkLocalGroup compares a leased AllowAll of three limits answered
// from their slices with three ratelimit.MemoryLimiter checks, one
// goroutine each: a login's three limits.
func BenchmarkLocalGroup(b *testing.B) {
	ctx := context.Background()
	cfg := ratelimit.Config{Limit: math.MaxInt64 / 2, Window: time.Hour}
	names := []string{"pair", "ip", "email"}
	b.Run("lease", func(b *testing.B) {
		pool, _ := dbtest.Pool(b)
		d := testkit.NewDatabase(b, pool, ratelimit.DatabaseOptions{})
		var checks []Check
		for _, name := range names {
			c := cfg
			c.Name = name
			x, err := New(testkit.Limiter(b, d, c), Options{Eager: true, Size: 1 << 40, Idle: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = x.Close(ctx) }()
			checks = append(checks, Check{Limiter: x, Key: "k-" + name})
		}
		if _, err := AllowAll(ctx, ratelimit.AllOrNothing, checks...); err != nil { // takes the slices
			b.Fatal(err)
		}
		benchChecks(b, func() (ratelimit.Decision, error) {
			md, err := AllowAll(ctx, ratelimit.AllOrNothing, checks...)
			return ratelimit.Decision{Allowed: md.Allowed}, err
		})
		for _, c := range checks {
			if s := c.Limiter.Stats(); s.Slices != 1 {
				b.Fatalf("%d slices: some groups were not answered locally", s.Slices)
			}
		}
	})
	b.Run("memory", func(b *testing.B) {
		var ms []*ratelimit.MemoryLimiter
		for _, name := range names {
			c := cfg
			c.Name = name
			m, err := ratelimit.NewMemory(c, ratelimit.MemoryOptions{})
			if err != nil {
				b.Fatal(err)
			}
			ms = append(ms, m)
		}
		benchChecks(b, func() (ratelimit.Decision, error) {
			for i, m := range ms {
				if d, err := m.Allow(ctx, "k-"+names[i]); err != nil || !d.Allowed {
					return d, err
				}
			}
			return ratelimit.Decision{Allowed: true}, nil
		})
	})
}

func benchChecks(b *testing.B, check func() (ratelimit.Decision, error)) {
	b.Helper()
	b.ReportAllocs()
	for b.Loop() {
		if d, err := check(); err != nil || !d.Allowed {
			b.Fatal(d, err)
		}
	}
	// The latency of single checks, timed one by one outside the loop
	// that ns/op measures.
	lat := make([]time.Duration, 100_000)
	for i := range lat {
		t0 := time.Now()
		d, err := check()
		lat[i] = time.Since(t0)
		if err != nil || !d.Allowed {
			b.Fatal(d, err)
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}
