package loadtest

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// recorder is a Meter that logs every slice of the paths it is set on.
type recorder struct {
	mu     sync.Mutex
	slices []string // "name" for a measured slice, "name (warm-up)" else
	open   map[string]bool
}

type meterOf struct {
	r    *recorder
	name string
}

func (m meterOf) Start(context.Context) {
	m.r.mu.Lock()
	defer m.r.mu.Unlock()
	if m.r.open == nil {
		m.r.open = map[string]bool{}
	}
	m.r.open[m.name] = true
}

func (m meterOf) Stop(_ context.Context, measured bool) {
	m.r.mu.Lock()
	defer m.r.mu.Unlock()
	if !m.r.open[m.name] {
		panic("Stop without Start")
	}
	m.r.open[m.name] = false
	s := m.name
	if !measured {
		s += " (warm-up)"
	}
	m.r.slices = append(m.r.slices, s)
}

// counting returns a check that sleeps a little, counts its calls and
// notes the keys it was given.
func counting(calls *atomic.Int64, keys *sync.Map) Check {
	return func(ctx context.Context, k int) error {
		calls.Add(1)
		keys.Store(k, true)
		time.Sleep(200 * time.Microsecond)
		return nil
	}
}

func TestRunInterleavesAndMeasuresOnlyAfterWarmup(t *testing.T) {
	rec := &recorder{}
	var paths []*Path
	calls := make([]*atomic.Int64, 3)
	keys := make([]*sync.Map, 3)
	for i, name := range []string{"a", "b", "c"} {
		calls[i], keys[i] = &atomic.Int64{}, &sync.Map{}
		paths = append(paths, &Path{Name: name, Check: counting(calls[i], keys[i]), Meter: meterOf{rec, name}})
	}
	plan := Plan{Callers: 3, Keys: 5, Warmup: 30 * time.Millisecond, Duration: 60 * time.Millisecond, Slice: 20 * time.Millisecond}
	if err := Run(context.Background(), plan, paths...); err != nil {
		t.Fatal(err)
	}
	want := []string{"a (warm-up)", "b (warm-up)", "c (warm-up)", "a", "b", "c", "b", "c", "a", "c", "a", "b"}
	if !slices.Equal(rec.slices, want) {
		t.Fatalf("slices ran in the order %v, want %v", rec.slices, want)
	}
	for i, p := range paths {
		if p.Checks() == 0 || int64(p.Checks()) >= calls[i].Load() {
			t.Errorf("%s: %d measured checks of %d calls: the warm-up must run checks and not count them", p.Name, p.Checks(), calls[i].Load())
		}
		if p.Elapsed < plan.Duration || p.Elapsed > plan.Duration+time.Second {
			t.Errorf("%s: measured %v, want about %v", p.Name, p.Elapsed, plan.Duration)
		}
		if !slices.IsSorted(p.Latencies) {
			t.Errorf("%s: latencies not sorted", p.Name)
		}
		if p.Latencies[0] < (200 * time.Microsecond).Nanoseconds() {
			t.Errorf("%s: latency %dns is less than the check's sleep", p.Name, p.Latencies[0])
		}
		if got := p.OpsPerSec(); got != float64(p.Checks())/p.Elapsed.Seconds() {
			t.Errorf("%s: OpsPerSec %v", p.Name, got)
		}
		keys[i].Range(func(k, _ any) bool {
			if k.(int) < 0 || k.(int) >= plan.Keys {
				t.Errorf("%s: key %d out of [0, %d)", p.Name, k, plan.Keys)
			}
			return true
		})
	}
}

func TestRunHotKeyAndNoWarmup(t *testing.T) {
	rec := &recorder{}
	var calls atomic.Int64
	var keys sync.Map
	p := &Path{Name: "hot", Check: counting(&calls, &keys), Meter: meterOf{rec, "hot"}}
	// Shorter than one slice: one slice of the whole duration.
	if err := Run(context.Background(), Plan{Callers: 2, Keys: 1, Duration: 10 * time.Millisecond, Slice: time.Second}, p); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rec.slices, []string{"hot"}) {
		t.Errorf("slices %v, want one measured slice and no warm-up", rec.slices)
	}
	n := 0
	keys.Range(func(k, _ any) bool {
		n++
		if k.(int) != 0 {
			t.Errorf("key %d with Keys 1", k)
		}
		return true
	})
	if n != 1 || int64(p.Checks()) != calls.Load() {
		t.Errorf("%d keys, %d checks of %d calls", n, p.Checks(), calls.Load())
	}
}

