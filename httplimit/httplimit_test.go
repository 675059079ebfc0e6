package httplimit_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// base is 10.5 s into a minute: a one-minute fixed window started 10.5 s
// ago and resets in 49.5 s, so that whole-second rounding is visible.
var base = time.Date(2031, 3, 4, 5, 6, 10, 500_000_000, time.UTC)

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// server serves "ok" behind the middleware built from cfg, on a real HTTP
// server, and counts the requests that reached the handler.
func server(t *testing.T, cfg httplimit.Config) (*httptest.Server, *int) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	m, err := httplimit.New(cfg)
	require.NoError(t, err)
	reached := new(int)
	var mu sync.Mutex
	srv := httptest.NewServer(m.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		*reached++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	return srv, reached
}

type response struct {
	status int
	header http.Header
	body   string
}

func get(t *testing.T, srv *httptest.Server, hdr ...string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return response{resp.StatusCode, resp.Header, string(b)}
}

// requireHeaders asserts that the response carries exactly these headers
// with exactly these values, besides Date (which the server adds, and which
// must parse).
func requireHeaders(t *testing.T, r response, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for k, v := range r.header {
		if k == "Date" {
			_, err := http.ParseTime(v[0])
			require.NoError(t, err, "Date")
			continue
		}
		require.Len(t, v, 1, "header %s appears %d times", k, len(v))
		got[k] = v[0]
	}
	canon := map[string]string{}
	for k, v := range want {
		canon[http.CanonicalHeaderKey(k)] = v
	}
	require.Equal(t, canon, got)
}

func okHeaders(extra map[string]string) map[string]string {
	h := map[string]string{"Content-Type": "text/plain", "Content-Length": "2"}
	for k, v := range extra {
		h[k] = v
	}
	return h
}

func deniedHeaders(retryAfter int, extra map[string]string) map[string]string {
	body := fmt.Sprintf(`{"error":"rate_limited","retry_after":%d}`+"\n", retryAfter)
	h := map[string]string{
		"Content-Type":   "application/json",
		"Content-Length": strconv.Itoa(len(body)),
		"Retry-After":    strconv.Itoa(retryAfter),
	}
	for k, v := range extra {
		h[k] = v
	}
	return h
}

func deniedBody(retryAfter int) string {
	return fmt.Sprintf(`{"error":"rate_limited","retry_after":%d}`+"\n", retryAfter)
}

func TestFixedWindowHeaders(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "api", Limit: 3, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.ByIP(nil)})

	const policy = `"api";q=3;w=60`
	for i := 1; i <= 3; i++ {
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status, "request %d", i)
		require.Equal(t, "ok", r.body)
		requireHeaders(t, r, okHeaders(map[string]string{
			"RateLimit-Policy": policy,
			"RateLimit":        fmt.Sprintf(`"api";r=%d;t=50`, 3-i), // 49.5 s rounded up
		}))
	}
	r := get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, deniedBody(50), r.body)
	requireHeaders(t, r, deniedHeaders(50, map[string]string{
		"RateLimit-Policy": policy,
		"RateLimit":        `"api";r=0;t=50`,
	}))
	require.Equal(t, 3, *reached)

	// 49 s later, 0.5 s remain: Retry-After rounds up to 1, never 0.
	c.Add(49 * time.Second)
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	requireHeaders(t, r, deniedHeaders(1, map[string]string{
		"RateLimit-Policy": policy,
		"RateLimit":        `"api";r=0;t=1`,
	}))
	// The next window admits again.
	c.Add(time.Second)
	r = get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{
		"RateLimit-Policy": policy,
		"RateLimit":        `"api";r=2;t=60`, // 59.5 s
	}))
}

func TestLegacyHeaders(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "legacy", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.ByIP(nil), Headers: httplimit.HeadersDraftAndLegacy})
	reset := strconv.FormatInt(time.Date(2031, 3, 4, 5, 7, 0, 0, time.UTC).Unix(), 10)

	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{
		"RateLimit-Policy":      `"legacy";q=2;w=60`,
		"RateLimit":             `"legacy";r=1;t=50`,
		"X-RateLimit-Limit":     "2",
		"X-RateLimit-Remaining": "1",
		"X-RateLimit-Reset":     reset,
	}))
	get(t, srv)
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	requireHeaders(t, r, deniedHeaders(50, map[string]string{
		"RateLimit-Policy":      `"legacy";q=2;w=60`,
		"RateLimit":             `"legacy";r=0;t=50`,
		"X-RateLimit-Limit":     "2",
		"X-RateLimit-Remaining": "0",
		"X-RateLimit-Reset":     reset,
	}))
}

