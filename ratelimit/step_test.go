package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"testing"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// stepVector is one row of testdata/steps.json: a key's state, a check and
// a limit, and the next state, verdict and grant every implementation of
// the algorithm's step must give. The expected values were worked out from
// the rules (see step.go and migration 000012), not taken from either
// implementation.
type stepVector struct {
	Name      string    `json:"name"`
	Algorithm Algorithm `json:"algorithm"`
	State     stepState `json:"state"`
	NowUs     int64     `json:"now_us"`
	Cost      int64     `json:"cost"`
	// The fixed and the sliding window's limit.
	MaxCount int64 `json:"max_count"`
	WindowUs int64 `json:"window_us"`
	// The token bucket's limit.
	Capacity    float64 `json:"capacity"`
	RefillPerUs float64 `json:"refill_per_us"`
	Penalty     bool    `json:"penalty"`
	UpTo        bool    `json:"up_to"`
	Want        struct {
		State   stepState `json:"state"`
		Allowed bool      `json:"allowed"`
		Granted int64     `json:"granted"`
	} `json:"want"`
}

// stepState is a key's state. The fixed window's is the row it has for
// some window (the runners pick, as the statements do, that row if its
// window is the check's, else a new row of the check's window); the
// sliding window's start is null for a key not seen yet.
type stepState struct {
	WindowEndUs   int64   `json:"window_end_us,omitempty"`
	WindowStartUs *int64  `json:"window_start_us,omitempty"`
	Count         int64   `json:"count,omitempty"`
	PrevCount     int64   `json:"prev_count,omitempty"`
	Tokens        float64 `json:"tokens,omitempty"`
	UpdatedAtUs   int64   `json:"updated_at_us,omitempty"`
}

func loadStepVectors(t *testing.T) []stepVector {
	t.Helper()
	raw, err := os.ReadFile("testdata/steps.json")
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var vs []stepVector
	if err := dec.Decode(&vs); err != nil {
		t.Fatalf("testdata/steps.json: %v", err)
	}
	if len(vs) < 40 {
		t.Fatalf("testdata/steps.json holds %d vectors", len(vs))
	}
	seen := map[string]bool{}
	for _, v := range vs {
		switch v.Algorithm {
		case FixedWindow, TokenBucket, SlidingWindow:
		default:
			t.Fatalf("%s: unknown algorithm %q", v.Name, v.Algorithm)
		}
		if seen[v.Name] {
			t.Fatalf("two vectors are named %q", v.Name)
		}
		seen[v.Name] = true
	}
	return vs
}

// stepResult is what a step gave, in the vectors' terms.
type stepResult struct {
	State   stepState
	Allowed bool
	Granted int64
}

// check reports every difference between got and v's expected result.
func (v stepVector) check(t *testing.T, got stepResult) {
	t.Helper()
	for _, d := range v.diff(got) {
		t.Error(d)
	}
}

// diff lists the differences between got and v's expected result; token
// balances are compared bit for bit.
func (v stepVector) diff(got stepResult) []string {
	var out []string
	w := v.Want
	if got.Allowed != w.Allowed || got.Granted != w.Granted {
		out = append(out, fmt.Sprintf("allowed %v, granted %d; want allowed %v, granted %d", got.Allowed, got.Granted, w.Allowed, w.Granted))
	}
	g, s := got.State, w.State
	switch v.Algorithm {
	case FixedWindow:
		if g.WindowEndUs != s.WindowEndUs || g.Count != s.Count {
			out = append(out, fmt.Sprintf("state (window_end_us %d, count %d); want (%d, %d)", g.WindowEndUs, g.Count, s.WindowEndUs, s.Count))
		}
	case TokenBucket:
		if math.Float64bits(g.Tokens) != math.Float64bits(s.Tokens) || g.UpdatedAtUs != s.UpdatedAtUs {
			out = append(out, fmt.Sprintf("state (tokens %v [%#x], updated_at_us %d); want (%v [%#x], %d)",
				g.Tokens, math.Float64bits(g.Tokens), g.UpdatedAtUs, s.Tokens, math.Float64bits(s.Tokens), s.UpdatedAtUs))
		}
	case SlidingWindow:
		switch {
		case s.WindowStartUs == nil || g.WindowStartUs == nil:
			out = append(out, "a next state always has a window start")
		case *g.WindowStartUs != *s.WindowStartUs || g.Count != s.Count || g.PrevCount != s.PrevCount:
			out = append(out, fmt.Sprintf("state (window_start_us %d, count %d, prev_count %d); want (%d, %d, %d)",
				*g.WindowStartUs, g.Count, g.PrevCount, *s.WindowStartUs, s.Count, s.PrevCount))
		}
	}
	return out
}

