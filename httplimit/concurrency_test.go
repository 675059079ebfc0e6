package httplimit_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// slotLimiter is a concurrency limit of limit slots leased for a minute,
// on a clock pinned at base: a refusal's hint is then the whole lease, 60
// s, and a slot never lapses in PostgreSQL while the test runs, so that
// only a release frees one.
func slotLimiter(t *testing.T, db ratelimit.DB, name string, limit int64) *ratelimit.Limiter {
	t.Helper()
	return testkit.NewLimiter(t, db, ratelimit.Config{Name: name, Algorithm: ratelimit.Concurrency, Limit: limit, Window: time.Minute},
		ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
}

// held is how many slots of key the limit holds now, across processes.
func held(t *testing.T, l *ratelimit.Limiter, key string) int64 {
	t.Helper()
	d, err := l.Peek(context.Background(), key)
	require.NoError(t, err)
	return d.Used
}

// fetch is get for other goroutines than the test's: it returns its error.
func fetch(ctx context.Context, srv *httptest.Server, path string) (response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
	if err != nil {
		return response{}, err
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return response{resp.StatusCode, resp.Header, string(b)}, err
}

// serve is one request through h, served in the test's goroutine.
func serve(h http.Handler, path string) response {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return response{rec.Code, rec.Header(), rec.Body.String()}
}

// Many requests at once against a limit of 3 requests in flight, on a real
// server, with handlers that do not return until the test lets them: 3
// enter, and no more than 3 are ever inside at once; every other request is
// answered 429 while they are, with Retry-After and the fields of a
// concurrency limit. Once they return, their slots are free again.
func TestConcurrencyAdmitsAtMostTheLimitInFlight(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	const limit, clients = 3, 24
	lim := slotLimiter(t, pool, "exports", limit)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("tenant-1"), Logger: quietLogger()})
	require.NoError(t, err)
	var inside, most atomic.Int64
	entered := make(chan struct{}, clients)
	gate := make(chan struct{})
	srv := httptest.NewServer(mw.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		n := inside.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		entered <- struct{}{}
		<-gate
		inside.Add(-1)
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() {
		select {
		case <-gate:
		default:
			close(gate) // a failed test must not leave handlers blocked
		}
	})

	results := make(chan response, clients)
	failed := make(chan error, clients)
	for range clients {
		go func() {
			r, err := fetch(context.Background(), srv, "/")
			if err != nil {
				failed <- err
				return
			}
			results <- r
		}()
	}
	// Every request either enters the handler (and stays there) or is
	// refused: wait for all of them.
	admitted, refused := 0, []response{}
	timeout := time.After(2 * time.Minute)
	for admitted+len(refused) < clients {
		select {
		case <-entered:
			admitted++
		case r := <-results:
			require.Equal(t, http.StatusTooManyRequests, r.status, "a response while %d handlers hold every slot: %s", admitted, r.body)
			refused = append(refused, r)
		case err := <-failed:
			t.Fatal(err)
		case <-timeout:
			t.Fatalf("after 2 minutes, %d requests entered and %d were refused, of %d", admitted, len(refused), clients)
		}
	}
	require.Equal(t, limit, admitted)
	require.EqualValues(t, limit, most.Load(), "requests inside the handler at once")
	require.EqualValues(t, limit, held(t, lim, "tenant-1"))
	for _, r := range refused {
		requireHeaders(t, r, deniedHeaders(60, map[string]string{
			"RateLimit-Policy": `"exports";q=3;qu="concurrent-requests"`,
			"RateLimit":        `"exports";r=0;t=60`,
		}))
		require.Equal(t, deniedBody(60), r.body)
		// Read by an independent parser: no window, and t is Retry-After.
		require.Equal(t, []member{{"exports", []param{{"q", int64(limit)}, {"qu", "concurrent-requests"}}}},
			members(t, r.header.Get("RateLimit-Policy")))
		require.Equal(t, []member{{"exports", []param{{"r", int64(0)}, {"t", int64(60)}}}},
			members(t, r.header.Get("RateLimit")))
	}

	close(gate)
	var remaining []int64
	for range limit {
		select {
		case r := <-results:
			require.Equal(t, http.StatusOK, r.status)
			require.Equal(t, "ok", r.body)
			require.Equal(t, `"exports";q=3;qu="concurrent-requests"`, r.header.Get("RateLimit-Policy"))
			// An admitted request's member has no t: nothing says when a
			// request in flight will end.
			m := members(t, r.header.Get("RateLimit"))
			require.Len(t, m, 1)
			require.Equal(t, "exports", m[0].name)
			require.Len(t, m[0].params, 1, r.header.Get("RateLimit"))
			require.Equal(t, "r", m[0].params[0].name)
			remaining = append(remaining, m[0].params[0].value.(int64))
		case err := <-failed:
			t.Fatal(err)
		case <-time.After(time.Minute):
			t.Fatal("the admitted requests did not finish")
		}
	}
	// Each admitted request saw the places the ones before it left.
	require.ElementsMatch(t, []int64{2, 1, 0}, remaining)
	require.Zero(t, held(t, lim, "tenant-1"), "the slots are given back when the handlers return")
	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status, "a request after them finds a place")
	require.Equal(t, `"exports";r=2`, r.header.Get("RateLimit"))
}