// TestRetryAfterIsDecisionRoundedUp: for a token bucket, whose retry-after
// is rarely whole seconds, Retry-After equals the decision's RetryAfter
// rounded up, at several instants, as the DenyHandler sees the decision.
func TestRetryAfterIsDecisionRoundedUp(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	// 2 tokens per 3 s: one token every 1.5 s.
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 2, Window: 3 * time.Second, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: c.Now})
	var seen ratelimit.MultiDecision
	srv, _ := server(t, httplimit.Config{
		Limiter: l, Key: httplimit.Constant("k"),
		DenyHandler: func(w http.ResponseWriter, r *http.Request, d ratelimit.MultiDecision) {
			seen = d
			httplimit.DefaultDenyHandler(w, r, d)
		},
	})
	const policy = `"tb";q=2;w=3`

	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	// One token left; full again in 1.5 s.
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": policy, "RateLimit": `"tb";r=1;t=2`}))
	r = get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": policy, "RateLimit": `"tb";r=0;t=3`}))

	for _, step := range []struct {
		advance time.Duration
		retry   time.Duration // expected decision RetryAfter
		header  int
	}{
		{0, 1500 * time.Millisecond, 2},
		{1200 * time.Millisecond, 300 * time.Millisecond, 1},
		{299 * time.Millisecond, time.Millisecond, 1},
	} {
		c.Add(step.advance)
		r = get(t, srv)
		require.Equal(t, http.StatusTooManyRequests, r.status)
		require.Equal(t, step.retry, seen.RetryAfter())
		require.Equal(t, strconv.FormatInt(int64((seen.RetryAfter()+time.Second-1)/time.Second), 10), r.header.Get("Retry-After"))
		requireHeaders(t, r, deniedHeaders(step.header, map[string]string{
			"RateLimit-Policy": policy,
			"RateLimit":        fmt.Sprintf(`"tb";r=0;t=%d`, step.header),
		}))
	}
}

func TestBurstPolicyWindow(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	// 10 per minute, bursts of 30: an empty bucket refills 30 in 3 minutes.
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "burst", Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: 30, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
	r := get(t, srv)
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": `"burst";q=30;w=180`, "RateLimit": `"burst";r=29;t=6`}))
}

func TestSlidingWindowHeaders(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "sw", Algorithm: ratelimit.SlidingWindow, Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
	get(t, srv)
	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	// Two counted in the window that started 10.5 s ago: fully reset when
	// the next window ends, 109.5 s from now.
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": `"sw";q=2;w=60`, "RateLimit": `"sw";r=0;t=110`}))
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	// A third fits when the previous window's weight falls to 1 of 2:
	// 30 s into the next window, 79.5 s from now.
	requireHeaders(t, r, deniedHeaders(80, map[string]string{"RateLimit-Policy": `"sw";q=2;w=60`, "RateLimit": `"sw";r=0;t=80`}))
}

func TestMemoryLimiterAsChecker(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base)
	l, err := ratelimit.NewMemory(ratelimit.Config{Name: "beacon", Limit: 1, Window: time.Minute}, ratelimit.MemoryOptions{Now: c.Now})
	require.NoError(t, err)
	srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.ByIP(nil)})
	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": `"beacon";q=1;w=60`, "RateLimit": `"beacon";r=0;t=50`}))
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	requireHeaders(t, r, deniedHeaders(50, map[string]string{"RateLimit-Policy": `"beacon";q=1;w=60`, "RateLimit": `"beacon";r=0;t=50`}))
}

