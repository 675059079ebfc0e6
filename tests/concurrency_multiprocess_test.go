package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// The concurrency experiment: concProcesses OS processes, each with a
// number of goroutines, acquire slots of a concurrency limit, hold them for
// a random time and release them, logging every step with the wall clock
// (one machine, so one clock) to a file of JSON lines that survives the
// process. The hot key's row is locked for a while (concStall), so that
// slots are lost; later one process is killed (SIGKILL) while it holds
// slots, and the others go on acquiring until well after its slots must
// have lapsed.
const (
	concChildEnv  = "PGRL_CONCURRENCY_CHILD_URL" // the database URL, for the children
	concLogEnv    = "PGRL_CONCURRENCY_CHILD_LOG" // the file a child logs to
	concProcesses = 4
	concLimiter   = "workers"
	concHotKey    = "hot"  // the key nearly every goroutine acquires
	concSideKey   = "side" // the key goroutine 0 of each process acquires
	concApp       = "pgrl-concurrency-child-"

	// concLease is the limit's Window: how long a slot outlives a holder
	// that stopped extending it. Short, so that the killed process's slots
	// lapse within the test.
	concLease = 1200 * time.Millisecond
	// concMargin is added to every bound on how long a slot may outlive
	// what its holder logged: a statement's delay between the instant a
	// client logs and the instant PostgreSQL reads its clock.
	concMargin = 500 * time.Millisecond
	// concTail is how long a slot may stay live in PostgreSQL after its
	// holder stopped extending it (lost, killed, or a release or acquire
	// whose answer did not come): a Window after its last extension, sent
	// at most a third of a Window before, plus the margin.
	concTail = concLease + concLease/3 + concMargin
	// concAfterExpiry is how long the surviving processes go on acquiring
	// once the killed process's slots must have lapsed.
	concAfterExpiry = 2500 * time.Millisecond
)

// The steps a holder logs.
const (
	concSent    = "sent"    // acquire sent
	concGranted = "granted" // acquire answered: allowed, the slot is held
	concRefused = "refused" // acquire answered: refused
	concFailed  = "failed"  // acquire answered with an error
	// concLate: acquire granted by PostgreSQL but answered after its lease
	// had run out (a busy machine), so reported refused and not held: its
	// place may be live in PostgreSQL until the library's release of it
	// lands or the lease lapses.
	concLate     = "late"
	concRelSent  = "release"  // release sent
	concReleased = "released" // release answered
	concLost     = "lost"     // the slot was found lost (Done) before its release
)

// concCommand is one line the parent sends to a child: "run" starts
// Goroutines holders on a limit of Limit slots, one hold in LongEvery of
// them long (concHoldTime), "stop" ends them (each releases what it holds)
// and is answered with a concSummary.
type concCommand struct {
	Op         string `json:"op"`
	Proc       int    `json:"proc"`
	Limit      int64  `json:"limit"`
	Goroutines int    `json:"goroutines"`
	LongEvery  int    `json:"long_every"`
	Seed       uint64 `json:"seed"`
}

// concEvent is one line of a child's log: step Ev of acquire I of
// goroutine G, at T (Unix nanoseconds).
type concEvent struct {
	G    int    `json:"g"`
	I    int    `json:"i"`
	Ev   string `json:"ev"`
	Key  string `json:"key,omitempty"`
	T    int64  `json:"t"`
	Hold int64  `json:"hold,omitempty"` // granted: the planned hold, in nanoseconds
	Used int64  `json:"used,omitempty"` // granted, refused: the slots PostgreSQL counted live (a granted one included)
	Err  string `json:"err,omitempty"`  // failed, released: the error
	Lost bool   `json:"lost,omitempty"` // released: the slot had been lost before its release
}

// concSummary is what a child counted, answered to "stop": the parent
// finds the same figures in its log.
type concSummary struct {
	Acquires  int    `json:"acquires"`
	Grants    int    `json:"grants"`
	Refusals  int    `json:"refusals"`
	Late      int    `json:"late"`
	Failures  int    `json:"failures"`
	Lost      int    `json:"lost"`
	LongHolds int    `json:"long_holds"` // grants planned to outlive a third of the lease
	Anomaly   string `json:"anomaly,omitempty"`
}

// concLog writes a child's events to its file, one unbuffered write per
// line, so that every line written survives a SIGKILL of the process.
type concLog struct {
	mu  sync.Mutex
	f   *os.File
	err error
}

