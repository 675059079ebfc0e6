package httplimit_test

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// The fields are checked here with an independent parser of structured
// fields (RFC 9651), against the examples of
// draft-ietf-httpapi-ratelimit-headers-11, sections 3.2 and 4.2 (the same
// as -10's: -11 changed what r and t mean, not how they are written).

// parseField parses a RateLimit-Policy or RateLimit field value as the
// draft defines both: a List of Items whose values are Strings.
func parseField(t *testing.T, value string) httpsfv.List {
	t.Helper()
	l, err := httpsfv.UnmarshalList([]string{value})
	require.NoError(t, err, "field %q does not parse as a structured-field List", value)
	for _, m := range l {
		it, ok := m.(httpsfv.Item)
		require.True(t, ok, "field %q has an inner list", value)
		_, ok = it.Value.(string)
		require.True(t, ok, "field %q has a member whose value is not a String", value)
	}
	return l
}

type member struct {
	name   string
	params []param
}

type param struct {
	name  string
	value any
}

// members is a parsed field as names and ordered parameters, without the
// parameters drop lists.
func members(t *testing.T, value string, drop ...string) []member {
	t.Helper()
	var out []member
	for _, m := range parseField(t, value) {
		it := m.(httpsfv.Item)
		mb := member{name: it.Value.(string)}
	names:
		for _, n := range it.Params.Names() {
			for _, d := range drop {
				if n == d {
					continue names
				}
			}
			v, _ := it.Params.Get(n)
			mb.params = append(mb.params, param{n, v})
		}
		out = append(out, mb)
	}
	return out
}

// requireSameField asserts that got carries what the draft's example
// carries: the same members, with the same parameters in the same order
// and with the same values, whatever the spacing and base64 spelling.
func requireSameField(t *testing.T, example, got string, drop ...string) {
	t.Helper()
	require.Equal(t, members(t, example), members(t, got, drop...), "example %s, got %s", example, got)
}

// fixedPK returns the partition key spelled, in base64, as in an example
// (some are not canonical base64: their bytes are what counts).
func fixedPK(t *testing.T, b64 string) httplimit.PartitionKeyFunc {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(b64)
	require.NoError(t, err)
	return func(string) []byte { return b }
}

func TestDraftPolicyExamples(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	lim := func(name string, limit int64, window time.Duration) *ratelimit.Limiter {
		return testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Limit: limit, Window: window}, ratelimit.DatabaseOptions{Now: c.Now})
	}
	key := httplimit.Constant("k")
	for _, tc := range []struct {
		example string
		cfg     httplimit.Config
	}{
		{`"default";q=100;w=10`, httplimit.Config{Limiter: lim("default", 100, 10*time.Second), Key: key}},
		{`"permin";q=50;w=60,"perhr";q=1000;w=3600`, httplimit.Config{Key: key, Rules: []httplimit.Rule{
			{Limiter: lim("permin", 50, time.Minute)}, {Limiter: lim("perhr", 1000, time.Hour)},
		}}},
		{`"peruser";q=100;w=60;pk=:cHsdsRa894==:`, httplimit.Config{Limiter: lim("peruser", 100, time.Minute), Key: key,
			PartitionKey: fixedPK(t, "cHsdsRa894==")}},
		{`"peruser";q=65535;qu="content-bytes";w=10;pk=:sdfjLJUOUH==:`, httplimit.Config{
			Limiter: lim("peruser-bytes", 65535, 10*time.Second), Policy: "peruser", Key: key,
			QuotaUnit: httplimit.UnitContentBytes, PartitionKey: fixedPK(t, "sdfjLJUOUH==")}},
	} {
		srv, _ := server(t, tc.cfg)
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status)
		requireSameField(t, tc.example, r.header.Get("RateLimit-Policy"))
		// Every RateLimit member names a policy of RateLimit-Policy, and
		// carries the same partition key.
		policies := map[string]member{}
		for _, m := range members(t, r.header.Get("RateLimit-Policy")) {
			policies[m.name] = m
		}
		for _, m := range members(t, r.header.Get("RateLimit")) {
			p, ok := policies[m.name]
			require.True(t, ok, "RateLimit names %q, which RateLimit-Policy does not list", m.name)
			require.Equal(t, pkOf(p), pkOf(m), m.name)
		}
	}
}

func pkOf(m member) any {
	for _, p := range m.params {
		if p.name == "pk" {
			return p.value
		}
	}
	return nil
}