// TestRulesReportTheMostRestrictive: a per-client limit and a global
// ceiling decided together; the RateLimit field reports the limit with the
// fewest units left, or the one that denied.
func TestRulesReportTheMostRestrictive(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	perClient := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "per-client", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	global := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "global", Limit: 4, Window: 10 * time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, reached := server(t, httplimit.Config{
		Rules: []httplimit.Rule{
			{Limiter: perClient, Key: httplimit.ByHeader("X-Client")},
			{Limiter: global, Key: httplimit.Constant("all"), Policy: "ceiling"},
		},
	})
	const both = `"per-client";q=2;w=60, "ceiling";q=4;w=600`
	// The global window is 10 minutes aligned on the epoch: 05:00-05:10,
	// so it resets in 3 min 49.5 s.
	for i, step := range []struct{ client, field string }{
		{"a", `"per-client";r=1;t=50, "ceiling";r=3;t=230`},
		{"b", `"per-client";r=1;t=50, "ceiling";r=2;t=230`},
		{"b", `"per-client";r=0;t=50, "ceiling";r=1;t=230`},
		{"a", `"ceiling";r=0;t=230, "per-client";r=0;t=50`}, // tie at 0: the one that resets later first
	} {
		r := get(t, srv, "X-Client", step.client)
		require.Equal(t, http.StatusOK, r.status, "request %d", i)
		requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": both, "RateLimit": step.field}))
	}
	// The ceiling denies a new client; Retry-After is its retry-after.
	r := get(t, srv, "X-Client", "c")
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, deniedBody(230), r.body)
	// Client c's own limit allowed, but all or nothing gave its unit back:
	// both of its units are left.
	requireHeaders(t, r, deniedHeaders(230, map[string]string{"RateLimit-Policy": both, "RateLimit": `"ceiling";r=0;t=230, "per-client";r=2;t=50`}))
	// A request without X-Client skips the per-client rule only.
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	requireHeaders(t, r, deniedHeaders(230, map[string]string{"RateLimit-Policy": `"ceiling";q=4;w=600`, "RateLimit": `"ceiling";r=0;t=230`}))
	require.Equal(t, 4, *reached)
}

// TestRulesDeniedByTwo: when two limits deny, the fields and Retry-After
// report the one that makes the client wait longer.
func TestRulesDeniedByTwo(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	short := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "short", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	long := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "long", Limit: 1, Window: time.Hour}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{
		Key:   httplimit.ByIP(nil),
		Mode:  ratelimit.ConsumeAll,
		Rules: []httplimit.Rule{{Limiter: short}, {Limiter: long}},
	})
	const both = `"short";q=1;w=60, "long";q=1;w=3600`
	r := get(t, srv)
	require.Equal(t, http.StatusOK, r.status)
	requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": both, "RateLimit": `"long";r=0;t=3230, "short";r=0;t=50`}))
	r = get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	// The hour window ends at 06:00, 53 min 49.5 s away.
	requireHeaders(t, r, deniedHeaders(3230, map[string]string{"RateLimit-Policy": both, "RateLimit": `"long";r=0;t=3230, "short";r=0;t=50`}))
}

func TestRulesDeniedByPerClient(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	perClient := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "per-client", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	global := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "global", Limit: 100, Window: time.Hour}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{
		Key: httplimit.ByHeader("X-Client"),
		Rules: []httplimit.Rule{
			{Limiter: perClient},
			{Limiter: global, Key: httplimit.Constant("all")},
		},
	})
	const both = `"per-client";q=1;w=60, "global";q=100;w=3600`
	require.Equal(t, http.StatusOK, get(t, srv, "X-Client", "a").status)
	r := get(t, srv, "X-Client", "a")
	require.Equal(t, http.StatusTooManyRequests, r.status)
	// The global limit's unit was given back (all or nothing): r says so.
	requireHeaders(t, r, deniedHeaders(50, map[string]string{"RateLimit-Policy": both, "RateLimit": `"per-client";r=0;t=50, "global";r=99;t=3230`}))
	// All or nothing: the denied request did not consume the global limit.
	d, err := global.Peek(context.Background(), "all")
	require.NoError(t, err)
	require.Equal(t, int64(99), d.Remaining)
}