func (l *concLog) write(e concEvent) {
	b, _ := json.Marshal(e)
	b = append(b, '\n')
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.f.Write(b); err != nil && l.err == nil {
		l.err = err
	}
}

// concRun is a child's running holders.
type concRun struct {
	stopping chan struct{}
	wg       sync.WaitGroup
	pool     *pgxpool.Pool
	log      *concLog

	mu  sync.Mutex
	sum concSummary
}

// count updates the summary under the lock.
func (r *concRun) count(f func(*concSummary)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.sum)
}

// anomaly records the first thing the library did that it must not.
func (r *concRun) anomaly(format string, args ...any) {
	r.count(func(s *concSummary) {
		if s.Anomaly == "" {
			s.Anomaly = fmt.Sprintf(format, args...)
		}
	})
}

// pause sleeps for d, or until the run stops; false when it stopped.
func (r *concRun) pause(d time.Duration) bool {
	select {
	case <-r.stopping:
		return false
	case <-time.After(d):
		return true
	}
}

// concHoldTime is how long a holder keeps a slot: 0 to 30 ms, but one
// time in longEvery from half a lease to one and a half, so that slots
// are extended, several times, while held (and so that a large limit is
// filled, whatever the round trips cost on a loaded machine).
func concHoldTime(rng *rand.Rand, longEvery int) time.Duration {
	if rng.IntN(longEvery) == 0 {
		return concLease/2 + time.Duration(rng.Int64N(int64(concLease)))
	}
	return time.Duration(rng.Int64N(int64(30 * time.Millisecond)))
}

// startConcRun starts the holders of command c.
func startConcRun(t *testing.T, url string, log *concLog, c concCommand) *concRun {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 6
	cfg.ConnConfig.RuntimeParams["application_name"] = fmt.Sprint(concApp, c.Proc)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	// A timeout far above any statement's time on a loaded machine, and a
	// failure policy that returns errors: a check is PostgreSQL's answer
	// or an error, never a fallback's.
	db, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Timeout: 10 * time.Second, BreakerThreshold: 1 << 30})
	require.NoError(t, err)
	lim, err := db.Limiter(concConfig(c.Limit))
	require.NoError(t, err)
	r := &concRun{stopping: make(chan struct{}), pool: pool, log: log}
	for g := range c.Goroutines {
		key := concHotKey
		if g == 0 {
			key = concSideKey
		}
		rng := rand.New(rand.NewPCG(c.Seed, uint64(c.Proc*1000+g)))
		r.wg.Go(func() { r.holder(ctx, lim, g, key, c.LongEvery, rng) })
	}
	return r
}

// concConfig is the limit every process uses.
func concConfig(limit int64) ratelimit.Config {
	return ratelimit.Config{Name: concLimiter, Algorithm: ratelimit.Concurrency, Limit: limit, Window: concLease,
		OnFailure: ratelimit.FailError}
}