// errBoom is the value the panicking handler panics with.
var errBoom = errors.New("boom")

// The slot is held while the handler runs and given back when it returns,
// and when it panics: the next request finds the only place free.
func TestConcurrencySlotReleasedWhenHandlerReturnsOrPanics(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := slotLimiter(t, pool, "one", 1)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"), Logger: quietLogger()})
	require.NoError(t, err)
	var mu sync.Mutex
	var during []int64 // slots held, seen from inside each handler
	var recovered []any
	h := mw.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, err := lim.Peek(r.Context(), "k")
		mu.Lock()
		if err != nil {
			during = append(during, -1)
		} else {
			during = append(during, d.Used)
		}
		mu.Unlock()
		if r.URL.Path == "/panic" {
			panic(errBoom)
		}
		_, _ = io.WriteString(w, "ok")
	})
	// recovered answers 500 for a panic, as a recovery middleware outside
	// the limit would, after the limit's deferred release has run.
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				mu.Lock()
				recovered = append(recovered, v)
				mu.Unlock()
				http.Error(w, "internal error", http.StatusInternalServerError)
			}
		}()
		h.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(outer)
	t.Cleanup(srv.Close)

	for i, path := range []string{"/", "/panic", "/panic", "/", "/"} {
		r, err := fetch(context.Background(), srv, path)
		require.NoError(t, err)
		if path == "/panic" {
			require.Equal(t, http.StatusInternalServerError, r.status, "request %d", i)
		} else {
			require.Equal(t, http.StatusOK, r.status, "request %d", i)
			require.Equal(t, "ok", r.body)
			require.Equal(t, `"one";r=0`, r.header.Get("RateLimit"), "request %d took the only place", i)
		}
		// The response is written once the limit's handler has returned
		// (or its panic reached the recovery): the place is free by then.
		require.Zero(t, held(t, lim, "k"), "after request %d (%s)", i, path)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int64{1, 1, 1, 1, 1}, during, "each handler ran holding the slot")
	require.Equal(t, []any{errBoom, errBoom}, recovered)
}