func TestSkippedKeyAndZeroCostPassThrough(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "skip", Limit: 1, Window: time.Minute})
	srv, reached := server(t, httplimit.Config{
		Limiter: l, Key: httplimit.ByHeader("X-Api-Key"),
		Cost: func(r *http.Request) int64 {
			n, _ := strconv.ParseInt(r.Header.Get("X-Cost"), 10, 64)
			return n
		},
	})
	for range 3 {
		r := get(t, srv) // no key
		require.Equal(t, http.StatusOK, r.status)
		requireHeaders(t, r, okHeaders(nil))
		r = get(t, srv, "X-Api-Key", "k", "X-Cost", "0")
		require.Equal(t, http.StatusOK, r.status)
		requireHeaders(t, r, okHeaders(nil))
	}
	require.Equal(t, 6, *reached)
	require.Equal(t, http.StatusOK, get(t, srv, "X-Api-Key", "k", "X-Cost", "1").status)
	require.Equal(t, http.StatusTooManyRequests, get(t, srv, "X-Api-Key", "k", "X-Cost", "1").status)
}

func TestHeaderModes(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	for _, mode := range []httplimit.HeaderMode{httplimit.HeadersDeniedOnly, httplimit.HeadersNone} {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: fmt.Sprintf("mode%d", mode), Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
		srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k"), Headers: mode})
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status)
		requireHeaders(t, r, okHeaders(nil))
		r = get(t, srv)
		require.Equal(t, http.StatusTooManyRequests, r.status)
		want := deniedHeaders(50, nil)
		if mode == httplimit.HeadersDeniedOnly {
			want["RateLimit-Policy"] = fmt.Sprintf(`"mode%d";q=1;w=60`, mode)
			want["RateLimit"] = fmt.Sprintf(`"mode%d";r=0;t=50`, mode)
		}
		requireHeaders(t, r, want)
	}
}

func TestCustomDenyHandler(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "html", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{
		Limiter: l, Key: httplimit.Constant("k"),
		DenyHandler: func(w http.ResponseWriter, _ *http.Request, d ratelimit.MultiDecision) {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprintf(w, "<p>slow down (%d)</p>", d.DeniedBy)
		},
	})
	get(t, srv)
	r := get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, "<p>slow down (0)</p>", r.body)
	requireHeaders(t, r, map[string]string{
		"Content-Type": "text/html", "Content-Length": "20", "Retry-After": "50",
		"RateLimit-Policy": `"html";q=1;w=60`, "RateLimit": `"html";r=0;t=50`,
	})
}

func TestShadowModeAllowsWithHeaders(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "shadow", Limit: 1, Window: time.Minute, Shadow: true}, ratelimit.DatabaseOptions{Logger: quietLogger(), Now: c.Now})
	srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
	for range 3 {
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status)
		requireHeaders(t, r, okHeaders(map[string]string{"RateLimit-Policy": `"shadow";q=1;w=60`, "RateLimit": `"shadow";r=0;t=50`}))
	}
	require.Equal(t, 3, *reached)
}

func TestStoreErrors(t *testing.T) {
	t.Parallel()
	dead := testkit.DeadPool(t)
	ctx := context.Background()
	_ = ctx

	t.Run("fail with error: 503 by default", func(t *testing.T) {
		l := testkit.NewLimiter(t, dead, ratelimit.Config{Name: "err", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{Logger: quietLogger()})
		srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
		r := get(t, srv)
		require.Equal(t, http.StatusServiceUnavailable, r.status)
		require.Equal(t, `{"error":"rate_limiter_unavailable"}`+"\n", r.body)
		requireHeaders(t, r, map[string]string{"Content-Type": "application/json", "Content-Length": "37"})
		require.Zero(t, *reached)
	})
	t.Run("custom OnError lets the request through", func(t *testing.T) {
		l := testkit.NewLimiter(t, dead, ratelimit.Config{Name: "err2", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{Logger: quietLogger()})
		var got error
		var mw *httplimit.Middleware
		mw, err := httplimit.New(httplimit.Config{Limiter: l, Key: httplimit.Constant("k"), Logger: quietLogger(),
			OnError: func(w http.ResponseWriter, r *http.Request, err error) {
				got = err
				w.Header().Set("X-Limit-Skipped", "1")
				w.WriteHeader(http.StatusAccepted)
			}})
		require.NoError(t, err)
		srv := httptest.NewServer(mw.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("next called") }))
		defer srv.Close()
		r := get(t, srv)
		require.Equal(t, http.StatusAccepted, r.status)
		require.Error(t, got)
		require.Contains(t, got.Error(), "ratelimit")
		requireHeaders(t, r, map[string]string{"X-Limit-Skipped": "1", "Content-Length": "0"})
	})
	t.Run("fail open: allowed without rate-limit fields", func(t *testing.T) {
		l := testkit.NewLimiter(t, dead, ratelimit.Config{Name: "open", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailOpen}, ratelimit.DatabaseOptions{Logger: quietLogger()})
		srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status)
		requireHeaders(t, r, okHeaders(nil))
		require.Equal(t, 1, *reached)
	})
	t.Run("fail closed: 429 for the breaker cooldown", func(t *testing.T) {
		l := testkit.NewLimiter(t, dead, ratelimit.Config{Name: "closed", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailClosed}, ratelimit.DatabaseOptions{BreakerCooldown: 2500 * time.Millisecond, Logger: quietLogger()})
		srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k")})
		r := get(t, srv)
		require.Equal(t, http.StatusTooManyRequests, r.status)
		requireHeaders(t, r, deniedHeaders(3, map[string]string{"RateLimit-Policy": `"closed";q=5;w=60`, "RateLimit": `"closed";r=0;t=3`}))
	})
}