// holder acquires a slot of key, holds it for a random time, releases it,
// and again, until the run stops, logging each step.
func (r *concRun) holder(ctx context.Context, lim *ratelimit.Limiter, g int, key string, longEvery int, rng *rand.Rand) {
	now := func() int64 { return time.Now().UnixNano() }
	backoff := func() time.Duration {
		return 5*time.Millisecond + time.Duration(rng.Int64N(int64(10*time.Millisecond)))
	}
	for i := 0; ; i++ {
		select {
		case <-r.stopping:
			return
		default:
		}
		hold := concHoldTime(rng, longEvery)
		r.log.write(concEvent{G: g, I: i, Ev: concSent, Key: key, T: now()})
		slot, d, err := lim.Acquire(ctx, key)
		at := now()
		switch {
		case err != nil:
			r.log.write(concEvent{G: g, I: i, Ev: concFailed, T: at, Err: err.Error()})
			r.count(func(s *concSummary) { s.Acquires++; s.Failures++ })
			if !r.pause(backoff()) {
				return
			}
			continue
		case !d.Allowed && d.Store == ratelimit.StorePostgres && strings.HasPrefix(d.Reason, "the acquire was answered"):
			r.log.write(concEvent{G: g, I: i, Ev: concLate, T: at, Used: d.Used})
			r.count(func(s *concSummary) { s.Acquires++; s.Late++ })
			if slot != nil {
				r.anomaly("a late acquire returned a slot")
			}
			// Not held: nothing to hold or release.
			if !r.pause(backoff()) {
				return
			}
			continue
		case !d.Allowed:
			r.log.write(concEvent{G: g, I: i, Ev: concRefused, T: at, Used: d.Used})
			r.count(func(s *concSummary) { s.Acquires++; s.Refusals++ })
			if slot != nil {
				r.anomaly("a refused acquire returned a slot")
			}
			if !r.pause(backoff()) {
				return
			}
			continue
		case slot == nil || d.Store != ratelimit.StorePostgres:
			r.anomaly("an allowed acquire returned slot %v from store %v", slot, d.Store)
			return
		}
		r.log.write(concEvent{G: g, I: i, Ev: concGranted, T: at, Hold: int64(hold), Used: d.Used})
		r.count(func(s *concSummary) {
			s.Acquires++
			s.Grants++
			if hold > concLease/3 {
				s.LongHolds++
			}
		})
		lose := func(at int64) {
			r.log.write(concEvent{G: g, I: i, Ev: concLost, T: at})
			r.count(func(s *concSummary) { s.Lost++ })
			if !errors.Is(slot.Err(), ratelimit.ErrSlotLost) {
				r.anomaly("Done closed before Release, with Err %v", slot.Err())
			}
			if err := slot.Release(ctx); err != nil {
				r.anomaly("releasing a lost slot: %v", err)
			}
		}
		if slot.Err() != nil {
			// Lost before Acquire returned: never held, no work done.
			lose(at)
			continue
		}
		timer := time.NewTimer(hold)
		select {
		case <-slot.Done():
			timer.Stop()
			lose(now())
			continue
		case <-timer.C:
		case <-r.stopping:
			timer.Stop()
		}
		r.log.write(concEvent{G: g, I: i, Ev: concRelSent, T: now()})
		err = slot.Release(ctx)
		e := concEvent{G: g, I: i, Ev: concReleased, T: now(), Lost: errors.Is(slot.Err(), ratelimit.ErrSlotLost)}
		if err != nil {
			e.Err = err.Error()
		}
		r.log.write(e)
		if e.Lost {
			r.count(func(s *concSummary) { s.Lost++ })
		} else if !errors.Is(slot.Err(), ratelimit.ErrSlotReleased) {
			r.anomaly("after Release, Err %v", slot.Err())
		}
		select {
		case <-slot.Done():
		default:
			r.anomaly("Done not closed after Release")
		}
		if !r.pause(time.Duration(rng.Int64N(int64(3 * time.Millisecond)))) {
			return
		}
	}
}