func TestRunStopsAtTheFirstFailedCheck(t *testing.T) {
	boom := errors.New("boom")
	rec := &recorder{}
	var calls atomic.Int64
	ok := &Path{Name: "ok", Check: func(context.Context, int) error { time.Sleep(100 * time.Microsecond); return nil }}
	bad := &Path{Name: "bad", Meter: meterOf{rec, "bad"}, Check: func(context.Context, int) error {
		if calls.Add(1) > 10 {
			return boom
		}
		return nil
	}}
	err := Run(context.Background(), Plan{Callers: 2, Keys: 3, Duration: time.Second, Slice: 100 * time.Millisecond}, ok, bad)
	if !errors.Is(err, boom) || !strings.HasPrefix(err.Error(), "bad: ") {
		t.Fatalf("err = %v, want boom named after its path", err)
	}
	if !slices.Equal(rec.slices, []string{"bad (warm-up)"}) {
		t.Errorf("the failed slice was reported as %v, want it dropped", rec.slices)
	}
	if bad.Checks() != 0 || bad.Elapsed != 0 {
		t.Errorf("the failed slice was recorded: %d checks, %v", bad.Checks(), bad.Elapsed)
	}
}

func TestRunReturnsContextError(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int64
	p := &Path{Name: "p", Check: func(context.Context, int) error {
		if calls.Add(1) == 5 {
			cancel()
		}
		return nil
	}}
	start := time.Now()
	err := Run(ctx, Plan{Callers: 1, Keys: 1, Duration: 10 * time.Second, Slice: 10 * time.Millisecond}, p)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("Run went on for %v after its context ended", time.Since(start))
	}
}

func TestRunRejectsBadPlans(t *testing.T) {
	p := &Path{Name: "p", Check: func(context.Context, int) error { return nil }}
	good := Plan{Callers: 1, Keys: 1, Duration: time.Millisecond, Slice: time.Millisecond}
	for _, tc := range []struct {
		change func(*Plan)
		want   string
	}{
		{func(p *Plan) { p.Callers = 0 }, "Callers"},
		{func(p *Plan) { p.Keys = 0 }, "Keys"},
		{func(p *Plan) { p.Duration = 0 }, "Duration"},
		{func(p *Plan) { p.Slice = -1 }, "Slice"},
		{func(p *Plan) { p.Warmup = -1 }, "Warmup"},
	} {
		plan := good
		tc.change(&plan)
		if err := Run(context.Background(), plan, p); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: err = %v, want one naming %s", plan, err, tc.want)
		}
	}
	if err := Run(context.Background(), good); err == nil {
		t.Error("no paths: no error")
	}
}

func TestPercentileUs(t *testing.T) {
	p := &Path{}
	if p.PercentileUs(0.5) != 0 || p.OpsPerSec() != 0 {
		t.Fatal("an empty path reports figures")
	}
	for i := 1; i <= 100; i++ {
		p.Latencies = append(p.Latencies, int64(i)*1000) // 1..100 µs
	}
	for q, want := range map[float64]float64{0: 1, 0.5: 51, 0.99: 100, 1: 100} {
		if got := p.PercentileUs(q); got != want {
			t.Errorf("PercentileUs(%v) = %v, want %v", q, got, want)
		}
	}
}

func TestRoundAndRatio(t *testing.T) {
	for _, tc := range []struct{ x, want float64 }{{1.2345, 1.235}, {-1.2345, -1.235}, {2, 2}, {0.0004, 0}} {
		if got := Round(tc.x, 3); got != tc.want {
			t.Errorf("Round(%v, 3) = %v, want %v", tc.x, got, tc.want)
		}
	}
	if Ratio(1, 0) != 0 || Ratio(2, 3) != 0.667 {
		t.Errorf("Ratio(1, 0) = %v, Ratio(2, 3) = %v", Ratio(1, 0), Ratio(2, 3))
	}
}

func TestStartCPUProfile(t *testing.T) {
	path := t.TempDir() + "/cpu.pprof"
	stop, err := StartCPUProfile(path)
	if err != nil {
		t.Fatal(err)
	}
	stop()
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Errorf("no profile written: %v", err)
	}
	if _, err := StartCPUProfile(t.TempDir() + "/missing/cpu.pprof"); err == nil {
		t.Error("a profile in a missing directory: no error")
	}
}