func TestCostExceedingTheLimit(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "cost", Limit: 10, Window: time.Minute})
	srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k"), Cost: func(*http.Request) int64 { return 11 }})
	r := get(t, srv)
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status)
	require.Equal(t, `{"error":"cost_exceeds_limit"}`+"\n", r.body)
	requireHeaders(t, r, map[string]string{"Content-Type": "application/json", "Content-Length": "31"})
	require.Zero(t, *reached)
}

// perKey is a KeyedLimiter that gives the key "vip" three times its
// limiter's limit, over twice its window.
type perKey struct{ l *ratelimit.Limiter }

func (p perKey) Config() ratelimit.Config { return p.l.Config() }

func (p perKey) For(key string) (*ratelimit.Limiter, error) {
	if key != "vip" {
		return p.l, nil
	}
	r := p.l.Rate()
	return p.l.WithRate(ratelimit.Rate{Limit: 3 * r.Limit, Window: 2 * r.Window})
}

// A KeyedLimiter is checked with the limiter its For returns for each
// request's key, and RateLimit-Policy reports that limiter's rate.
func TestKeyedLimiterReportsTheRateApplied(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "keyed", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	for _, cfg := range []httplimit.Config{
		{Limiter: keyedChecker{perKey{l}}, Key: httplimit.ByHeader("X-Key")},
		{Rules: []httplimit.Rule{{Keyed: perKey{l}, Key: httplimit.ByHeader("X-Key")}}},
	} {
		srv, _ := server(t, cfg)
		send := func(k string) response {
			req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
			require.NoError(t, err)
			req.Header.Set("X-Key", k)
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			return response{status: resp.StatusCode, header: resp.Header}
		}
		for i, want := range []int{200, 200, 200, 429} {
			r := send("vip")
			require.Equal(t, want, r.status, "vip request %d", i+1)
			require.Equal(t, `"keyed";q=3;w=120`, r.header.Get("RateLimit-Policy"))
		}
		r := send("other")
		require.Equal(t, 200, r.status)
		require.Equal(t, `"keyed";q=1;w=60`, r.header.Get("RateLimit-Policy"))
		require.NoError(t, l.Reset(context.Background(), "other"))
		vip, err := perKey{l}.For("vip")
		require.NoError(t, err)
		require.NoError(t, vip.Reset(context.Background(), "vip"))
	}
}

// keyedChecker is a KeyedLimiter that is also a Checker (as
// *policy.Limiter is), for Config.Limiter.
type keyedChecker struct{ perKey }

func (k keyedChecker) Allow(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	l, err := k.For(key)
	if err != nil {
		return ratelimit.Decision{}, err
	}
	return l.Allow(ctx, key, opts...)
}

func (k keyedChecker) Peek(ctx context.Context, key string, opts ...ratelimit.Option) (ratelimit.Decision, error) {
	l, err := k.For(key)
	if err != nil {
		return ratelimit.Decision{}, err
	}
	return l.Peek(ctx, key, opts...)
}

