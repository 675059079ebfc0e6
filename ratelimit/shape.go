package ratelimit

import (
	"math"
	"math/bits"
	"time"
)

// shape is a limit's arithmetic: how a counter's state after a check becomes
// a Decision. The Postgres limiter and the memory limiter share it, so both
// report exactly the same figures for the same state.
type shape struct {
	cfg         Config // defaults filled in
	windowUs    int64
	refillPerUs float64 // token bucket refill, tokens per microsecond
}

func newShape(cfg Config) shape {
	w := cfg.Window.Microseconds()
	return shape{cfg: cfg, windowUs: w, refillPerUs: float64(cfg.Limit) / float64(w)}
}

// fixedDecision builds a fixed-window decision from the window's state.
func (s *shape) fixedDecision(allowed bool, count int64, expiresAt, now time.Time) Decision {
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Limit,
		Remaining: max(s.cfg.Limit-count, 0),
		ResetAt:   expiresAt,
		Now:       now,
		Store:     StorePostgres,
	}
	if !allowed {
		// The next window admits any valid cost.
		d.RetryAfter = max(expiresAt.Sub(now), 0)
	}
	return d
}

// tokenDecision builds a token-bucket decision from the balance after the
// check, taken at instant at.
func (s *shape) tokenDecision(allowed bool, tokens float64, at, fullAt time.Time, cost int64) Decision {
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Burst,
		Remaining: int64(math.Floor(max(tokens, 0))),
		ResetAt:   fullAt,
		Now:       at,
		Store:     StorePostgres,
	}
	if !allowed {
		d.RetryAfter = max(usToDuration((float64(cost)-tokens)/s.refillPerUs), 0)
	}
	return d
}

// elapsedUs is how far now is into the window starting at start, clamped to
// [0, window].
func (s *shape) elapsedUs(start, now time.Time) int64 {
	return min(max(now.Sub(start).Microseconds(), 0), s.windowUs)
}

// slidingRemaining is floor(limit - prev*(w-e)/w - cur), at least 0,
// computed exactly in integers (a float64 cannot hold every bigint):
// limit - cur - ceil(prev*(w-e)/w). All inputs are non-negative.
func slidingRemaining(prev, cur, e, w, limit int64) int64 {
	if cur >= limit {
		return 0
	}
	hi, lo := bits.Mul64(uint64(prev), uint64(w-e))
	q, r := bits.Div64(hi, lo, uint64(w)) // q <= prev: hi < w
	if r > 0 {
		q++
	}
	room := uint64(limit - cur)
	if q >= room {
		return 0
	}
	return int64(room - q)
}

// slidingDecision builds a sliding-window decision from the row's state
// after the check.
func (s *shape) slidingDecision(allowed bool, start time.Time, cur, prev int64, now time.Time, cost int64) Decision {
	w := s.windowUs
	e := s.elapsedUs(start, now)
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Limit,
		Remaining: slidingRemaining(prev, cur, e, w, s.cfg.Limit),
		ResetAt:   start.Add(2 * s.cfg.Window),
		Now:       now,
		Store:     StorePostgres,
	}
	if cur == 0 {
		d.ResetAt = start.Add(s.cfg.Window)
	}
	if !allowed {
		d.RetryAfter = max(s.slidingRetryAfter(start, cur, prev, e, cost), 0)
	}
	return d
}

// slidingRetryAfter finds how long until estimate + cost <= limit, with no
// further units counted: the previous window's weight shrinks through the
// current window, then the current count becomes the previous one.
func (s *shape) slidingRetryAfter(start time.Time, cur, prev, e, cost int64) time.Duration {
	w := float64(s.windowUs)
	room := float64(s.cfg.Limit - cur - cost)
	if room >= 0 && prev > 0 {
		// Within this window: prev*(w-x)/w <= room  <=>  x >= w - room*w/prev.
		x := math.Ceil(w - room*w/float64(prev))
		if x <= w {
			return usToDuration(x - float64(e))
		}
	}
	// In the next window the current count weighs as the previous one:
	// cur*(w-x)/w + cost <= limit  <=>  x >= w - (limit-cost)*w/cur.
	x := 0.0
	if cur > 0 {
		x = max(math.Ceil(w-float64(s.cfg.Limit-cost)*w/float64(cur)), 0)
	}
	return usToDuration(w - float64(e) + x)
}