func TestDraftRateLimitExamples(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	// 30 s into a minute, and the start of a minute.
	half := testkit.NewClock(time.Date(2031, 3, 4, 5, 6, 30, 0, time.UTC))
	start := testkit.NewClock(time.Date(2031, 3, 4, 5, 7, 0, 0, time.UTC))
	cost := func(n int64) httplimit.CostFunc { return func(*http.Request) int64 { return n } }
	for i, tc := range []struct {
		example string
		drop    []string // parameters pgrl sends that the example lacks
		cfg     httplimit.Config
		clock   *testkit.Clock
		limit   int64
	}{
		// A remaining quota of 50 units, reset in 30 s.
		{example: `"default";r=50;t=30`, cfg: httplimit.Config{Cost: cost(50)}, clock: half, limit: 100},
		// 999 requests left for a partition. The example has no t (a
		// quota that never resets); every rate limit of pgrl resets, and
		// says when. (A concurrency limit sends no t when it admits a
		// request: TestConcurrencyDraftExampleWithoutReset.)
		{example: `"default";r=999;pk=:dHJpYWwxMjEzMjM=:`, drop: []string{"t"},
			cfg: httplimit.Config{PartitionKey: fixedPK(t, "dHJpYWwxMjEzMjM=")}, clock: half, limit: 1000},
		// 300 MB left for an application in the next 60 seconds.
		{example: `"default";r=300000000;t=60;pk=:QXBwLTk5OQ==:`, clock: start, limit: 1_000_000_000,
			cfg: httplimit.Config{Cost: cost(700_000_000), QuotaUnit: httplimit.UnitContentBytes, PartitionKey: fixedPK(t, "QXBwLTk5OQ==")}},
	} {
		name := fmt.Sprintf("default-%d", i) // a counter of its own
		tc.cfg.Limiter = testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Limit: tc.limit, Window: time.Minute}, ratelimit.DatabaseOptions{Now: tc.clock.Now})
		tc.cfg.Key, tc.cfg.Policy = httplimit.Constant("k"), "default"
		srv, _ := server(t, tc.cfg)
		r := get(t, srv)
		require.Equal(t, http.StatusOK, r.status)
		requireSameField(t, tc.example, r.header.Get("RateLimit"), tc.drop...)
	}
}

// TestSeveralPoliciesParse: several limits, a partition key per limit and
// hostile policy names give fields an independent parser reads back to the
// same names, figures and keys.
func TestSeveralPoliciesParse(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	a := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "a", Limit: 5, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	b := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "b", Limit: 1 << 40, Window: 24 * time.Hour, Algorithm: ratelimit.TokenBucket}, ratelimit.DatabaseOptions{Now: c.Now})
	s := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "s", Limit: 7, Window: time.Hour, Algorithm: ratelimit.SlidingWindow}, ratelimit.DatabaseOptions{Now: c.Now})
	hostile := `a "quoted", \back\slashed;q=1;w=1, "x"`
	srv, _ := server(t, httplimit.Config{
		Key:          httplimit.ByHeader("X-Client"),
		PartitionKey: httplimit.HashedPartitionKey,
		Rules: []httplimit.Rule{
			{Limiter: a, Policy: hostile},
			{Limiter: b, Key: httplimit.Constant("all"), QuotaUnit: httplimit.UnitContentBytes, Cost: func(*http.Request) int64 { return 1 << 20 }},
			{Limiter: s, PartitionKey: func(string) []byte { return nil }}, // no key for this one
		},
	})
	r := get(t, srv, "X-Client", "tenant-42")
	require.Equal(t, http.StatusOK, r.status)
	pk := func(k string) []byte { s := sha256.Sum256([]byte(k)); return s[:12] }
	require.Equal(t, []member{
		{hostile, []param{{"q", int64(5)}, {"w", int64(60)}, {"pk", pk("tenant-42")}}},
		{"b", []param{{"q", int64(1 << 40)}, {"qu", "content-bytes"}, {"w", int64(86400)}, {"pk", pk("all")}}},
		{"s", []param{{"q", int64(7)}, {"w", int64(3600)}}},
	}, members(t, r.header.Get("RateLimit-Policy")))
	// RateLimit: the limit with the fewest left first, then rule order.
	require.Equal(t, []member{
		{hostile, []param{{"r", int64(4)}, {"t", int64(50)}, {"pk", pk("tenant-42")}}},
		{"b", []param{{"r", int64(1<<40 - 1<<20)}, {"t", int64(1)}, {"pk", pk("all")}}},
		// A sliding window is whole again once the unit's weight is gone:
		// at the end of the next hour, 1 h 53 min 49.5 s away.
		{"s", []param{{"r", int64(6)}, {"t", int64(6830)}}},
	}, members(t, r.header.Get("RateLimit")))
}

func TestProblemDetails(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	c := testkit.NewClock(base)
	perMinute := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "per-minute", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	daily := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "daily", Limit: 1, Window: 24 * time.Hour}, ratelimit.DatabaseOptions{Now: c.Now})
	hourly := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "hourly", Limit: 9, Window: time.Hour}, ratelimit.DatabaseOptions{Now: c.Now})
	srv, reached := server(t, httplimit.Config{
		Key: httplimit.Constant("k"), Mode: ratelimit.ConsumeAll, ProblemDetails: true,
		Rules: []httplimit.Rule{{Limiter: perMinute}, {Limiter: hourly}, {Limiter: daily, Policy: `day "1"`}},
	})
	require.Equal(t, http.StatusOK, get(t, srv).status)
	r := get(t, srv)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	var p struct {
		Type       string   `json:"type"`
		Title      string   `json:"title"`
		Status     int      `json:"status"`
		Violated   []string `json:"violated-policies"`
		RetryAfter int64    `json:"retry_after"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.body), &p), r.body)
	require.Equal(t, httplimit.ProblemQuotaExceeded, p.Type)
	require.Equal(t, http.StatusTooManyRequests, p.Status)
	require.NotEmpty(t, p.Title)
	require.Equal(t, []string{"per-minute", `day "1"`}, p.Violated)
	// The day ends at midnight: 18 h 53 min 49.5 s away, rounded up.
	require.Equal(t, int64(68_030), p.RetryAfter)
	require.Equal(t, "68030", r.header.Get("Retry-After"))
	require.Equal(t, 1, *reached)
}