// TestStepVectors runs every vector through the Go steps the memory tier
// decides with.
func TestStepVectors(t *testing.T) {
	for _, v := range loadStepVectors(t) {
		t.Run(v.Name, func(t *testing.T) {
			var (
				next    memState
				allowed bool
				granted int64
				got     stepResult
			)
			st := v.State
			switch v.Algorithm {
			case FixedWindow:
				end, count := fixedWindowRow(st.WindowEndUs, st.Count, v.NowUs, v.WindowUs)
				next, allowed, granted = fixedWindowStep(end, count, v.Cost, v.MaxCount, v.Penalty, v.UpTo)
				got.State = stepState{WindowEndUs: next.at, Count: next.count}
			case TokenBucket:
				next, allowed, granted = tokenBucketStep(st.Tokens, st.UpdatedAtUs, v.NowUs, v.Cost,
					v.Capacity, v.RefillPerUs, v.Penalty, v.UpTo)
				got.State = stepState{Tokens: next.tokens, UpdatedAtUs: next.at}
			case SlidingWindow:
				// A key not seen yet: the memory tier's fresh state.
				start := windowStartUs(v.NowUs, v.WindowUs)
				if st.WindowStartUs != nil {
					start = *st.WindowStartUs
				}
				next, allowed, granted = slidingWindowStep(start, st.Count, st.PrevCount, v.NowUs, v.WindowUs,
					v.Cost, v.MaxCount, v.Penalty, v.UpTo)
				got.State = stepState{WindowStartUs: &next.at, Count: next.count, PrevCount: next.prev}
			}
			got.Allowed, got.Granted = allowed, granted
			v.check(t, got)
		})
	}
}

// TestStepVectorsSQL runs every vector through the SQL steps of migration
// 000012, on a real PostgreSQL.
func TestStepVectorsSQL(t *testing.T) {
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, v := range loadStepVectors(t) {
		t.Run(v.Name, func(t *testing.T) {
			var got stepResult
			st := v.State
			var err error
			switch v.Algorithm {
			case FixedWindow:
				// The row of the check's window, as the statements find it.
				err = pool.QueryRow(ctx, `
					SELECT (s).window_end_us, (s).count, (s).allowed, (s).granted
					  FROM (SELECT pgrl_fixed_window_take(
					                   pgrl_window_end_us($3::bigint, $4::bigint),
					                   CASE WHEN $1::bigint = pgrl_window_end_us($3::bigint, $4::bigint)
					                        THEN $2::bigint ELSE 0 END,
					                   $5::bigint, $6::bigint, $7::boolean, $8::boolean) AS s) AS x`,
					st.WindowEndUs, st.Count, v.NowUs, v.WindowUs, v.Cost, v.MaxCount, v.Penalty, v.UpTo,
				).Scan(&got.State.WindowEndUs, &got.State.Count, &got.Allowed, &got.Granted)
			case TokenBucket:
				var bits int64
				err = pool.QueryRow(ctx, `
					SELECT pgrl_float8_bits((s).tokens), (s).updated_at_us, (s).allowed, (s).granted
					  FROM (SELECT pgrl_token_bucket_take($1::float8, $2::bigint, $3::bigint, $4::bigint,
					                                      $5::float8, $6::float8, $7::boolean, $8::boolean) AS s) AS x`,
					st.Tokens, st.UpdatedAtUs, v.NowUs, v.Cost, v.Capacity, v.RefillPerUs, v.Penalty, v.UpTo,
				).Scan(&bits, &got.State.UpdatedAtUs, &got.Allowed, &got.Granted)
				got.State.Tokens = math.Float64frombits(uint64(bits))
			case SlidingWindow:
				var start int64
				err = pool.QueryRow(ctx, `
					SELECT (s).window_start_us, (s).count, (s).prev_count, (s).allowed, (s).granted
					  FROM (SELECT pgrl_sliding_window_take($1::bigint, $2::bigint, $3::bigint, $4::bigint,
					                                        $5::bigint, $6::bigint, $7::bigint, $8::boolean,
					                                        $9::boolean) AS s) AS x`,
					st.WindowStartUs, st.Count, st.PrevCount, v.NowUs, v.WindowUs, v.Cost, v.MaxCount,
					v.Penalty, v.UpTo,
				).Scan(&start, &got.State.Count, &got.State.PrevCount, &got.Allowed, &got.Granted)
				got.State.WindowStartUs = &start
			}
			if err != nil {
				t.Fatal(err)
			}
			v.check(t, got)
		})
	}
}