// stop ends the holders (each releases what it holds) and returns the
// summary.
func (r *concRun) stop() concSummary {
	close(r.stopping)
	r.wg.Wait()
	r.pool.Close()
	r.log.mu.Lock()
	err := r.log.err
	r.log.mu.Unlock()
	if err != nil {
		r.anomaly("log: %v", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sum
}

// TestConcurrencyChildProcess is not a test of its own: run by
// TestConcurrencyMultiprocess as one of its processes, it answers a "run"
// concCommand by starting its holders (answering {"started":true}) and a
// "stop" by ending them (answering their concSummary). Every step of every
// holder goes to the file named by PGRL_CONCURRENCY_CHILD_LOG.
func TestConcurrencyChildProcess(t *testing.T) {
	url := os.Getenv(concChildEnv)
	if url == "" {
		t.Skip("a process of TestConcurrencyMultiprocess")
	}
	f, err := os.OpenFile(os.Getenv(concLogEnv), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	log := &concLog{f: f}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	var run *concRun
	for in.Scan() {
		var c concCommand
		require.NoError(t, json.Unmarshal(in.Bytes(), &c))
		switch {
		case c.Op == "run" && run == nil:
			run = startConcRun(t, url, log, c)
			fmt.Println(`{"started":true}`)
		case c.Op == "stop" && run != nil:
			s := run.stop()
			run = nil
			b, _ := json.Marshal(s)
			fmt.Println(string(b))
		}
	}
	if run != nil {
		run.stop()
	}
}

// concAttempt is one acquire as its process logged it; 0 for a step not
// logged.
type concAttempt struct {
	proc, g, i    int
	key           string
	sent          int64
	answered      int64
	outcome       string // concGranted, concRefused, concFailed, or "" when no answer was logged
	hold          int64
	used          int64
	relSent       int64
	relAnswered   int64
	relErr        bool
	lostAtRelease bool
	lost          int64
}

// concParseLog reads a child's log (a last line cut short by a kill is
// ignored).
func concParseLog(t *testing.T, proc int, path string) []*concAttempt {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	byID := map[[2]int]*concAttempt{}
	var out []*concAttempt
	for line := range bytes.Lines(b) {
		if !bytes.HasSuffix(line, []byte("\n")) {
			break
		}
		var e concEvent
		require.NoError(t, json.Unmarshal(line, &e), "process %d: %s", proc, line)
		id := [2]int{e.G, e.I}
		a := byID[id]
		if e.Ev == concSent {
			require.Nil(t, a, "process %d: acquire %v sent twice", proc, id)
			a = &concAttempt{proc: proc, g: e.G, i: e.I, key: e.Key, sent: e.T}
			byID[id] = a
			out = append(out, a)
			continue
		}
		require.NotNil(t, a, "process %d: %s of acquire %v, never sent", proc, e.Ev, id)
		switch e.Ev {
		case concGranted, concRefused, concFailed, concLate:
			a.answered, a.outcome, a.hold, a.used = e.T, e.Ev, e.Hold, e.Used
		case concRelSent:
			a.relSent = e.T
		case concReleased:
			a.relAnswered, a.relErr, a.lostAtRelease = e.T, e.Err != "", e.Lost
		case concLost:
			a.lost = e.T
		default:
			t.Fatalf("process %d: unknown step %q", proc, e.Ev)
		}
	}
	return out
}

// concSpan is an interval of Unix nanoseconds.
type concSpan struct{ from, to int64 }

// concEdge is one end of a span, for a sweep: +1 where a span starts, -1
// where it ends.
type concEdge struct {
	t     int64
	delta int
}

// concEdges returns the ends of spans in time order; at one instant the
// ends come first when endsFirst (half-open spans), the starts otherwise
// (closed spans).
func concEdges(spans []concSpan, endsFirst bool) []concEdge {
	edges := make([]concEdge, 0, 2*len(spans))
	for _, s := range spans {
		edges = append(edges, concEdge{s.from, 1}, concEdge{s.to, -1})
	}
	sort.Slice(edges, func(i, j int) bool {
		if edges[i].t != edges[j].t {
			return edges[i].t < edges[j].t
		}
		if endsFirst {
			return edges[i].delta < edges[j].delta
		}
		return edges[i].delta > edges[j].delta
	})
	return edges
}

// concPeak is the most spans [from, to) open at one instant, and the
// instants at which more than limit were.
func concPeak(spans []concSpan, limit int) (peak int, over []int64) {
	n := 0
	for _, e := range concEdges(spans, true) {
		n += e.delta
		peak = max(peak, n)
		if e.delta > 0 && n > limit {
			over = append(over, e.t)
		}
	}
	return peak, over
}

// concAtLeast returns, in time order, the maximal intervals during which
// at least n of the closed spans [from, to] overlap.
func concAtLeast(spans []concSpan, n int) []concSpan {
	var out []concSpan
	count := 0
	for _, e := range concEdges(spans, false) {
		count += e.delta
		switch {
		case e.delta > 0 && count == n:
			out = append(out, concSpan{from: e.t})
		case e.delta < 0 && count == n-1:
			out[len(out)-1].to = e.t
		}
	}
	return out
}

// concMeets reports whether the closed span s meets one of the ordered,
// disjoint closed intervals segs.
func concMeets(segs []concSpan, s concSpan) bool {
	i := sort.Search(len(segs), func(i int) bool { return segs[i].to >= s.from })
	return i < len(segs) && segs[i].from <= s.to
}

// concHeld is the span during which a granted slot was held according to
// its holder's log: from the acquire's answer until its release was sent
// or it was found lost. A slot of the killed process still held at the
// kill counts until the kill or, when later, a lease after its acquire
// was sent: PostgreSQL counts it at least that long (from the instant it
// read its clock for the acquire, after the sending, less the
// microsecond it rounds down to and a millisecond to spare). ok is false
// for an acquire that did not hold a slot.
func concHeld(a *concAttempt, killed bool, kill int64) (concSpan, bool) {
	if a.outcome != concGranted {
		return concSpan{}, false
	}
	end := int64(0)
	for _, t := range []int64{a.relSent, a.lost} {
		if t != 0 && (end == 0 || t < end) {
			end = t
		}
	}
	if killed && end == 0 {
		end = max(kill, a.sent+int64(concLease-time.Millisecond))
	}
	if a.lostAtRelease {
		// PostgreSQL no longer held it at its release: it lapsed some time
		// after its acquire's own lease (its holder stalled, on a busy
		// machine, past the margin), and is counted held only that long.
		end = max(min(end, a.sent+int64(concLease-time.Millisecond)), a.answered)
	}
	return concSpan{a.answered, end}, end != 0
}

// concHeldAtKill reports whether a slot of the killed process was held,
// by its log, when the process was killed.
func concHeldAtKill(a *concAttempt) bool {
	return a.outcome == concGranted && a.relSent == 0 && a.lost == 0
}

// concCertain counts the slots of g's key, g's own included, that their
// holders' logs show held over the whole round trip of acquire g, from its
// sending to its answer (by concHeld), among the attempts that count: they
// were live in PostgreSQL at the instant it decided g, whatever that
// instant. A slot found lost is left out: its holder learns of the loss
// some time after it.
func concCertain(g *concAttempt, grants []*concAttempt, victim int, kill int64, counts func(*concAttempt) bool) int64 {
	n := int64(1)
	for _, a := range grants {
		if a == g || a.key != g.key || a.lost != 0 || a.lostAtRelease || !counts(a) {
			continue
		}
		if h, ok := concHeld(a, a.proc == victim, kill); ok && h.from <= g.sent && h.to >= g.answered {
			n++
		}
	}
	return n
}

// concLive is the span during which an acquire's slot may have been live
// in PostgreSQL: from the acquire's sending until its release was
// answered; for a slot whose end its holder did not see confirmed (lost,
// a release that failed, an acquire that failed), concTail after the
// holder last did anything with it; for a slot of the killed process not
// given back before the kill, concTail after the kill, or only until the
// kill when killTail is false. ok is false for a refused acquire (it
// holds nothing), and for a span left open in a surviving process's log.
func concLive(a *concAttempt, killed bool, kill int64, killTail bool) (concSpan, bool) {
	s := concSpan{from: a.sent}
	tail := int64(concTail)
	switch {
	case a.outcome == concRefused:
		return s, false
	case a.outcome == concFailed || a.outcome == concLate:
		s.to = a.answered + tail
	case a.outcome == concGranted && a.lost != 0:
		s.to = a.lost + tail
	case a.outcome == concGranted && a.relAnswered != 0 && (a.relErr || a.lostAtRelease):
		s.to = max(a.relAnswered, a.relSent+tail)
	case a.outcome == concGranted && a.relAnswered != 0:
		s.to = a.relAnswered
	case killed && killTail:
		s.to = kill + tail
	case killed:
		s.to = kill
	default:
		return s, false
	}
	return s, true
}

// concKillHolding follows the victim's log and kills it (SIGKILL) at the
// first moment it holds at least want slots of the hot key that it will
// not release for at least another 3 ms; it returns the kill's instant.
func concKillHolding(t *testing.T, c *child, path string, want int, within time.Duration) time.Time {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	open := map[[2]int]int64{} // slots held: when each is to be released at the earliest
	var pending []byte
	buf := make([]byte, 1<<16)
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		for {
			n, err := f.Read(buf)
			pending = append(pending, buf[:n]...)
			if errors.Is(err, io.EOF) || n == 0 {
				break
			}
			require.NoError(t, err)
		}
		for {
			i := bytes.IndexByte(pending, '\n')
			if i < 0 {
				break
			}
			var e concEvent
			require.NoError(t, json.Unmarshal(pending[:i], &e))
			pending = pending[i+1:]
			id := [2]int{e.G, e.I}
			switch e.Ev {
			case concSent:
				if e.Key == concHotKey {
					open[id] = 0
				}
			case concGranted:
				if _, ok := open[id]; ok {
					open[id] = e.T + e.Hold
				}
			case concRefused, concFailed, concLate, concRelSent, concLost:
				delete(open, id)
			}
		}
		soon, n := time.Now().Add(3*time.Millisecond).UnixNano(), 0
		for _, until := range open {
			if until > soon {
				n++
			}
		}
		if n >= want {
			require.NoError(t, c.cmd.Process.Kill())
			return time.Now()
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("the process to kill never held %d slots in %v", want, within)
	return time.Time{}
}

// concStall locks the row of key for d, in a transaction of its own:
// every acquire and release of the key waits for it, and so does every
// extension of the slots of the processes that hold one of key (each
// process extends all its slots in one statement), which gives up after a
// third of the lease; slots whose lease runs out meanwhile are lost. d is
// kept under the lease, so that the acquires waiting for the lock are
// answered while their leases still run: what is tested is the loss of
// slots while they are held.
func concStall(t *testing.T, pool *pgxpool.Pool, key string, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var n int
	require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM (SELECT FROM pgrl_concurrency WHERE key = $1 FOR UPDATE) AS k",
		multiprocessHashedKey(concLimiter, key)).Scan(&n))
	require.Equal(t, 1, n, "the key's row is locked")
	time.Sleep(d)
	require.NoError(t, tx.Commit(ctx))
}

// concurrencyCase runs the experiment on a limit of limit slots, with
// goroutines holders in each process, one hold in longEvery long, and
// checks what the logs show.
func concurrencyCase(t *testing.T, limit int64, goroutines, longEvery int) {
	began := time.Now()
	ctx := context.Background()
	pool, schema := dbtest.Pool(t)
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	url := dbtest.URLWithSchema(schema)
	dir := t.TempDir()
	children := make([]*child, concProcesses)
	logs := make([]string, concProcesses)
	for p := range children {
		logs[p] = filepath.Join(dir, fmt.Sprintf("process-%d.jsonl", p))
		children[p] = startChild(t, cctx, "TestConcurrencyChildProcess", concChildEnv+"="+url, concLogEnv+"="+logs[p])
	}
	victim := rand.IntN(concProcesses)
	seed := rand.Uint64()
	for p, c := range children {
		cmd, err := json.Marshal(concCommand{Op: "run", Proc: p, Limit: limit, Goroutines: goroutines, LongEvery: longEvery, Seed: seed})
		require.NoError(t, err)
		var started struct {
			Started bool `json:"started"`
		}
		c.ask(t, string(cmd), &started)
		require.True(t, started.Started)
	}
	// Stall the hot key, so that slots held across the stall are lost;
	// let slots be held across several extensions again; then kill a
	// process while it holds slots.
	time.Sleep(time.Second)
	concStall(t, pool, concHotKey, concLease*4/5)
	time.Sleep(1500*time.Millisecond + rand.N(500*time.Millisecond))
	killAt := concKillHolding(t, children[victim], logs[victim], max(1, int(limit)/10), 20*time.Second)
	kill := killAt.UnixNano()
	expiry := kill + int64(concTail) // when the killed process's slots must have lapsed
	time.Sleep(time.Until(time.Unix(0, expiry).Add(concAfterExpiry)))
	summaries := make([]concSummary, concProcesses)
	for p, c := range children {
		if p != victim {
			c.ask(t, `{"op":"stop"}`, &summaries[p])
		}
	}

	// Read the logs, and check them against the children's own counts.
	var all []*concAttempt
	var total concSummary
	for p := range children {
		attempts := concParseLog(t, p, logs[p])
		var s concSummary
		for _, a := range attempts {
			if p == victim {
				// The kill is the later of the instant the signal was
				// sent and the last step the process logged.
				kill = max(kill, a.sent, a.answered, a.relSent, a.relAnswered, a.lost)
			}
			if a.outcome != "" {
				s.Acquires++
			}
			switch a.outcome {
			case concGranted:
				s.Grants++
				if a.lost != 0 || a.lostAtRelease {
					s.Lost++
				}
				if time.Duration(a.hold) > concLease/3 {
					s.LongHolds++
				}
			case concRefused:
				s.Refusals++
			case concLate:
				s.Late++
			case concFailed:
				s.Failures++
			}
		}
		if p != victim {
			require.Empty(t, summaries[p].Anomaly, "process %d", p)
			require.Equal(t, summaries[p], s, "process %d: its log has every step it counted", p)
			for _, a := range attempts {
				_, live := concLive(a, false, 0, false)
				require.True(t, a.outcome == concRefused || live, "process %d: acquire %d.%d left open in its log", p, a.g, a.i)
			}
		}
		total.Acquires += s.Acquires
		total.Grants += s.Grants
		total.Refusals += s.Refusals
		total.Late += s.Late
		total.Failures += s.Failures
		total.Lost += s.Lost
		total.LongHolds += s.LongHolds
		all = append(all, attempts...)
	}

	expiry = kill + int64(concTail)

	// What the killed process held of each key when it was killed.
	heldAtKill := map[string]int{}
	for _, a := range all {
		if a.proc == victim && concHeldAtKill(a) {
			heldAtKill[a.key]++
		}
	}

	var grants []*concAttempt
	for _, a := range all {
		if a.outcome == concGranted {
			grants = append(grants, a)
		}
	}
	everyone := func(*concAttempt) bool { return true }
	survivor := func(a *concAttempt) bool { return a.proc != victim }

	var latest int64   // the latest instant a slot may be live in PostgreSQL
	var cameBack int64 // the first grant showing that a slot the killed process held of the hot key lapsed
	backAfterExpiry := 0
	for _, key := range []string{concHotKey, concSideKey} {
		var held, live, liveNoKill []concSpan
		var refusals, lates []*concAttempt
		grantsAfterExpiry := 0
		for _, a := range all {
			if a.key != key {
				continue
			}
			killed := a.proc == victim
			switch a.outcome {
			case concRefused:
				refusals = append(refusals, a)
			case concLate:
				lates = append(lates, a)
			}
			if h, ok := concHeld(a, killed, kill); ok {
				held = append(held, h)
			}
			if a.outcome == concGranted && !killed && a.answered > expiry {
				grantsAfterExpiry++
			}
			if s, ok := concLive(a, killed, kill, true); ok {
				live = append(live, s)
				latest = max(latest, s.to)
			}
			if s, ok := concLive(a, killed, kill, false); ok {
				liveNoKill = append(liveNoKill, s)
			}
		}

		// Check 1: never more than limit slots held at once, by the
		// holders' own logs.
		peak, over := concPeak(held, int(limit))
		for _, at := range over[:min(len(over), 5)] {
			var who []string
			for _, a := range all {
				if h, ok := concHeld(a, a.proc == victim, kill); ok && a.key == key && h.from <= at && at < h.to {
					who = append(who, fmt.Sprintf("%d.%d.%d %+v", a.proc, a.g, a.i, *a))
				}
			}
			t.Errorf("key %q: %d slots held at %v:\n%s", key, len(who), time.Unix(0, at).Format(time.RFC3339Nano), strings.Join(who, "\n"))
		}

		// Check 2: no refusal while fewer than limit slots may have been
		// live in PostgreSQL at every instant of its round trip.
		full := concAtLeast(live, int(limit))
		noKill := concAtLeast(liveNoKill, int(limit))
		unexplained, byKill := 0, 0
		for _, r := range refusals {
			s := concSpan{r.sent, r.answered}
			switch {
			case !concMeets(full, s):
				unexplained++
				if unexplained <= 5 {
					t.Errorf("key %q: acquire %d.%d.%d refused between %v and %v, while fewer than %d slots may have been live",
						key, r.proc, r.g, r.i, time.Unix(0, r.sent).Format(time.RFC3339Nano),
						time.Unix(0, r.answered).Format(time.RFC3339Nano), limit)
				}
			case !concMeets(noKill, s):
				byKill++
			}
		}
		// Check 3: what PostgreSQL counted with each grant (Used) is no
		// more than the limit, and no less than the slots held over the
		// whole round trip; with each refusal, exactly the limit. After
		// the kill, a survivor's grant that counted fewer slots beyond the
		// survivors' own than the killed process held shows that some of
		// those lapsed.
		miscounted := 0
		for _, r := range refusals {
			if r.used != limit {
				miscounted++
				if miscounted <= 5 {
					t.Errorf("key %q: acquire %d.%d.%d refused with %d slots counted (limit %d)", key, r.proc, r.g, r.i, r.used, limit)
				}
			}
		}
		for _, l := range lates {
			// Granted in PostgreSQL, its own slot counted: no more than
			// the limit.
			if l.used < 1 || l.used > limit {
				miscounted++
				t.Errorf("key %q: acquire %d.%d.%d answered late with %d slots counted (limit %d)", key, l.proc, l.g, l.i, l.used, limit)
			}
		}
		for _, g := range grants {
			if g.key != key {
				continue
			}
			if certain := concCertain(g, grants, victim, kill, everyone); g.used > limit || g.used < certain {
				miscounted++
				if miscounted <= 5 {
					t.Errorf("key %q: acquire %d.%d.%d granted with %d slots counted, %d held over its round trip (limit %d)",
						key, g.proc, g.g, g.i, g.used, certain, limit)
				}
			}
			if key != concHotKey || g.proc == victim || g.sent <= kill {
				continue
			}
			if g.used-concCertain(g, grants, victim, kill, survivor) < int64(heldAtKill[key]) {
				if cameBack == 0 || g.answered < cameBack {
					cameBack = g.answered
				}
				if g.sent > expiry {
					backAfterExpiry++
				}
			}
		}

		livePeak, _ := concPeak(live, int(limit))
		t.Logf("key %q: %d refusals (and %d answered after their lease ran out), %d unexplained, %d explained only by the killed process's slots; "+
			"at most %d held at once (limit %d), at most %d possibly live; %d decisions miscounted; "+
			"%d held by the killed process; %d grants after its slots had to lapse",
			key, len(refusals), len(lates), unexplained, byKill, peak, limit, livePeak, miscounted, heldAtKill[key], grantsAfterExpiry)
		require.Zero(t, len(over), "key %q: instants at which more than %d slots were held", key, limit)
		require.Zero(t, unexplained, "key %q: refusals while a place was free", key)
		require.Zero(t, miscounted, "key %q: decisions whose count of live slots was wrong", key)
		if key == concHotKey {
			require.Positive(t, len(refusals), "the limit was contended")
			require.Positive(t, grantsAfterExpiry, "grants go on after the killed process's slots lapsed")
		}
	}
	backAfter := "never"
	if cameBack != 0 {
		backAfter = time.Duration(cameBack-kill).Round(time.Millisecond).String() + " after the kill"
	}

	// Every place comes back: once nothing may be live any more (the
	// killed process's slots lapsed, the survivors released theirs), this
	// process holds all limit places of the hot key at once.
	db, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Timeout: 10 * time.Second, BreakerThreshold: 1 << 30})
	require.NoError(t, err)
	lim, err := db.Limiter(concConfig(limit))
	require.NoError(t, err)
	var mine []*ratelimit.Slot
	giveUp := time.Unix(0, max(latest, time.Now().UnixNano())).Add(5 * time.Second)
	for int64(len(mine)) < limit && time.Now().Before(giveUp) {
		s, d, err := lim.Acquire(ctx, concHotKey)
		require.NoError(t, err)
		if d.Allowed {
			mine = append(mine, s)
		} else {
			time.Sleep(20 * time.Millisecond)
		}
	}
	for _, s := range slices.Backward(mine) {
		require.NoError(t, s.Release(ctx))
	}

	t.Logf("%d processes × %d goroutines, limit %d, lease %v: %d acquires, %d grants (%d held past a third of the lease), "+
		"%d refusals, %d answered after their lease ran out, %d failed, %d slots lost; process %d killed %v after the start holding %d slots of %q, "+
		"the first of them seen lapsed %s (%d grants seen so after they had to lapse); "+
		"all %d places held again afterwards; %v in all",
		concProcesses, goroutines, limit, concLease, total.Acquires, total.Grants, total.LongHolds, total.Refusals,
		total.Late, total.Failures, total.Lost, victim, killAt.Sub(began).Round(time.Millisecond), heldAtKill[concHotKey], concHotKey,
		backAfter, backAfterExpiry, len(mine), time.Since(began).Round(time.Millisecond))
	require.Positive(t, heldAtKill[concHotKey], "the killed process held slots when it was killed")
	require.Positive(t, backAfterExpiry, "grants after the killed process's slots had to lapse show them lapsed")
	require.EqualValues(t, limit, len(mine), "every place of the key is free again")
}