// A client that goes away while the handler runs cancels the request's
// context; the slot is still given back, with a context the request's end
// does not cancel.
func TestConcurrencyClientDisconnectReleases(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := slotLimiter(t, pool, "disconnect", 2)
	logs := &testkit.LogBuffer{}
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.NoError(t, err)
	entered, served := make(chan struct{}), make(chan error, 1)
	h := mw.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		close(entered)
		<-r.Context().Done() // the client went away
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r)
		served <- r.Context().Err()
	}))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gone := make(chan error, 1)
	go func() {
		_, err := fetch(ctx, srv, "/")
		gone <- err
	}()
	select {
	case <-entered:
	case <-time.After(time.Minute):
		t.Fatal("the request did not reach the handler")
	}
	require.EqualValues(t, 1, held(t, lim, "k"))
	cancel()
	require.ErrorIs(t, <-gone, context.Canceled)
	select {
	case err := <-served:
		require.ErrorIs(t, err, context.Canceled, "the server saw the client go")
	case <-time.After(time.Minute):
		t.Fatal("the handler did not return after the client went away")
	}
	require.Zero(t, held(t, lim, "k"), "the slot of a request whose client went away is given back")
	require.NotContains(t, logs.String(), "giving back")
}

// The fields of a concurrency limit with a partition key, the legacy
// fields and the problem details, on a refusal and on an admission; slots
// held by other code count against the same limit.
func TestConcurrencyFields(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	lim := slotLimiter(t, pool, "renders", 2)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("acct-7"), Logger: quietLogger(),
		QuotaUnit: httplimit.UnitConcurrentRequests, PartitionKey: func(string) []byte { return []byte{1, 2, 3} },
		Headers: httplimit.HeadersDraftAndLegacy, ProblemDetails: true})
	require.NoError(t, err)
	reached := 0
	h := mw.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		reached++
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "2") // as a server would; a recorder does not
		_, _ = io.WriteString(w, "ok")
	})
	a, d, err := lim.Acquire(ctx, "acct-7")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	b, d, err := lim.Acquire(ctx, "acct-7")
	require.NoError(t, err)
	require.True(t, d.Allowed)

	r := serve(h, "/render")
	require.Equal(t, http.StatusTooManyRequests, r.status)
	body := `{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Rate limit exceeded","status":429,"violated-policies":["renders"],"retry_after":60}` + "\n"
	require.Equal(t, body, r.body)
	requireHeaders(t, r, map[string]string{
		"Content-Type":          "application/problem+json",
		"Content-Length":        strconv.Itoa(len(body)),
		"Retry-After":           "60",
		"RateLimit-Policy":      `"renders";q=2;qu="concurrent-requests";pk=:AQID:`,
		"RateLimit":             `"renders";r=0;t=60;pk=:AQID:`,
		"X-RateLimit-Limit":     "2",
		"X-RateLimit-Remaining": "0",
		// When to retry, as an instant: base + 60 s, rounded up.
		"X-RateLimit-Reset": strconv.FormatInt(base.Add(time.Minute).Unix()+1, 10),
	})
	require.Zero(t, reached)

	require.NoError(t, a.Release(ctx))
	r = serve(h, "/render")
	require.Equal(t, http.StatusOK, r.status)
	// No t, and no X-RateLimit-Reset: nothing says when a place frees.
	requireHeaders(t, r, okHeaders(map[string]string{
		"RateLimit-Policy":      `"renders";q=2;qu="concurrent-requests";pk=:AQID:`,
		"RateLimit":             `"renders";r=0;pk=:AQID:`,
		"X-RateLimit-Limit":     "2",
		"X-RateLimit-Remaining": "0",
	}))
	require.Equal(t, 1, reached)
	require.EqualValues(t, 1, held(t, lim, "acct-7"), "the request gave its slot back; b still holds one")
	require.NoError(t, b.Release(ctx))
	require.Zero(t, held(t, lim, "acct-7"))
}

// The draft's example of a service limit that has no time window reset
// is what a concurrency limit of 1000 requests in flight sends with one of
// them taken: r=999 and no t.
func TestConcurrencyDraftExampleWithoutReset(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := slotLimiter(t, pool, "concurrency-default", 1000)
	var inside string
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"), Policy: "default",
		PartitionKey: fixedPK(t, "dHJpYWwxMjEzMjM=")})
	require.NoError(t, err)
	serve(mw.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { inside = w.Header().Get("RateLimit") }), "/")
	requireSameField(t, `"default";r=999;pk=:dHJpYWwxMjEzMjM=:`, inside)
}

