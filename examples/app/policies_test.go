package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// logBuffer collects the app's log and reports the address it listens on.
type logBuffer struct {
	mu   sync.Mutex
	b    strings.Builder
	addr chan string
}

var listeningLine = regexp.MustCompile(`msg=listening addr=(\S+)`)

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Write(p)
	if m := listeningLine.FindSubmatch(p); m != nil {
		select {
		case l.addr <- string(m[1]):
		default:
		}
	}
	return len(p), nil
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// testApp is the app running in this process (run), on a real HTTP server
// on a free port.
type testApp struct {
	addr   string
	log    *logBuffer
	stop   context.CancelFunc
	exited chan int
}

// startApp runs the app against dbURL ("": the app's default, from
// DATABASE_URL) until the test ends (or stopApp), and waits until it
// listens.
func startApp(t *testing.T, dbURL string, args ...string) *testApp {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	a := &testApp{log: &logBuffer{addr: make(chan string, 1)}, stop: cancel, exited: make(chan int, 1)}
	all := []string{"--addr", "127.0.0.1:0"}
	if dbURL != "" {
		all = append(all, "--database-url", dbURL)
	}
	go func() {
		a.exited <- run(ctx, append(all, args...), a.log)
	}()
	t.Cleanup(func() { stopApp(t, a) })
	select {
	case a.addr = <-a.log.addr:
		return a
	case code := <-a.exited:
		a.exited <- code
		t.Fatalf("app exited with %d before listening:\n%s", code, a.log)
	case <-time.After(60 * time.Second):
		t.Fatalf("app did not listen within a minute:\n%s", a.log)
	}
	return nil
}

// stopApp ends the app as SIGTERM would and requires a clean exit.
func stopApp(t *testing.T, a *testApp) {
	t.Helper()
	a.stop()
	select {
	case code := <-a.exited:
		a.exited <- code
		if code != 0 {
			t.Errorf("app exited with %d:\n%s", code, a.log)
		}
	case <-time.After(15 * time.Second):
		t.Errorf("app did not stop within 15 s:\n%s", a.log)
	}
}

type apiResponse struct {
	status int
	policy string // RateLimit-Policy
	rate   string // RateLimit
}

// callAPI sends GET /api/v1/items with the API key (none when "").
func callAPI(t *testing.T, a *testApp, apiKey string) apiResponse {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+a.addr+"/api/v1/items", nil)
	if err != nil {
		t.Fatal(err)
	}
	if apiKey != "" {
		req.Header.Set("X-API-Key", apiKey)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return apiResponse{resp.StatusCode, resp.Header.Get("RateLimit-Policy"), resp.Header.Get("RateLimit")}
}

// get returns the body of GET path.
func get(t *testing.T, a *testApp, path string) string {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + a.addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// sql runs a statement, as a DBA would in psql.
func sql(t *testing.T, db *pgxpool.Pool, stmt string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), stmt, args...); err != nil {
		t.Fatalf("%s: %v", stmt, err)
	}
}

