// Package loadtest runs the load of pgrl's benchmarks (rl-bench and
// vsredis): concurrent callers that each check keys drawn at random as fast
// as they can, a warm-up, and several paths (ways of making the same check)
// measured in interleaved slices, so that noise from other work on the
// machine falls on every path alike. It records every check's latency and
// reports throughput and percentiles; what a benchmark compares and how it
// prints the result stay in the benchmark.
//
// A run of one case:
//
//	raw := &loadtest.Path{Name: "raw", Check: rawCheck}
//	lib := &loadtest.Path{Name: "library", Check: libCheck}
//	plan := loadtest.Plan{Callers: 8, Keys: 100_000, Warmup: time.Second, Duration: 5 * time.Second, Slice: 100 * time.Millisecond}
//	if err := loadtest.Run(ctx, plan, raw, lib); err != nil { ... }
//	ratio := loadtest.Ratio(lib.OpsPerSec(), raw.OpsPerSec())
package loadtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Check makes one check of key number k, 0 <= k < Plan.Keys. An error stops
// the run.
type Check func(ctx context.Context, k int) error

// Meter measures something besides latency while a path runs, such as CPU
// time or statements sent. Run calls Start before each slice of the path
// (warm-up included) and Stop after it, with the same context.
type Meter interface {
	// Start is called before the slice's callers start.
	Start(ctx context.Context)
	// Stop is called once all the slice's callers have returned. measured
	// is false for a warm-up slice and for a slice that failed: what was
	// read since Start is then to be dropped.
	Stop(ctx context.Context, measured bool)
}

// Path is one way of making the checks, with what Run measured of it.
type Path struct {
	// Name identifies the path in errors.
	Name string
	// Check makes one check.
	Check Check
	// Meter, when not nil, measures each slice of the path besides latency.
	Meter Meter

	// Latencies holds the latency of every measured check in nanoseconds,
	// sorted once Run has returned.
	Latencies []int64
	// Elapsed is the wall-clock time of the path's measured slices.
	Elapsed time.Duration
}

// Checks is the number of measured checks.
func (p *Path) Checks() int { return len(p.Latencies) }

// OpsPerSec is the measured checks per second of wall-clock time, 0 when
// nothing was measured.
func (p *Path) OpsPerSec() float64 {
	if p.Elapsed <= 0 {
		return 0
	}
	return float64(len(p.Latencies)) / p.Elapsed.Seconds()
}

// PercentileUs returns the q-quantile (0 to 1) of the latencies in
// microseconds: the latency at index q×n of the sorted latencies (the last
// one for q = 1), 0 when there are none.
func (p *Path) PercentileUs(q float64) float64 {
	if len(p.Latencies) == 0 {
		return 0
	}
	i := min(int(q*float64(len(p.Latencies))), len(p.Latencies)-1)
	return float64(p.Latencies[i]) / 1e3
}

// Plan is how Run loads the paths of one case.
type Plan struct {
	// Callers is the number of goroutines that make checks concurrently.
	Callers int
	// Keys is the number of keys each caller draws from, uniformly; with 1
	// every check is of key 0 (one hot key).
	Keys int
	// Warmup is unmeasured time before measuring, split evenly between the
	// paths; 0 skips it.
	Warmup time.Duration
	// Duration is the measured time of each path.
	Duration time.Duration
	// Slice is the length the interleaved slices aim at: Duration is cut
	// into max(Duration/Slice, 1) equal slices per path.
	Slice time.Duration
}

func (p Plan) validate(paths int) error {
	switch {
	case p.Callers < 1:
		return fmt.Errorf("loadtest: Plan.Callers is %d; give at least 1", p.Callers)
	case p.Keys < 1:
		return fmt.Errorf("loadtest: Plan.Keys is %d; give at least 1", p.Keys)
	case p.Duration <= 0 || p.Slice <= 0:
		return fmt.Errorf("loadtest: Plan.Duration (%v) and Plan.Slice (%v) must be positive", p.Duration, p.Slice)
	case p.Warmup < 0:
		return fmt.Errorf("loadtest: Plan.Warmup is %v; give 0 or more", p.Warmup)
	case paths == 0:
		return errors.New("loadtest: no paths to run")
	}
	return nil
}

