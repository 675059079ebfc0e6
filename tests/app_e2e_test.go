package tests

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// appProcess is one running copy of examples/app.
type appProcess struct {
	cmd  *exec.Cmd
	addr string
	done chan error

	mu     sync.Mutex
	stderr bytes.Buffer
}

func (p *appProcess) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

var appListening = regexp.MustCompile(`msg=listening addr=(\S+)`)

// appStart starts the app on a free port and waits until it listens. The
// process is killed if the test ends without stopping it. It may run on any
// goroutine: it reports failures as errors.
func appStart(t *testing.T, bin, dbURL string, args ...string) (*appProcess, error) {
	cmd := exec.Command(bin, append([]string{"--addr", "127.0.0.1:0", "--database-url", dbURL}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &appProcess{cmd: cmd, done: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.stderr.WriteString(line + "\n")
			p.mu.Unlock()
			if m := appListening.FindStringSubmatch(line); m != nil {
				select {
				case addr <- m[1]:
				default:
				}
			}
		}
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
		}
	})
	select {
	case p.addr = <-addr:
		return p, nil
	case err := <-p.done:
		return nil, fmt.Errorf("app exited before listening: %v\n%s", err, p.log())
	case <-time.After(60 * time.Second):
		return nil, fmt.Errorf("app did not listen within a minute:\n%s", p.log())
	}
}

// appStop sends SIGTERM and requires a clean exit (status 0) within 15 s.
func appStop(t *testing.T, p *appProcess) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("app on %s exited with %v:\n%s", p.addr, err, p.log())
		}
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		t.Fatalf("app on %s did not stop within 15 s:\n%s", p.addr, p.log())
	}
	if !strings.Contains(p.log(), "msg=stopped") {
		t.Errorf("app on %s did not log its clean stop:\n%s", p.addr, p.log())
	}
}

type appResponse struct {
	status int
	header http.Header
	body   string
}

func appPost(t *testing.T, client *http.Client, addr, path string, form url.Values) appResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+path, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return appDo(t, client, req)
}

func appGet(t *testing.T, client *http.Client, addr, path string) appResponse {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	return appDo(t, client, req)
}

func appDo(t *testing.T, client *http.Client, req *http.Request) appResponse {
	t.Helper()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return appResponse{resp.StatusCode, resp.Header, string(b)}
}