// Several OS processes × many goroutines acquire slots of a concurrency
// limit (of 1, 3 and 50 places), hold each 0 to 30 ms or, now and then,
// across several extensions of the lease, and release it, logging every
// step with the wall clock. The key's row is locked for a while (slots
// held across it are lost: no extension gets through), then one process is
// killed (SIGKILL) while it holds slots, and the others go on until well
// after its slots must have lapsed. By the logs:
//
//  1. never more than the limit held at once (from an acquire's answer to
//     its release's sending, or its loss; the killed process's slots until
//     the kill, or a lease after their acquire when that is later; a slot
//     its release found lapsed, a lease after its acquire at most);
//  2. no refusal while fewer than the limit may have been live in
//     PostgreSQL over its whole round trip (from an acquire's sending to
//     its release's answer; the killed process's slots until a lease and a
//     third after the kill, plus a margin; those refused only because of
//     them are counted apart);
//  3. every decision counted no more live slots than the limit, and no
//     fewer than were held over its round trip;
//
// (an acquire answered after its lease ran out, on a busy machine, is
// reported refused and not held: it is counted apart, as possibly live
// until a lease after its answer, and is not a refusal of PostgreSQL's);
//
// and, once the killed process's slots had to lapse, grants go on, show
// them lapsed, and every place can be held at once again.
func TestConcurrencyMultiprocess(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		limit                 int64
		goroutines, longEvery int
	}{{1, 8, 40}, {3, 12, 40}, {50, 16, 5}} {
		t.Run(fmt.Sprint("limit=", c.limit), func(t *testing.T) { concurrencyCase(t, c.limit, c.goroutines, c.longEvery) })
	}
}