func (k keyedChecker) Reset(ctx context.Context, key string, opts ...ratelimit.Option) error {
	l, err := k.For(key)
	if err != nil {
		return err
	}
	return l.Reset(ctx, key, opts...)
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "a", Limit: 1, Window: time.Minute})
	l2 := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "b", Limit: 1, Window: time.Minute})
	utf := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "connexion-é", Limit: 1, Window: time.Minute})
	key := httplimit.Constant("k")
	var nilLimiter *ratelimit.Limiter
	cases := []struct {
		cfg  httplimit.Config
		want string
	}{
		{httplimit.Config{}, "neither Limiter nor Rules"},
		{httplimit.Config{Limiter: l}, "no Key function"},
		{httplimit.Config{Limiter: nilLimiter, Key: key}, "nil pointer"},
		{httplimit.Config{Limiter: l, Key: key, Rules: []httplimit.Rule{{Limiter: l2, Key: key}}}, "both Limiter and Rules"},
		{httplimit.Config{Rules: []httplimit.Rule{{Limiter: l}}}, `rule 0 ("a") has no Key`},
		{httplimit.Config{Rules: []httplimit.Rule{{Key: key}}}, "rule 0 has no Limiter"},
		{httplimit.Config{Rules: []httplimit.Rule{{Key: key, Limiter: l, Keyed: perKey{l}}}}, "rule 0 sets more than one of Limiter, Keyed and Leased"},
		{httplimit.Config{Key: key, Rules: []httplimit.Rule{{Limiter: l}, {Limiter: l2, Policy: "a"}}}, `rules 0 and 1 are both named "a"`},
		{httplimit.Config{Key: key, Policy: "x", Rules: []httplimit.Rule{{Limiter: l}}}, "Policy is set with Rules"},
		{httplimit.Config{Limiter: utf, Key: key}, `policy name "connexion-é" has a byte`},
		{httplimit.Config{Limiter: l, Key: key, Policy: "tab\there"}, "has a byte (0x9)"},
		{httplimit.Config{Limiter: l, Key: key, Headers: 9}, "header mode 9"},
		{httplimit.Config{Limiter: l, Key: key, Mode: 7}, "multi mode 7"},
		{httplimit.Config{Limiter: l, Key: key, QuotaUnit: "tokens"}, `quota unit "tokens" is not one the draft registers`},
		{httplimit.Config{Key: key, Rules: []httplimit.Rule{{Limiter: l, QuotaUnit: "Requests"}}}, `rule 0: httplimit: invalid configuration: quota unit "Requests"`},
		{httplimit.Config{Limiter: l, Key: key, ProblemDetails: true, DenyHandler: httplimit.DefaultDenyHandler}, "both ProblemDetails and DenyHandler"},
	}
	for _, c := range cases {
		_, err := httplimit.New(c.cfg)
		require.ErrorIs(t, err, httplimit.ErrInvalidConfig, c.want)
		require.Contains(t, err.Error(), c.want)
	}
	// A policy name is escaped as a structured-field string.
	c := testkit.NewClock(base)
	q := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "q", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, _ := server(t, httplimit.Config{Limiter: q, Key: key, Policy: `say "hi" \o/`})
	require.Equal(t, `"say \"hi\" \\o/";q=1;w=60`, get(t, srv).header.Get("RateLimit-Policy"))
}

