package ratelimit_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// pool stands for the application's *pgxpool.Pool in the examples: a fresh
// schema of the test database, with pgrl's migrations applied.
var pool *pgxpool.Pool

// exampleClock pins the examples' clock (DatabaseOptions.Now and
// MemoryOptions.Now), so that their output does not depend on when they
// run. Applications leave Now unset.
func exampleClock() time.Time { return time.Date(2030, 1, 2, 3, 4, 30, 0, time.UTC) }

// exampleTimeout bounds the examples' checks (DatabaseOptions.Timeout).
// Their output is what PostgreSQL decided; on a busy test machine a first
// statement can outlast DefaultTimeout and be answered by the failure
// policy instead. Applications keep the default, or set their own.
const exampleTimeout = 10 * time.Second

func TestMain(m *testing.M) {
	p, _, done, err := dbtest.ForExamples()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pool = p
	code := m.Run()
	done()
	os.Exit(code)
}

func ExampleLimiter_Allow() {
	ctx := context.Background()
	// Once per database, at start-up: what every limit there shares.
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	login, err := limits.Limiter(ratelimit.Config{
		Name:   "login:ip",  // scopes the keys: two limiters never share a counter
		Limit:  3,           // 3 attempts…
		Window: time.Minute, // …per minute, in windows aligned on the database clock
	})
	if err != nil {
		log.Fatal(err) // bad limits are typed errors: ratelimit.ErrInvalidLimit, ...
	}
	for range 4 {
		d, err := login.Allow(ctx, "203.0.113.7")
		if err != nil {
			log.Fatal(err) // setup and input errors only: outages are answered by the failure policy
		}
		fmt.Printf("allowed=%v used=%d remaining=%d retry-after=%ss\n",
			d.Allowed, d.Used, d.Remaining, d.RetryAfterHeader())
	}
	// Output:
	// allowed=true used=1 remaining=2 retry-after=0s
	// allowed=true used=2 remaining=1 retry-after=0s
	// allowed=true used=3 remaining=0 retry-after=0s
	// allowed=false used=3 remaining=0 retry-after=30s
}

func ExampleAllowAll() {
	ctx := context.Background()
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	perIP, err := limits.Limiter(ratelimit.Config{Name: "signup:ip", Limit: 2, Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	perEmail, err := limits.Limiter(ratelimit.Config{
		Name: "signup:email", Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Hour,
	})
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		// One round trip; under AllOrNothing a denied request consumes nothing.
		m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
			ratelimit.Check{Limiter: perIP, Key: "203.0.113.7"},
			ratelimit.Check{Limiter: perEmail, Key: "ada@example.com"})
		if err != nil {
			log.Fatal(err)
		}
		// Granted is what each limit took: 0 for all of them when denied.
		fmt.Printf("allowed=%v denied-by=%d email-charged=%d\n", m.Allowed, m.DeniedBy, m.Decisions[1].Granted)
	}
	d, err := perEmail.Peek(ctx, "ada@example.com")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("email used after the denial:", d.Used)
	// Output:
	// allowed=true denied-by=-1 email-charged=1
	// allowed=true denied-by=-1 email-charged=1
	// allowed=false denied-by=0 email-charged=0
	// email used after the denial: 2
}

func ExampleLimiter_AllowTx() {
	ctx := context.Background()
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	uploads, err := limits.Limiter(ratelimit.Config{Name: "upload:bytes", Limit: 10 << 20, Window: time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	d, err := uploads.AllowTx(ctx, tx, "user:42", ratelimit.Cost(4<<20)) // 4 MiB
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("allowed:", d.Allowed, "used MiB:", d.Used>>20)
	// The work failed: rolling back refunds the units.
	if err := tx.Rollback(ctx); err != nil {
		log.Fatal(err)
	}
	d, err = uploads.Peek(ctx, "user:42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("used MiB after rollback:", d.Used>>20)
	// Output:
	// allowed: true used MiB: 4
	// used MiB after rollback: 0
}

func ExampleNewMemory() {
	ctx := context.Background()
	beacons, err := ratelimit.NewMemory(ratelimit.Config{
		Name:      "beacon:ip",
		Algorithm: ratelimit.TokenBucket,
		Limit:     60, // 60 per minute, one a second…
		Burst:     2,  // …and at most 2 at once
		Window:    time.Minute,
	}, ratelimit.MemoryOptions{MaxKeys: 10_000, Now: exampleClock})
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		d, err := beacons.Allow(ctx, "198.51.100.1")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(d.Allowed, d.Remaining, d.RetryAfter, d.Store)
	}
	// Output:
	// true 1 0s memory
	// true 0 0s memory
	// false 0 1s memory
}

// An LLM token budget: the tokens a call uses are known only from the
// model's answer. Reserve an estimate before the call, settle with the
// usage it reports; a retried request (same id) is neither reserved nor
// settled twice.
func ExampleLimiter_Settle() {
	ctx := context.Background()
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	tokens, err := limits.Limiter(ratelimit.Config{
		Name:      "llm:tokens",
		Algorithm: ratelimit.FixedWindow,
		Limit:     10_000, // tokens per tenant…
		Window:    time.Hour,
	})
	if err != nil {
		log.Fatal(err)
	}
	// callModel stands for the model's API: it reports the tokens used.
	callModel := func(prompt string) (usage int64) { return int64(40 * len(prompt)) }

	for _, job := range []struct{ id, prompt string }{
		{"req-1", "summarise this contract"},            // uses less than estimated
		{"req-2", "translate the whole manual, please"}, // uses more
		{"req-2", "translate the whole manual, please"}, // a retry of req-2
	} {
		d, err := tokens.Reserve(ctx, "tenant-42", job.id, 1_000) // the estimate: max_tokens
		if err != nil {
			log.Fatal(err)
		}
		if !d.Allowed {
			fmt.Println(job.id, "denied: retry in", d.RetryAfter)
			continue
		}
		usage := callModel(job.prompt)
		s, err := tokens.Settle(ctx, "tenant-42", job.id, usage)
		if err != nil {
			log.Fatal(err) // retry it: settling is idempotent
		}
		fmt.Printf("%s: reserved=%d actual=%d refunded=%d charged=%d replayed=%v\n",
			job.id, s.Reserved, s.Actual, s.Refunded, s.Charged, s.Replayed)
	}
	d, err := tokens.Peek(ctx, "tenant-42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("used this hour:", d.Used)
	// Output:
	// req-1: reserved=1000 actual=920 refunded=80 charged=0 replayed=false
	// req-2: reserved=1000 actual=1360 refunded=0 charged=360 replayed=false
	// req-2: reserved=1000 actual=1360 refunded=0 charged=360 replayed=true
	// used this hour: 2280
}
