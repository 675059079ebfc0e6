package httplimit_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// pool stands for the application's *pgxpool.Pool in the example: a fresh
// schema of the test database, with pgrl's migrations applied.
var pool *pgxpool.Pool

// exampleClock pins the example's clock (DatabaseOptions.Now), so that its output
// does not depend on when it runs. Applications leave Now unset.
func exampleClock() time.Time { return time.Date(2030, 1, 2, 3, 4, 30, 0, time.UTC) }

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

func Example() {
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock})
	if err != nil {
		log.Fatal(err)
	}
	lim, err := limits.Limiter(ratelimit.Config{Name: "public-api", Limit: 2, Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	ips, err := clientip.New(clientip.Config{TrustedProxies: []string{"10.0.0.0/8"}, IPv6Prefix: 64})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httplimit.New(httplimit.Config{
		Limiter: lim,                 // *ratelimit.Limiter or *ratelimit.MemoryLimiter
		Key:     httplimit.ByIP(ips), // who is counted
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /api/v1/{resource}", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})))

	for range 3 {
		req := httptest.NewRequest("GET", "/api/v1/items", nil)
		req.RemoteAddr = "203.0.113.7:51234"
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Printf("%d Retry-After: %q\n", rec.Code, rec.Header().Get("Retry-After"))
		if rec.Code == http.StatusTooManyRequests {
			fmt.Printf("RateLimit-Policy: %s\nRateLimit: %s\n", rec.Header().Get("RateLimit-Policy"), rec.Header().Get("RateLimit"))
		}
	}
	// Output:
	// 200 Retry-After: ""
	// 200 Retry-After: ""
	// 429 Retry-After: "30"
	// RateLimit-Policy: "public-api";q=2;w=60
	// RateLimit: "public-api";r=0;t=30
}