// TestAppLoginLimitSharedByTwoProcesses: examples/app runs as two OS
// processes on two ports, sharing one fresh schema (both migrate it at
// start-up). Six logins for one email from one address, alternating between
// the processes, get five 200s and then a 429 whose headers agree with each
// other and with the login policy. Both processes then stop cleanly.
func TestAppLoginLimitSharedByTwoProcesses(t *testing.T) {
	bin := buildCommand(t, "github.com/pgrl/pgrl/examples/app")
	schema := dbtest.NewSchema(t)

	// Start both at once: they race to migrate the empty schema.
	var procs [2]*appProcess
	var errs [2]error
	var wg sync.WaitGroup
	for i := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			procs[i], errs[i] = appStart(t, bin, dbtest.URL(), "--schema", schema, "--legacy-headers")
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if procs[0].addr == procs[1].addr {
		t.Fatalf("both processes listen on %s", procs[0].addr)
	}
	client := &http.Client{Timeout: 10 * time.Second}

	const policy = `"login-email-ip";q=5;w=60, "login-ip";q=20;w=60, "login-email";q=50;w=900`
	form := url.Values{"email": {"e2e@example.com"}, "password": {"wrong"}}
	for i := range 5 {
		p := procs[i%2]
		r := appPost(t, client, p.addr, "/login", form)
		if r.status != http.StatusOK {
			t.Fatalf("login %d on %s: status %d, want 200; body %q", i+1, p.addr, r.status, r.body)
		}
		if got := r.header.Get("RateLimit-Policy"); got != policy {
			t.Errorf("login %d: RateLimit-Policy %q, want %q", i+1, got, policy)
		}
		// Every limit has a member, the per email+IP limit first: it has
		// the fewest left, 4, 3, 2, 1, 0. It is fully available again when
		// the window after this one ends: in more than 60 s and at most
		// 120 s. The per IP and per email limits follow, in rule order.
		m := regexp.MustCompile(`^"login-email-ip";r=(\d+);t=(\d+), "login-ip";r=(\d+);t=\d+, "login-email";r=(\d+);t=\d+$`).
			FindStringSubmatch(r.header.Get("RateLimit"))
		if m == nil || m[1] != strconv.Itoa(4-i) || m[3] != strconv.Itoa(19-i) || m[4] != strconv.Itoa(49-i) {
			t.Errorf("login %d: RateLimit %q, want r=%d, %d and %d", i+1, r.header.Get("RateLimit"), 4-i, 19-i, 49-i)
		} else if tt, _ := strconv.Atoi(m[2]); tt < 60 || tt > 120 {
			t.Errorf("login %d: RateLimit t=%d, want 60..120", i+1, tt)
		}
		if r.header.Get("X-RateLimit-Limit") != "5" || r.header.Get("X-RateLimit-Remaining") != strconv.Itoa(4-i) {
			t.Errorf("login %d: X-RateLimit-Limit %q, -Remaining %q", i+1, r.header.Get("X-RateLimit-Limit"), r.header.Get("X-RateLimit-Remaining"))
		}
		if r.header.Get("Retry-After") != "" {
			t.Errorf("login %d: Retry-After on an allowed response", i+1)
		}
	}

	before := time.Now()
	r := appPost(t, client, procs[1].addr, "/login", form)
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("login 6: status %d, want 429; body %q", r.status, r.body)
	}
	retryAfter, err := strconv.Atoi(r.header.Get("Retry-After"))
	// Five logins in the last minute: the sixth fits once the sliding
	// window's estimate drops to 4, at most 72 s from now (1.2 windows).
	if err != nil || retryAfter < 1 || retryAfter > 72 {
		t.Fatalf("Retry-After %q, want whole seconds in 1..72", r.header.Get("Retry-After"))
	}
	want := map[string]string{
		"Content-Type":          "application/json",
		"Content-Length":        strconv.Itoa(len(r.body)),
		"Retry-After":           strconv.Itoa(retryAfter),
		"Ratelimit-Policy":      policy,
		"X-Ratelimit-Limit":     "5",
		"X-Ratelimit-Remaining": "0",
	}
	for k, v := range want {
		if got := r.header.Get(k); got != v {
			t.Errorf("429 header %s = %q, want %q", k, got, v)
		}
	}
	// The denying limit first, with Retry-After's wait; the others gave
	// the sixth login's units back (all or nothing), so they still have
	// 15 and 45 left.
	if got, want := r.header.Get("RateLimit"), regexp.MustCompile(fmt.Sprintf(
		`^"login-email-ip";r=0;t=%d, "login-ip";r=15;t=\d+, "login-email";r=45;t=\d+$`, retryAfter)); !want.MatchString(got) {
		t.Errorf("429 header RateLimit = %q, want %s", got, want)
	}
	reset, err := strconv.ParseInt(r.header.Get("X-RateLimit-Reset"), 10, 64)
	if err != nil || reset < before.Unix()+int64(retryAfter)-1 || reset > before.Unix()+121 {
		t.Errorf("X-RateLimit-Reset %q, want a Unix time between Retry-After and 2 minutes from now", r.header.Get("X-RateLimit-Reset"))
	}
	if wantBody := fmt.Sprintf(`{"error":"rate_limited","retry_after":%d}`+"\n", retryAfter); r.body != wantBody {
		t.Errorf("429 body %q, want %q", r.body, wantBody)
	}
	// The other process agrees: the count is shared.
	if r := appPost(t, client, procs[0].addr, "/login", form); r.status != http.StatusTooManyRequests {
		t.Errorf("login 7 on the other process: status %d, want 429", r.status)
	}
	// Another email from the same address is not limited by this one.
	if r := appPost(t, client, procs[0].addr, "/login", url.Values{"email": {"other@example.com"}, "password": {"x"}}); r.status != http.StatusOK {
		t.Errorf("login for another email: status %d, want 200", r.status)
	}

	// A single-limit check, then the metrics endpoint serves every series
	// docs/METRICS.md lists.
	if r := appGet(t, client, procs[0].addr, "/api/v1/things"); r.status != http.StatusOK {
		t.Errorf("public API: status %d", r.status)
	}
	m := appGet(t, client, procs[0].addr, "/metrics")
	for _, s := range []string{
		`pgrl_decisions_total{limiter="public-api",outcome="allowed",store="postgres"} 1`,
		`pgrl_check_duration_seconds_count{limiter="public-api",store="postgres"} 1`,
		`pgrl_breaker_open{limiter="login-email-ip"} 0`,
		`pgrl_deny_cache_hits_total{limiter="login-email-ip"} 0`,
	} {
		if !strings.Contains(m.body, s+"\n") {
			t.Errorf("/metrics lacks %q", s)
		}
	}

	for _, p := range procs {
		appStop(t, p)
	}
	if t.Failed() {
		for _, p := range procs {
			t.Logf("log of %s:\n%s", p.addr, p.log())
		}
	}
}