// A concurrency limit nested around a rate limit: each middleware adds its
// members to the fields; a request the rate refuses reports the rate
// first, and gives back the slot it held for the check.
func TestConcurrencyNestedAroundARate(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	slots := slotLimiter(t, pool, "inflight", 2)
	rate := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	key := httplimit.Constant("k")
	inflight, err := httplimit.New(httplimit.Config{Limiter: slots, Key: key, Logger: quietLogger()})
	require.NoError(t, err)
	rates, err := httplimit.New(httplimit.Config{Limiter: rate, Key: key, Logger: quietLogger()})
	require.NoError(t, err)
	h := inflight.Handler(rates.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "2")
		_, _ = io.WriteString(w, "ok")
	})))
	const policy = `"inflight";q=2;qu="concurrent-requests", "rate";q=1;w=60`

	r := serve(h, "/")
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{
		"RateLimit-Policy": policy,
		"RateLimit":        `"inflight";r=1, "rate";r=0;t=50`,
	}))
	r = serve(h, "/")
	require.Equal(t, http.StatusTooManyRequests, r.status)
	requireHeaders(t, r, deniedHeaders(50, map[string]string{
		"RateLimit-Policy": policy,
		"RateLimit":        `"rate";r=0;t=50, "inflight";r=1`,
	}))
	require.Len(t, members(t, r.header.Get("RateLimit")), 2)
	require.Zero(t, held(t, slots, "k"), "the refused request gave its slot back")
}

// What the limiter's failure policy does when PostgreSQL cannot be reached:
// under FailToMemory the slots are held in the process's memory, at most
// Limit, and given back there; under FailOpen the request goes through
// with no field; under FailError it reaches OnError.
func TestConcurrencyFailurePolicies(t *testing.T) {
	t.Parallel()
	dead := testkit.DeadPool(t)
	cfg := func(name string, onFailure ratelimit.FailurePolicy) ratelimit.Config {
		return ratelimit.Config{Name: name, Algorithm: ratelimit.Concurrency, Limit: 1, Window: time.Minute, OnFailure: onFailure}
	}
	quiet := ratelimit.DatabaseOptions{Logger: quietLogger()}
	entered := make(chan struct{})
	gate := make(chan struct{})
	blocking := func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/block" {
			entered <- struct{}{}
			<-gate
		}
		_, _ = io.WriteString(w, "ok")
	}
	handler := func(l *ratelimit.Limiter) http.Handler {
		mw, err := httplimit.New(httplimit.Config{Limiter: l, Key: httplimit.Constant("k"), Logger: quietLogger()})
		require.NoError(t, err)
		return mw.HandlerFunc(blocking)
	}

	mem := handler(testkit.NewLimiter(t, dead, cfg("memory", ratelimit.FailToMemory), quiet))
	done := make(chan response)
	go func() { done <- serve(mem, "/block") }()
	<-entered
	r := serve(mem, "/")
	require.Equal(t, http.StatusTooManyRequests, r.status, "the process holds the only slot, in memory")
	n, err := strconv.Atoi(r.header.Get("Retry-After"))
	require.NoError(t, err)
	require.Positive(t, n)
	require.Contains(t, r.header.Get("RateLimit"), `"memory";r=0;t=`)
	gate <- struct{}{}
	require.Equal(t, http.StatusOK, (<-done).status)
	r = serve(mem, "/")
	require.Equal(t, http.StatusOK, r.status, "the slot was given back in memory")
	require.Equal(t, `"memory";r=0`, r.header.Get("RateLimit"))

	open := handler(testkit.NewLimiter(t, dead, cfg("open", ratelimit.FailOpen), quiet))
	go func() { done <- serve(open, "/block") }()
	<-entered
	r = serve(open, "/")
	require.Equal(t, http.StatusOK, r.status, "failing open holds nothing")
	require.Empty(t, r.header.Get("RateLimit"))
	require.Empty(t, r.header.Get("RateLimit-Policy"))
	gate <- struct{}{}
	require.Equal(t, http.StatusOK, (<-done).status)

	r = serve(handler(testkit.NewLimiter(t, dead, cfg("error", ratelimit.FailError), quiet)), "/")
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, `{"error":"rate_limiter_unavailable"}`+"\n", r.body)
}

