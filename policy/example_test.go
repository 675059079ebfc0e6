package policy_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// pool and directURL stand for the application's pool and a direct
// connection string in the examples: a fresh, migrated schema of the test
// database.
var (
	pool      *pgxpool.Pool
	directURL string
)

func TestMain(m *testing.M) {
	p, schema, done, err := dbtest.ForExamples()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pool, directURL = p, dbtest.URLWithSchema(schema)
	code := m.Run()
	done()
	os.Exit(code)
}

// exampleClock pins the examples' checks to one instant
// (DatabaseOptions.Now), so that their output does not depend on when they
// run. Applications leave Now unset.
func exampleClock() time.Time { return time.Date(2030, 1, 2, 3, 4, 30, 0, time.UTC) }

func ExampleNewLimiter() {
	ctx := context.Background()
	// Operations store the limit (or run `rl-policy set api --limit 2 --window 1m`).
	if _, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Minute}); err != nil {
		log.Fatal(err)
	}
	// One tenant gets more (or `rl-policy override set api tenant-42 --limit 3`).
	p, err := policy.Get(ctx, pool, "api")
	if err != nil {
		log.Fatal(err)
	}
	if _, err := policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("tenant-42"), Limit: 3, Note: "pro plan"}); err != nil {
		log.Fatal(err)
	}

	// The application: one cache of every policy, kept current by a listener.
	cache := policy.NewCache(pool)
	listener, err := policy.Watch(ctx, directURL, cache, policy.ListenerOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = listener.Close() }()
	if err := listener.WaitSynced(ctx); err != nil {
		log.Fatal(err)
	}
	// Once per database, at start-up: what every limit there shares.
	// (Timeout: how long a check may wait before the failure policy
	// answers; generous here, so that a busy machine prints the same.)
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: 10 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	api, err := policy.NewLimiter(ctx, pool, "api", policy.Options{
		Cache:    cache,
		Config:   ratelimit.Config{}, // everything a policy does not hold
		Database: limits,
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, key := range []string{"tenant-7", "tenant-42"} {
		for range 4 {
			d, err := api.Allow(ctx, key)
			if err != nil {
				log.Fatal(err)
			}
			fmt.Printf("%s allowed=%v used=%d limit=%d\n", key, d.Allowed, d.Used, d.Limit)
		}
	}
	// Output:
	// tenant-7 allowed=true used=1 limit=2
	// tenant-7 allowed=true used=2 limit=2
	// tenant-7 allowed=false used=2 limit=2
	// tenant-7 allowed=false used=2 limit=2
	// tenant-42 allowed=true used=1 limit=3
	// tenant-42 allowed=true used=2 limit=3
	// tenant-42 allowed=true used=3 limit=3
	// tenant-42 allowed=false used=3 limit=3
}

func ExampleExplain() {
	ctx := context.Background()
	if _, err := policy.Set(ctx, pool, policy.Policy{Name: "uploads", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Second, Burst: 50}); err != nil {
		log.Fatal(err)
	}
	p, err := policy.Get(ctx, pool, "uploads")
	if err != nil {
		log.Fatal(err)
	}
	if _, err := policy.SetOverride(ctx, pool, policy.Override{Policy: "uploads", Key: p.StoredKey("partner-1"), Burst: 500, Note: "nightly sync"}); err != nil {
		log.Fatal(err)
	}
	x, err := policy.Explain(ctx, pool, "uploads", "partner-1")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("override: %q\n", x.Override.Note)
	fmt.Printf("applies: %d per %v, burst %d\n", x.Rate.Limit, x.Rate.Window, x.Rate.Burst)
	fmt.Printf("remaining now: %d\n", x.Counter.Remaining)
	// Output:
	// override: "nightly sync"
	// applies: 10 per 1s, burst 500
	// remaining now: 500
}