// Run loads the paths as plan says: first the warm-up, each path in turn,
// then the measured slices. In round i the paths run one after the other
// starting with path i mod len(paths), so that none always runs right
// after the same other; with two paths, they alternate which goes first.
// The latencies of the measured slices are appended to each path's
// Latencies and sorted, and their wall-clock time added to Elapsed, so
// that running several plans on the same paths accumulates.
//
// Each caller draws its keys from a sequence of its own that is the same in
// every run of the same plan, and that carries on from one slice to the
// next.
//
// The first check that fails stops the run; the error names its path. When
// ctx ends with no check failed, Run returns ctx.Err().
func Run(ctx context.Context, plan Plan, paths ...*Path) error {
	if err := plan.validate(len(paths)); err != nil {
		return err
	}
	r := newRunner(plan.Callers, plan.Keys)
	if plan.Warmup > 0 {
		for _, p := range paths {
			if err := r.slice(ctx, plan.Warmup/time.Duration(len(paths)), p, false); err != nil {
				return err
			}
		}
	}
	n := max(int(plan.Duration/plan.Slice), 1)
	sliceLen := plan.Duration / time.Duration(n)
	for i := range n {
		for j := range paths {
			if err := r.slice(ctx, sliceLen, paths[(i+j)%len(paths)], true); err != nil {
				return err
			}
		}
	}
	for _, p := range paths {
		slices.Sort(p.Latencies)
	}
	return nil
}

// runner drives the callers, each with its own key sequence and latency
// buffer, reused from slice to slice.
type runner struct {
	callers int
	keys    int
	rngs    []*rand.Rand
	buf     [][]int64
}

func newRunner(callers, keys int) *runner {
	r := &runner{callers: callers, keys: keys, rngs: make([]*rand.Rand, callers), buf: make([][]int64, callers)}
	for i := range callers {
		r.rngs[i] = rand.New(rand.NewPCG(uint64(i)+1, uint64(keys)))
	}
	return r
}

// slice runs p's check from every caller for d, and records the latencies
// and the elapsed time in p when measure is set.
func (r *runner) slice(ctx context.Context, d time.Duration, p *Path, measure bool) error {
	if p.Meter != nil {
		p.Meter.Start(ctx)
	}
	var wg sync.WaitGroup
	errs := make([]error, r.callers)
	start := time.Now()
	deadline := start.Add(d)
	for w := range r.callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng, lat := r.rngs[w], r.buf[w][:0]
			for {
				t0 := time.Now()
				if !t0.Before(deadline) {
					break
				}
				k := 0
				if r.keys > 1 {
					k = rng.IntN(r.keys)
				}
				if err := p.Check(ctx, k); err != nil {
					errs[w] = err
					break
				}
				lat = append(lat, time.Since(t0).Nanoseconds())
			}
			r.buf[w] = lat
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	err := errors.Join(errs...)
	if err != nil {
		err = fmt.Errorf("%s: %w", p.Name, err)
	} else if ctx.Err() != nil {
		err = ctx.Err()
	}
	if p.Meter != nil {
		p.Meter.Stop(ctx, measure && err == nil)
	}
	if err != nil {
		return err
	}
	if measure {
		p.Elapsed += elapsed
		for _, lat := range r.buf {
			p.Latencies = append(p.Latencies, lat...)
		}
	}
	return nil
}

// Ratio is a/b rounded to 3 decimals, or 0 when b is 0.
func Ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return Round(a/b, 3)
}

// Round rounds x to digits decimals, halves away from zero.
func Round(x float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	if x >= 0 {
		return float64(int64(x*p+0.5)) / p
	}
	return -float64(int64(-x*p+0.5)) / p
}