// A slot that cannot be given back is logged, not answered: the response
// is the handler's.
func TestConcurrencyReleaseErrorIsLogged(t *testing.T) {
	t.Parallel()
	_, schema := dbtest.Pool(t)
	own := dbtest.PoolOn(t, schema)
	lim := slotLimiter(t, own, "lost-release", 1)
	logs := &testkit.LogBuffer{}
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.NoError(t, err)
	r := serve(mw.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		own.Close() // the release that follows cannot reach PostgreSQL
		_, _ = io.WriteString(w, "ok")
	}), "/")
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, "ok", r.body)
	require.Contains(t, logs.String(), `level=WARN msg="pgrl: giving back a request's slot failed; it lapses after the limit's Window" policy=lost-release lease=1m0s`)
}

// New refuses the configurations a concurrency limit cannot serve, each
// with the fix.
func TestNewRefusesConcurrencyMisuse(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	slots := slotLimiter(t, pool, "inflight", 2)
	rate := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate", Limit: 1, Window: time.Minute})
	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "mem-slots", Algorithm: ratelimit.Concurrency, Limit: 2, Window: time.Minute}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	key := httplimit.Constant("k")
	one := func(*http.Request) int64 { return 1 }
	for _, c := range []struct {
		cfg  httplimit.Config
		want string
	}{
		{httplimit.Config{Key: key, Rules: []httplimit.Rule{{Limiter: rate}, {Limiter: slots}}},
			`rule 1 ("inflight") is a concurrency limit; Rules are rates decided together by ratelimit.AllowAll, and a slot is held while the handler runs: give it a middleware of its own (Config.Limiter) and nest the two, inflight.Handler(rules.Handler(h))`},
		{httplimit.Config{Key: key, Rules: []httplimit.Rule{{Keyed: perKey{slots}}}}, `rule 0 ("inflight") is a concurrency limit`},
		{httplimit.Config{Limiter: slots, Key: key, RequestIDHeader: httplimit.HeaderIdempotencyKey},
			`RequestIDHeader "Idempotency-Key" with "inflight", a concurrency limit; a request sent again is another request in flight, holding a slot of its own, so it cannot be counted once: drop RequestIDHeader`},
		{httplimit.Config{Limiter: slots, Key: key, QuotaUnit: httplimit.UnitRequests},
			`quota unit "requests" for "inflight", a concurrency limit; it counts requests in flight, always reported as "concurrent-requests": leave the quota unit empty`},
		{httplimit.Config{Limiter: slots, Key: key, QuotaUnit: httplimit.UnitContentBytes}, `quota unit "content-bytes" for "inflight", a concurrency limit`},
		{httplimit.Config{Limiter: rate, Key: key, QuotaUnit: httplimit.UnitConcurrentRequests},
			`quota unit "concurrent-requests" for "rate", a fixed_window limit; it counts requests per window, not requests in flight`},
		{httplimit.Config{Key: key, Rules: []httplimit.Rule{{Limiter: rate, QuotaUnit: httplimit.UnitConcurrentRequests}}}, `rule 0: httplimit: invalid configuration: quota unit "concurrent-requests" for "rate"`},
		{httplimit.Config{Limiter: slots, Key: key, Cost: one},
			`Cost is set with "inflight", a concurrency limit; every request in flight holds one slot: drop Cost, and skip the requests that should not count by returning false from Key`},
		{httplimit.Config{Limiter: mem, Key: key},
			`Limiter "mem-slots" is a concurrency limit held by a *ratelimit.MemoryLimiter; the middleware holds slots of a *ratelimit.Limiter only: use one (Database.Limiter)`},
		{httplimit.Config{Limiter: keyedChecker{perKey{slots}}, Key: key}, `a concurrency limit held by a httplimit_test.keyedChecker; the middleware holds slots of a *ratelimit.Limiter only`},
	} {
		_, err := httplimit.New(c.cfg)
		require.ErrorIs(t, err, httplimit.ErrInvalidConfig, c.want)
		require.ErrorContains(t, err, c.want)
	}
	// The unit it is reported in anyway is accepted.
	_, err = httplimit.New(httplimit.Config{Limiter: slots, Key: key, QuotaUnit: httplimit.UnitConcurrentRequests})
	require.NoError(t, err)
}