func TestKeyFuncs(t *testing.T) {
	t.Parallel()
	req := func(remote string, hdr ...string) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/items/42", nil)
		r.RemoteAddr = remote
		for i := 0; i+1 < len(hdr); i += 2 {
			r.Header.Set(hdr[i], hdr[i+1])
		}
		return r
	}
	res, err := clientip.New(clientip.Config{TrustedProxies: []string{"10.0.0.0/8"}, IPv6Prefix: 64})
	require.NoError(t, err)

	k, ok := httplimit.ByIP(res)(req("10.0.0.1:1", "X-Forwarded-For", "1.2.3.4, 2001:db8:1:2::99"))
	require.True(t, ok)
	require.Equal(t, "2001:db8:1:2::", k)
	k, _ = httplimit.ByIP(nil)(req("10.0.0.1:1", "X-Forwarded-For", "1.2.3.4"))
	require.Equal(t, "10.0.0.1", k)
	k, ok = httplimit.ByIP(nil)(req("@"))
	require.True(t, ok)
	require.Equal(t, "unknown", k)

	_, ok = httplimit.ByHeader("X-Api-Key")(req("10.0.0.1:1"))
	require.False(t, ok)
	k, ok = httplimit.ByHeader("X-Api-Key")(req("10.0.0.1:1", "X-Api-Key", "secret"))
	require.True(t, ok)
	require.Equal(t, "secret", k)

	k, _ = httplimit.ByRoute(req("10.0.0.1:1"))
	require.Equal(t, "POST /items/42", k)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /items/{id}", func(_ http.ResponseWriter, r *http.Request) { k, _ = httplimit.ByRoute(r) })
	mux.ServeHTTP(httptest.NewRecorder(), req("10.0.0.1:1"))
	require.Equal(t, "POST /items/{id}", k)

	a, ok := httplimit.Combine(httplimit.Constant("a:b"), httplimit.Constant("c"))(req(""))
	require.True(t, ok)
	b, _ := httplimit.Combine(httplimit.Constant("a"), httplimit.Constant("b:c"))(req(""))
	require.NotEqual(t, a, b)
	_, ok = httplimit.Combine(httplimit.Constant("a"), httplimit.ByHeader("X-None"))(req(""))
	require.False(t, ok)
}

// TestConcurrentRequestsAdmitExactlyTheLimit: 40 concurrent requests
// against a limit of 7 on a real server: exactly 7 reach the handler, every
// other gets a 429 with a positive Retry-After.
func TestConcurrentRequestsAdmitExactlyTheLimit(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "conc", Limit: 7, Window: time.Hour}, ratelimit.DatabaseOptions{Now: testkit.Pinned(time.Now())}) // pinned: no window ends mid-test
	srv, reached := server(t, httplimit.Config{Limiter: l, Key: httplimit.ByIP(nil)})
	var wg sync.WaitGroup
	statuses := make([]int, 40)
	retry := make([]string, 40)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := srv.Client().Get(srv.URL)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i], retry[i] = resp.StatusCode, resp.Header.Get("Retry-After")
		}()
	}
	wg.Wait()
	counts := map[int]int{}
	for i, s := range statuses {
		counts[s]++
		if s == http.StatusTooManyRequests {
			n, err := strconv.Atoi(retry[i])
			require.NoError(t, err)
			require.Positive(t, n)
			require.LessOrEqual(t, n, 3600)
		}
	}
	require.Equal(t, map[int]int{200: 7, 429: 33}, counts)
	require.Equal(t, 7, *reached)
}

func TestErrorsAreLogged(t *testing.T) {
	t.Parallel()
	var buf strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return buf.Write(p)
	}), nil))
	l := testkit.NewLimiter(t, testkit.DeadPool(t), ratelimit.Config{Name: "logged", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{Logger: quietLogger()})
	srv, _ := server(t, httplimit.Config{Limiter: l, Key: httplimit.Constant("k"), Logger: logger})
	require.Equal(t, http.StatusServiceUnavailable, get(t, srv).status)
	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, buf.String(), `msg="pgrl: rate limit check failed" policies=[logged]`)
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

var _ = errors.New
var _ = sort.Strings

// With RequestIDHeader, a request sent again with the same Idempotency-Key
// is counted once and gets the first decision; without the header every
// request counts; a value too long is a 400; limiters that cannot keep
// request ids are refused by New.
func TestRequestIDHeader(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "idem", Limit: 2, Window: time.Hour})
	srv, reached := server(t, httplimit.Config{Limiter: lim, Key: httplimit.Constant("k"),
		RequestIDHeader: httplimit.HeaderIdempotencyKey})
	send := func(id string) int {
		req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
		require.NoError(t, err)
		if id != "" {
			req.Header.Set(httplimit.HeaderIdempotencyKey, id)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	for range 5 {
		require.Equal(t, http.StatusOK, send("order-1"), "the same request, counted once")
	}
	require.Equal(t, http.StatusOK, send("order-2"))
	require.Equal(t, http.StatusTooManyRequests, send("order-3"), "the limit of 2 distinct requests")
	require.Equal(t, http.StatusTooManyRequests, send("order-3"), "the first decision again")
	require.Equal(t, http.StatusOK, send("order-1"), "still the first decision")
	require.Equal(t, http.StatusTooManyRequests, send(""), "without the header, a request counts")
	require.Equal(t, http.StatusBadRequest, send(strings.Repeat("x", ratelimit.MaxRequestIDLength+1)))
	require.Equal(t, 7, *reached)

	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "mem", Limit: 2, Window: time.Hour}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	_, err = httplimit.New(httplimit.Config{Limiter: mem, Key: httplimit.Constant("k"), RequestIDHeader: "Idempotency-Key"})
	require.ErrorIs(t, err, httplimit.ErrInvalidConfig)
	require.ErrorContains(t, err, "keeps request ids")
}

