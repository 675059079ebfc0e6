package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// The lease experiment: leaseProcesses OS processes, each with
// leaseGoroutines goroutines, check one key (or a spread of keys) through
// a lease limiter as fast as they can.
const (
	leaseProcesses  = 4
	leaseGoroutines = 8
	leaseChildEnv   = "PGRL_LEASE_CHILD_URL"
	leaseConfigEnv  = "PGRL_LEASE_CHILD_CONFIG"
)

// leaseChildConfig is the limit a child leases.
type leaseChildConfig struct {
	Name      string              `json:"name"`
	Algorithm ratelimit.Algorithm `json:"algorithm"`
	Limit     int64               `json:"limit"`
	WindowMs  int64               `json:"window_ms"`
	Size      int64               `json:"size"`
	Penalty   bool                `json:"penalty"`
	// Group checks the limit together with two others a hundred times as
	// large (same algorithm, window and Size), all or nothing with
	// lease.AllowAll, as a login checks its three: the tallies are the
	// first limit's.
	Group bool `json:"group"`
}

// leaseCommand is one line sent to a child: "run" checks for DurationMs
// (every goroutine until it is denied when UntilDenied) over Keys keys;
// "take" makes N checks of key 0 and keeps the slice.
type leaseCommand struct {
	Op          string `json:"op"`
	Keys        int    `json:"keys"`
	DurationMs  int64  `json:"duration_ms"`
	UntilDenied bool   `json:"until_denied"`
	N           int    `json:"n"`
}

// leaseTally is what one child admitted of one key in one aligned window.
type leaseTally struct {
	Key      int   `json:"key"`
	WindowUs int64 `json:"window_us"` // the window's start on the database's clock
	Admitted int64 `json:"admitted"`
	Checks   int64 `json:"checks"`
}

// leaseReport is a child's answer.
type leaseReport struct {
	Tallies []leaseTally `json:"tallies"`
	FirstUs int64        `json:"first_us"` // first and last decisions' Now
	LastUs  int64        `json:"last_us"`
	Stats   lease.Stats  `json:"stats"`
	Error   string       `json:"error,omitempty"`
}

