package httplimit_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
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

func Example() {
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
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

// An upload endpoint limited two ways at once: requests per minute per
// account, and content bytes per hour per account, each reported with the
// account's partition key (a digest, never the account id itself), and
// denials answered with the draft's quota-exceeded problem.
func Example_severalPolicies() {
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	perMinute, err := limits.Limiter(ratelimit.Config{Name: "uploads", Limit: 10, Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	bytesPerHour, err := limits.Limiter(ratelimit.Config{Name: "upload-bytes", Limit: 50 << 20, Window: time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httplimit.New(httplimit.Config{
		Key:          httplimit.ByHeader("X-Account"),
		PartitionKey: httplimit.HashedPartitionKey,
		Rules: []httplimit.Rule{
			{Limiter: perMinute},
			{Limiter: bytesPerHour, QuotaUnit: httplimit.UnitContentBytes,
				Cost: func(r *http.Request) int64 { return max(r.ContentLength, 1) }},
		},
		ProblemDetails: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	upload := mw.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "stored") })

	for _, size := range []int64{30 << 20, 30 << 20} {
		req := httptest.NewRequest("PUT", "/files/report.pdf", nil)
		req.ContentLength = size
		req.Header.Set("X-Account", "acct-1001")
		rec := httptest.NewRecorder()
		upload.ServeHTTP(rec, req)
		fmt.Println(rec.Code)
		fmt.Println("RateLimit-Policy:", rec.Header().Get("RateLimit-Policy"))
		fmt.Println("RateLimit:", rec.Header().Get("RateLimit"))
		if rec.Code != http.StatusOK {
			fmt.Print(rec.Body.String())
		}
	}
	// Output:
	// 200
	// RateLimit-Policy: "uploads";q=10;w=60;pk=:gr4P0iOon5k0cj2S:, "upload-bytes";q=52428800;qu="content-bytes";w=3600;pk=:gr4P0iOon5k0cj2S:
	// RateLimit: "uploads";r=9;t=30;pk=:gr4P0iOon5k0cj2S:, "upload-bytes";r=20971520;t=3330;pk=:gr4P0iOon5k0cj2S:
	// 429
	// RateLimit-Policy: "uploads";q=10;w=60;pk=:gr4P0iOon5k0cj2S:, "upload-bytes";q=52428800;qu="content-bytes";w=3600;pk=:gr4P0iOon5k0cj2S:
	// RateLimit: "upload-bytes";r=20971520;t=3330;pk=:gr4P0iOon5k0cj2S:, "uploads";r=9;t=30;pk=:gr4P0iOon5k0cj2S:
	// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Rate limit exceeded","status":429,"violated-policies":["upload-bytes"],"retry_after":3330}
}

// An export endpoint that runs at most two exports per account at once,
// across every instance of the service: a third, sent while two run, is
// refused until one of them ends.
func Example_concurrency() {
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	exports, err := limits.Limiter(ratelimit.Config{
		Name:      "exports",
		Algorithm: ratelimit.Concurrency,
		Limit:     2,                // exports in flight at once, per account
		Window:    10 * time.Second, // a slot's lease: how long one outlives an instance that died holding it
	})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httplimit.New(httplimit.Config{Limiter: exports, Key: httplimit.ByHeader("X-Account")})
	if err != nil {
		log.Fatal(err)
	}
	running, finish := make(chan struct{}), make(chan struct{})
	export := mw.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Has("slow") {
			running <- struct{}{}
			<-finish // the export's work, until the example ends it
		}
		fmt.Fprintln(w, "exported")
	})
	send := func(target string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", target, nil)
		req.Header.Set("X-Account", "acct-1001")
		rec := httptest.NewRecorder()
		export.ServeHTTP(rec, req)
		return rec
	}

	// Two exports start, one after the other, and run until finish closes.
	var wg sync.WaitGroup
	slow := make([]*httptest.ResponseRecorder, 2)
	for i := range slow {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slow[i] = send("/exports?slow")
		}()
		<-running
	}
	third := send("/exports")
	fmt.Println(third.Code, "Retry-After:", third.Header().Get("Retry-After"))
	fmt.Println("RateLimit-Policy:", third.Header().Get("RateLimit-Policy"))
	fmt.Println("RateLimit:", third.Header().Get("RateLimit"))

	close(finish)
	wg.Wait()
	for i, rec := range slow {
		fmt.Printf("export %d: %d RateLimit: %s\n", i+1, rec.Code, rec.Header().Get("RateLimit"))
	}
	after := send("/exports")
	fmt.Printf("after them: %d RateLimit: %s\n", after.Code, after.Header().Get("RateLimit"))
	// Output:
	// 429 Retry-After: 10
	// RateLimit-Policy: "exports";q=2;qu="concurrent-requests"
	// RateLimit: "exports";r=0;t=10
	// export 1: 200 RateLimit: "exports";r=1
	// export 2: 200 RateLimit: "exports";r=0
	// after them: 200 RateLimit: "exports";r=1
}