// TestRulesLeased: a login's three limits leased and decided together by
// lease.AllowAll: the fields are those of the plain rules, the pair's
// limit denies its sixth attempt, and once the keys are warm the checks
// are answered from slices (no statement).
func TestRulesLeased(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	d := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: c.Now})
	leased := func(cfg ratelimit.Config, size int64) *lease.Limiter {
		x, err := lease.New(testkit.Limiter(t, d, cfg), lease.Options{Size: size, Now: c.Now, Idle: time.Hour})
		require.NoError(t, err)
		t.Cleanup(func() { _ = x.Close(context.Background()) })
		return x
	}
	pair := leased(ratelimit.Config{Name: "login-pair", Limit: 5, Window: time.Minute}, 5)
	ip := leased(ratelimit.Config{Name: "login-ip", Limit: 100, Window: time.Minute}, 10)
	email := leased(ratelimit.Config{Name: "login-email", Limit: 100, Window: time.Minute}, 10)
	srv, reached := server(t, httplimit.Config{
		Rules: []httplimit.Rule{
			{Leased: pair, Key: httplimit.Combine(httplimit.ByHeader("X-Email"), httplimit.ByIP(nil))},
			{Leased: ip, Key: httplimit.ByIP(nil)},
			{Leased: email, Key: httplimit.ByHeader("X-Email")},
		},
	})
	const policies = `"login-pair";q=5;w=60, "login-ip";q=100;w=60, "login-email";q=100;w=60`
	for i := 1; i <= 5; i++ {
		r := get(t, srv, "X-Email", "a@example.com")
		require.Equal(t, http.StatusOK, r.status, "attempt %d", i)
		require.Equal(t, policies, r.header.Get("RateLimit-Policy"))
		require.Equal(t, fmt.Sprintf(`"login-pair";r=%d;t=50, "login-ip";r=%d;t=50, "login-email";r=%d;t=50`, 5-i, 100-i, 100-i),
			r.header.Get("RateLimit"), "attempt %d", i)
	}
	r := get(t, srv, "X-Email", "a@example.com")
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, "50", r.header.Get("Retry-After"))
	require.Equal(t, `"login-pair";r=0;t=50, "login-ip";r=95;t=50, "login-email";r=95;t=50`, r.header.Get("RateLimit"),
		"the denied attempt took nothing from the others")
	require.Equal(t, 5, *reached)
	st := ip.Stats()
	require.Equal(t, int64(1), st.Slices, "one slice answered the address's warm checks")
	require.Equal(t, int64(4), st.LocalDecisions, "attempts 3 to 5 and the denied one, from the slice")

	_, err := httplimit.New(httplimit.Config{Key: httplimit.ByIP(nil), Rules: []httplimit.Rule{
		{Leased: pair}, {Limiter: testkit.Limiter(t, d, ratelimit.Config{Name: "plain", Limit: 1, Window: time.Minute})},
	}})
	require.ErrorIs(t, err, httplimit.ErrInvalidConfig)
	require.Contains(t, err.Error(), "lease every rule (lease.New), or none")
	_, err = httplimit.New(httplimit.Config{Key: httplimit.ByIP(nil), Rules: []httplimit.Rule{{Leased: pair, Limiter: testkit.Limiter(t, d, ratelimit.Config{Name: "both", Limit: 1, Window: time.Minute})}}})
	require.ErrorIs(t, err, httplimit.ErrInvalidConfig)
	require.Contains(t, err.Error(), "set one")
}