// TestLeaseChildProcess is not a test of its own: run by the lease tests
// as a child process, it leases the limit of its configuration and answers
// leaseCommand lines with a leaseReport.
func TestLeaseChildProcess(t *testing.T) {
	url := os.Getenv(leaseChildEnv)
	if url == "" {
		t.Skip("a child process of the lease tests")
	}
	var cfg leaseChildConfig
	require.NoError(t, json.Unmarshal([]byte(os.Getenv(leaseConfigEnv)), &cfg))
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	window := time.Duration(cfg.WindowMs) * time.Millisecond
	lim, err := testkit.New(pool, ratelimit.Config{Name: cfg.Name, Algorithm: cfg.Algorithm, Limit: cfg.Limit, Window: window,
		Penalty: cfg.Penalty},
		ratelimit.DatabaseOptions{Timeout: 10 * time.Second})
	require.NoError(t, err)
	var others [2]*ratelimit.Limiter
	if cfg.Group {
		for i := range others {
			others[i], err = testkit.New(pool, ratelimit.Config{Name: fmt.Sprintf("%s-other-%d", cfg.Name, i), Algorithm: cfg.Algorithm,
				Limit: 100 * cfg.Limit, Window: window, Penalty: cfg.Penalty}, ratelimit.DatabaseOptions{Timeout: 10 * time.Second})
			require.NoError(t, err)
		}
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	var held *lease.Limiter // the "take" command's limiter, never closed
	for in.Scan() {
		var c leaseCommand
		require.NoError(t, json.Unmarshal(in.Bytes(), &c))
		x, err := lease.New(lim, lease.Options{Size: cfg.Size, DB: pool})
		require.NoError(t, err)
		var r leaseReport
		switch c.Op {
		case "take":
			held = x
			for range c.N {
				d, err := x.Allow(ctx, "key-0")
				if err != nil {
					r.Error = err.Error()
					break
				}
				if d.Allowed {
					r.Tallies = append(r.Tallies, leaseTally{Admitted: 1, Checks: 1})
				}
			}
			r.Stats = held.Stats()
		case "run":
			check := func(ctx context.Context, key string) (ratelimit.Decision, error) { return x.Allow(ctx, key) }
			var xs []*lease.Limiter
			if cfg.Group {
				for _, o := range others {
					y, err := lease.New(o, lease.Options{Size: cfg.Size, DB: pool})
					require.NoError(t, err)
					xs = append(xs, y)
				}
				check = func(ctx context.Context, key string) (ratelimit.Decision, error) {
					md, err := lease.AllowAll(ctx, ratelimit.AllOrNothing, lease.Check{Limiter: x, Key: key},
						lease.Check{Limiter: xs[0], Key: "ip"}, lease.Check{Limiter: xs[1], Key: key + "-email"})
					if err != nil {
						return ratelimit.Decision{}, err
					}
					d := md.Decisions[0]
					if !md.Allowed {
						d.Allowed, d.Granted = false, 0
					}
					return d, nil
				}
			}
			r = leaseRun(ctx, check, c, window.Microseconds())
			for _, y := range append(xs, x) {
				if err := y.Close(ctx); err != nil && r.Error == "" {
					r.Error = err.Error()
				}
			}
			r.Stats = x.Stats()
		}
		b, _ := json.Marshal(r)
		fmt.Println(string(b))
	}
}

// leaseRun is the "run" command: leaseGoroutines goroutines check keys in
// turn until the deadline, each tallying what it admitted by key and by
// the aligned window of the decision's Now (a slice's answers fall in the
// window their units were counted in).
func leaseRun(ctx context.Context, check func(context.Context, string) (ratelimit.Decision, error), c leaseCommand, windowUs int64) leaseReport {
	type at struct {
		key int
		win int64
	}
	var (
		mu      sync.Mutex
		r       leaseReport
		tallies = map[at]*leaseTally{}
		wg      sync.WaitGroup
	)
	keys := make([]string, c.Keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("key-%d", i)
	}
	deadline := time.Now().Add(time.Duration(c.DurationMs) * time.Millisecond)
	for g := range leaseGoroutines {
		wg.Go(func() {
			mine := map[at]*leaseTally{}
			var first, last int64
			var failure string
			for i := g; time.Now().Before(deadline); i++ {
				k := i % len(keys)
				d, err := check(ctx, keys[k])
				if err != nil {
					failure = err.Error()
					break
				}
				us := d.Now.UnixMicro()
				if first == 0 {
					first = us
				}
				last = us
				w := at{k, us - us%windowUs}
				tl := mine[w]
				if tl == nil {
					tl = &leaseTally{Key: k, WindowUs: w.win}
					mine[w] = tl
				}
				tl.Checks++
				if d.Allowed {
					tl.Admitted += d.Granted
				} else if c.UntilDenied {
					break
				}
			}
			mu.Lock()
			defer mu.Unlock()
			for w, tl := range mine {
				if s := tallies[w]; s != nil {
					s.Admitted += tl.Admitted
					s.Checks += tl.Checks
				} else {
					tallies[w] = tl
				}
			}
			if first != 0 && (r.FirstUs == 0 || first > r.FirstUs) {
				r.FirstUs = first // the latest start of any goroutine
			}
			if last != 0 && (r.LastUs == 0 || last < r.LastUs) {
				r.LastUs = last // the earliest end of any goroutine
			}
			if failure != "" {
				r.Error = failure
			}
		})
	}
	wg.Wait()
	for _, tl := range tallies {
		r.Tallies = append(r.Tallies, *tl)
	}
	return r
}

// startLeaseChildren starts n children leasing cfg on schema.
func startLeaseChildren(t *testing.T, ctx context.Context, schema string, cfg leaseChildConfig, n int) []*child {
	t.Helper()
	b, err := json.Marshal(cfg)
	require.NoError(t, err)
	children := make([]*child, n)
	for i := range children {
		children[i] = startChild(t, ctx, "TestLeaseChildProcess",
			leaseChildEnv+"="+dbtest.URLWithSchema(schema), leaseConfigEnv+"="+string(b))
	}
	return children
}

// runAll sends c to every child and returns their reports.
func runAll(t *testing.T, children []*child, c leaseCommand) []leaseReport {
	t.Helper()
	line, err := json.Marshal(c)
	require.NoError(t, err)
	for _, ch := range children {
		ch.send(t, string(line))
	}
	reports := make([]leaseReport, len(children))
	for i, ch := range children {
		ch.read(t, &reports[i])
		require.Empty(t, reports[i].Error, "child %d", i)
	}
	return reports
}

// TestLeaseMultiprocessNeverOver: 4 processes × 8 goroutines lease one
// hot key, or 16 keys, at limits of 20, 1,000 and 100,000 per window, for
// the fixed and the sliding window. Summed over the processes, what was
// admitted of each key in each aligned window never exceeds the limit;
// and for the fixed window, in every window the run covered from start to
// end where the key was short of quota (demand of twice the limit, or a
// check denied), it is at least the limit less the documented shortfall
// bound: one slice (Size) per process. Each case runs alone, under
// Penalty, and as the first of three limits checked together with
// lease.AllowAll (the others a hundred times as large), where the same
// bounds hold for the groups admitted.
func TestLeaseMultiprocessNeverOver(t *testing.T) {
	_, schema := dbtest.Pool(t)
	cases := []struct {
		limit, size int64
		windowMs    int64
		// whether the lower bound must be checked in at least one window:
		// demand of twice the limit is within any machine's reach
		mustQualify bool
	}{
		{limit: 20, size: 2, windowMs: 500, mustQualify: true},
		{limit: 1000, size: 50, windowMs: 500, mustQualify: true},
		{limit: 100_000, size: 2000, windowMs: 500},
	}
	if testing.Short() {
		cases = cases[:2]
	}
	for _, a := range ratelimit.Algorithms {
		for _, c := range cases {
			for _, keys := range []int{1, 16} {
				for _, mode := range []string{"alone", "penalty", "group"} {
					penalty, group := mode == "penalty", mode == "group"
					if group && (c.limit > 1000 || a == ratelimit.TokenBucket && keys > 1) {
						continue // the small limits show it
					}
					if penalty && c.limit > 1000 {
						continue // every denied check is a statement: the small limits show it
					}
					if penalty && a == ratelimit.TokenBucket {
						continue // refused: a penalised bucket's debt would shrink under leases
					}
					t.Run(fmt.Sprintf("%s/limit=%d/keys=%d/%s", a, c.limit, keys, mode), func(t *testing.T) {
						ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
						defer cancel()
						// Spread over 16 keys, each key gets a 16th of the demand:
						// longer windows keep a key short of quota on a busy
						// machine too.
						windowMs := c.windowMs
						if keys > 1 {
							windowMs *= 4
						}
						if keys > 1 && c.limit >= 1000 && !group {
							// A limit of 1,000 in 2 s asks 500 checks/s of each
							// of 16 keys: on a Citus cluster the keys saw 970
							// to 998 checks in a window, short of the limit.
							windowMs *= 2
						}
						if keys > 1 && group {
							// Three limits a check: under a 2-core CPU load
							// the 16 keys saw 770 to 970 checks in a window
							// of 2 s, short of a limit of 1,000.
							windowMs *= 2
						}
						// Four windows: the lower bound is checked in a window
						// that every goroutine of every child covers whole, and
						// on a busy machine their starts and ends straggle by a
						// few hundred milliseconds (with three, no window was
						// covered in one run under a 2-core CPU load). At
						// least 3 s: with windows of 0.5 s, four were not
						// enough under that load either.
						duration := max(4*windowMs, 3000) + 200
						if a == ratelimit.TokenBucket {
							// A bucket refilling its limit once a day: over
							// the run it admits its burst, the limit, and
							// not one more (the tallies' one "window").
							windowMs, duration = 24*3600*1000, 1500
						}
						cfg := leaseChildConfig{
							Name: fmt.Sprintf("lease-%s-%d-%d-%s", a, c.limit, keys, mode), Algorithm: a,
							Limit: c.limit, WindowMs: windowMs, Size: c.size, Penalty: penalty, Group: group,
						}
						children := startLeaseChildren(t, ctx, schema, cfg, leaseProcesses)
						reports := runAll(t, children, leaseCommand{Op: "run", Keys: keys, DurationMs: duration})
						leaseCheck(t, reports, cfg, a == ratelimit.FixedWindow && c.mustQualify)
					})
				}
			}
		}
	}
}

// leaseCheck holds the sums of reports to the limit of cfg.
func leaseCheck(t *testing.T, reports []leaseReport, cfg leaseChildConfig, mustQualify bool) {
	t.Helper()
	type at struct {
		key int
		win int64
	}
	sums := map[at]*leaseTally{}
	from, to := int64(0), int64(0)
	var st lease.Stats
	for i, r := range reports {
		if i == 0 || r.FirstUs > from {
			from = r.FirstUs
		}
		if i == 0 || r.LastUs < to {
			to = r.LastUs
		}
		for _, tl := range r.Tallies {
			w := at{tl.Key, tl.WindowUs}
			if sums[w] == nil {
				sums[w] = &leaseTally{Key: tl.Key, WindowUs: tl.WindowUs}
			}
			sums[w].Admitted += tl.Admitted
			sums[w].Checks += tl.Checks
		}
		st.Slices += r.Stats.Slices
		st.Leased += r.Stats.Leased
		st.UsedLocally += r.Stats.UsedLocally
		st.Returned += r.Stats.Returned
		st.Dropped += r.Stats.Dropped
		st.LocalDecisions += r.Stats.LocalDecisions
		st.DatabaseDecisions += r.Stats.DatabaseDecisions
		st.OtherDecisions += r.Stats.OtherDecisions
	}
	windowUs := cfg.WindowMs * 1000
	bound := int64(len(reports)) * cfg.Size
	keys := make([]at, 0, len(sums))
	for w := range sums {
		keys = append(keys, w)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i].key < keys[j].key || keys[i].key == keys[j].key && keys[i].win < keys[j].win
	})
	// A window admits at most the limit. A token bucket (refilling its
	// limit once a window, a day here) admits its burst, the limit, plus
	// what refilled during the run: less than 10 s of refill.
	most := cfg.Limit
	if cfg.Algorithm == ratelimit.TokenBucket {
		most += (cfg.Limit*10_000 + cfg.WindowMs - 1) / cfg.WindowMs
	}
	qualified := 0
	var lines []string
	for _, w := range keys {
		s := sums[w]
		require.LessOrEqual(t, s.Admitted, most, "key %d, window at %d: admitted over the limit", w.key, w.win)
		full := w.win >= from && w.win+windowUs <= to
		// The lower bound applies to a full window where the key was
		// short of quota: demand of twice the limit, or any check denied.
		// A check of one unit is denied only when PostgreSQL had nothing
		// left for its slice, so at that instant every unit of the window
		// was counted: admitted, or held in slices, at most one of Size per
		// process (under Penalty, denied checks count too, but only once
		// nothing is left). On a busy machine
		// the children may not reach twice the limit in a window, but
		// they run until denied.
		if full && (s.Checks >= 2*cfg.Limit || s.Checks > s.Admitted) && cfg.Algorithm == ratelimit.FixedWindow {
			qualified++
			require.GreaterOrEqual(t, s.Admitted, cfg.Limit-bound, "key %d, window at %d: more than %d short", w.key, w.win, bound)
		}
		if w.key == 0 {
			lines = append(lines, fmt.Sprintf("window %d: %d admitted of %d checks (full %v)", w.win, s.Admitted, s.Checks, full))
		}
	}
	t.Logf("limit %d, size %d: key 0 %s; stats summed %+v", cfg.Limit, cfg.Size, strings.Join(lines, "; "), st)
	if mustQualify {
		require.Positive(t, qualified, "no window with a full run and a key short of quota: the lower bound was not checked")
	}
}