// TestHTTPDocConcurrency holds the refusal shown under "Concurrency limits"
// in docs/HTTP.md to what the middleware of Example_concurrency answers
// when every slot is held.
func TestHTTPDocConcurrency(t *testing.T) {
	doc, err := os.ReadFile("../docs/HTTP.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(doc), "### Concurrency limits")
	require.True(t, ok, "docs/HTTP.md has a Concurrency limits section")
	_, after, ok = strings.Cut(after, "HTTP/1.1 429")
	require.True(t, ok, "the section shows a 429")
	block, _, ok := strings.Cut("HTTP/1.1 429"+after, "```")
	require.True(t, ok)

	lim, err := testkit.New(pool, ratelimit.Config{Name: "exports", Algorithm: ratelimit.Concurrency, Limit: 2, Window: 10 * time.Second},
		ratelimit.DatabaseOptions{Timeout: time.Minute, Now: exampleClock})
	require.NoError(t, err)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("doc-concurrency")})
	require.NoError(t, err)
	ctx := context.Background()
	for range 2 {
		s, d, err := lim.Acquire(ctx, "doc-concurrency")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		defer func() { require.NoError(t, s.Release(ctx)) }()
	}
	rec := httptest.NewRecorder()
	mw.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("a refused request reached the handler") }).
		ServeHTTP(rec, httptest.NewRequest("POST", "/exports", nil))
	var got strings.Builder
	fmt.Fprintf(&got, "HTTP/1.1 %d %s\n", rec.Code, http.StatusText(rec.Code))
	for _, name := range []string{"Content-Type", "Content-Length", "Retry-After", "RateLimit-Policy", "RateLimit"} {
		fmt.Fprintf(&got, "%s: %s\n", name, rec.Header().Get(name))
	}
	fmt.Fprintf(&got, "\n%s", rec.Body.String())
	require.Equal(t, got.String(), block, "docs/HTTP.md's refusal is what the middleware answers")
}

// The handler finds the slot it runs under in its request's context, held
// while it runs and released once it returns; without a concurrency limit
// there is none.
func TestSlotFromContext(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := slotLimiter(t, pool, "ctx", 2)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"), Logger: quietLogger()})
	require.NoError(t, err)
	var seen *ratelimit.Slot
	var errInside error
	srv := httptest.NewServer(mw.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = httplimit.SlotFrom(r.Context())
		if seen != nil {
			errInside = seen.Err()
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	r, err := fetch(context.Background(), srv, "/")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, r.status)
	require.NotNil(t, seen)
	require.Equal(t, "k", seen.Key())
	require.NoError(t, errInside, "held while the handler runs")
	require.ErrorIs(t, seen.Err(), ratelimit.ErrSlotReleased, "released once it returned")
	require.Nil(t, httplimit.SlotFrom(context.Background()))
}