// TestPolicyUpdateAppliesWithoutRestart: the app stores its default limits
// in pgrl_policy at start-up; a plain SQL UPDATE of one of them reaches the
// running app through its listener within seconds (polled, not slept), and
// is enforced; a restart keeps the DBA's value rather than the default.
func TestPolicyUpdateAppliesWithoutRestart(t *testing.T) {
	schema := dbtest.NewSchema(t)
	db := dbtest.PoolOn(t, schema)
	a := startApp(t, dbtest.URL(), "--schema", schema)
	if r := callAPI(t, a, "first"); r.status != http.StatusOK || r.policy != `"public-api";q=120;w=60` {
		t.Fatalf("before the update: %+v, want 200 with the default 120 per minute", r)
	}
	if m := get(t, a, "/metrics"); !strings.Contains(m, "\npgrl_policy_listener_connected 1\n") || !strings.Contains(m, "\npgrl_policy_cache_policies 8\n") {
		t.Errorf("/metrics lacks the policy listener's series:\n%s", m)
	}
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM pgrl_policy`).Scan(&n); err != nil || n != 8 {
		t.Fatalf("pgrl_policy holds %d policies (%v), want the app's 8 shared limits", n, err)
	}

	sql(t, db, `UPDATE pgrl_policy SET "limit" = 3 WHERE name = 'public-api'`)
	start := time.Now()
	for {
		r := callAPI(t, a, "poll")
		if r.policy == `"public-api";q=3;w=60` {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("5 s after the UPDATE the app still reports %q; log:\n%s", r.policy, a.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the running app applied the UPDATE after %v", time.Since(start).Round(time.Millisecond))
	for i, want := range []int{200, 200, 200, 429} {
		if r := callAPI(t, a, "fresh"); r.status != want || r.policy != `"public-api";q=3;w=60` {
			t.Fatalf("request %d after the update: %+v, want %d under q=3", i+1, r, want)
		}
	}
	stopApp(t, a)

	// A restart seeds only what is missing: the DBA's 3 stays. Without the
	// listener the app still reads the stored limits, once.
	b := startApp(t, dbtest.URL(), "--schema", schema, "--policy-listener=false")
	if r := callAPI(t, b, "after-restart"); r.policy != `"public-api";q=3;w=60` {
		t.Fatalf("after a restart: %+v, want the stored q=3, not the default", r)
	}
	if !strings.Contains(b.log.String(), "policy listener off") {
		t.Errorf("--policy-listener=false not logged:\n%s", b.log)
	}
}

// TestAPIKeyOverride: one INSERT into pgrl_policy_override, as docs/HTTP.md
// shows, gives one API key ten times the public API's quota while the app
// runs; other keys keep the policy's limit.
func TestAPIKeyOverride(t *testing.T) {
	schema := dbtest.NewSchema(t)
	db := dbtest.PoolOn(t, schema)
	a := startApp(t, dbtest.URL(), "--schema", schema)
	// A small quota keeps the test short: 2 a minute, 20 for the partner.
	sql(t, db, `UPDATE pgrl_policy SET "limit" = 2 WHERE name = 'public-api'`)
	sql(t, db, `INSERT INTO pgrl_policy_override (policy, key, "limit", note)
VALUES ('public-api', pgrl_stored_key('public-api', 'key:' || $1), 10 * (SELECT "limit" FROM pgrl_policy WHERE name = 'public-api'), 'partner, 10x')`, "partner-1")

	// Every request of the partner counts against the same counter, before
	// the override arrives (limit 2) and after (limit 20): 20 in all are
	// allowed, then 429.
	allowed, start := 0, time.Now()
	var last apiResponse
	for {
		last = callAPI(t, a, "partner-1")
		if last.status == http.StatusOK {
			allowed++
		}
		if last.policy == `"public-api";q=20;w=60` && last.status == http.StatusTooManyRequests {
			break
		}
		if time.Since(start) > 10*time.Second || allowed > 20 {
			t.Fatalf("after %v and %d allowed requests: %+v; log:\n%s", time.Since(start), allowed, last, a.log)
		}
		if last.policy != `"public-api";q=20;w=60` {
			time.Sleep(20 * time.Millisecond) // still the policy's limit: the override is on its way
		}
	}
	if allowed != 20 {
		t.Errorf("the partner key was allowed %d requests, want its override's 20", allowed)
	}
	if m := regexp.MustCompile(`^"public-api";r=(\d+);t=\d+$`).FindStringSubmatch(last.rate); m == nil || m[1] != "0" {
		t.Errorf("partner's RateLimit %q, want r=0", last.rate)
	}
	for i, want := range []int{200, 200, 429} {
		if r := callAPI(t, a, "someone-else"); r.status != want || r.policy != `"public-api";q=2;w=60` {
			t.Errorf("other key, request %d: %+v, want %d under the policy's q=2", i+1, r, want)
		}
	}
	if r := callAPI(t, a, ""); r.policy != `"public-api";q=2;w=60` {
		t.Errorf("anonymous caller: %+v, want the policy's q=2", r)
	}
}

// With DATABASE_URL pointing at a database of the user's own, with a
// search_path naming the user's schema, the app migrates only its own
// schema, pgrl_example_app, logs that name, and serves from it.
func TestAppWritesOnlyIntoItsOwnSchema(t *testing.T) {
	dbURL := dbtest.NewDatabase(t)
	sep := "?"
	if strings.Contains(dbURL, "?") {
		sep = "&"
	}
	t.Setenv("DATABASE_URL", dbURL+sep+"search_path=myapp,public")
	a := startApp(t, "")
	if r := callAPI(t, a, ""); r.status != http.StatusOK || r.policy != `"public-api";q=120;w=60` {
		t.Errorf("GET /api/v1/items: %+v, want 200 under the stored public-api policy", r)
	}
	stopApp(t, a)
	if n := dbtest.ObjectsIn(t, dbURL, "public"); n != 0 {
		t.Errorf("the app created %d objects in public", n)
	}
	if dbtest.ObjectsIn(t, dbURL, DefaultSchema) == 0 {
		t.Errorf("nothing in schema %s", DefaultSchema)
	}
	if !strings.Contains(a.log.String(), "msg=\"pgrl schema ready\" schema="+DefaultSchema+" ") {
		t.Errorf("the log does not name the schema:\n%s", a.log)
	}
}