// TestLeaseMultiprocessKilledChild: a child holding a slice is killed with
// SIGKILL; the other children then take the key until they are denied.
// The total admitted never exceeds the limit, and falls short of it by
// exactly what the killed child held: those units are lost until the
// window ends.
func TestLeaseMultiprocessKilledChild(t *testing.T) {
	_, schema := dbtest.Pool(t)
	for _, a := range ratelimit.Algorithms {
		t.Run(string(a), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			// A day's window: the run never crosses its end.
			cfg := leaseChildConfig{Name: "lease-kill-" + string(a), Algorithm: a, Limit: 1000, WindowMs: 24 * 3600 * 1000, Size: 50}
			children := startLeaseChildren(t, ctx, schema, cfg, leaseProcesses)

			var took leaseReport
			children[0].ask(t, `{"op":"take","n":7}`, &took)
			require.Empty(t, took.Error)
			require.Len(t, took.Tallies, 7)
			// The first check is the child's own; the second takes a slice
			// of 50 (a fair share of 999 left is more), and 6 are used.
			held := took.Stats.Leased - took.Stats.UsedLocally
			require.Equal(t, int64(44), held, "%+v", took.Stats)
			require.NoError(t, children[0].cmd.Process.Kill())
			_ = children[0].cmd.Wait()

			reports := runAll(t, children[1:], leaseCommand{Op: "run", Keys: 1, DurationMs: 60_000, UntilDenied: true})
			total := int64(7)
			for _, r := range reports {
				for _, tl := range r.Tallies {
					total += tl.Admitted
				}
			}
			t.Logf("killed child admitted 7 and held %d; %d admitted in all", held, total)
			require.LessOrEqual(t, total, cfg.Limit)
			require.GreaterOrEqual(t, total, cfg.Limit-held)
		})
	}
}
