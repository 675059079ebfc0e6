package ratelimit

import (
	"strings"
	"time"
)

// Algorithm selects how a limiter counts.
type Algorithm string

const (
	// FixedWindow counts units in windows of Window aligned on the clock
	// (multiples of Window since the Unix epoch) and admits at most Limit
	// per window.
	FixedWindow Algorithm = "fixed_window"
	// TokenBucket holds up to Burst tokens and refills Limit tokens per
	// Window, continuously; a check spends its cost in tokens.
	TokenBucket Algorithm = "token_bucket"
	// SlidingWindow estimates the units counted in the Window that ends now
	// from the current and the previous fixed window, weighting the previous
	// one by how much of it the sliding window still covers, and admits at
	// most Limit.
	SlidingWindow Algorithm = "sliding_window"
)

// Algorithms lists the three algorithms.
var Algorithms = []Algorithm{FixedWindow, TokenBucket, SlidingWindow}

// ParseAlgorithm accepts an algorithm's name as written in Algorithms.
func ParseAlgorithm(s string) (Algorithm, error) {
	for _, a := range Algorithms {
		if string(a) == s {
			return a, nil
		}
	}
	return "", invalid(ErrInvalidAlgorithm, "%q; use fixed_window, token_bucket or sliding_window", s)
}

// KeyMode says how keys are stored in the counter tables.
type KeyMode int

const (
	// HashedKeys stores a 16-byte digest (truncated SHA-256) of the
	// limiter's name and the key. The table never holds the raw identifier
	// (an email, an IP). This is the default.
	HashedKeys KeyMode = iota
	// ReadableKeys stores "name:key" as bytes, so the table can be read by
	// a person: `SELECT encode(key, 'escape') FROM pgrl_fixed_window`.
	// The raw identifiers are then in the database; choose it only when
	// that is acceptable. Names may not contain ':' in this mode.
	ReadableKeys
)

// Minimum and maximum windows a limiter accepts.
const (
	MinWindow = time.Millisecond
	MaxWindow = 366 * 24 * time.Hour
)

// Config describes one limit.
type Config struct {
	// Name identifies the limit, such as "login:email+ip". Keys are scoped
	// by it: two limiters with different names never share a counter, even
	// for the same key. Required.
	Name string

	// Algorithm chooses how to count. Defaults to FixedWindow.
	Algorithm Algorithm

	// Limit is the most units admitted per Window (fixed and sliding
	// window), or the token bucket's refill: Limit tokens per Window.
	// Required; must be positive.
	Limit int64

	// Window is the window's length, or the token bucket's refill period.
	// Required; between MinWindow and MaxWindow.
	Window time.Duration

	// Burst is the token bucket's capacity: the most units it admits at
	// once after being idle. Defaults to Limit. Ignored by the window
	// algorithms.
	Burst int64

	// Penalty counts every attempt, denied ones included, so that a client
	// that keeps trying stays locked out until it stops (as in a login
	// form). With Penalty false (the default), a denied check consumes
	// nothing. With the token bucket, a penalised balance may fall to
	// -Burst: the client must wait for the debt to refill.
	Penalty bool

	// KeyMode chooses how keys are stored. Defaults to HashedKeys.
	KeyMode KeyMode

	// Now pins the instant each check is decided at, for tests that replay
	// a sequence of instants. Leave it nil in production: the database's
	// clock decides, so that every instance of an application agrees.
	// Defaults to nil.
	Now func() time.Time
}

// capacity is the most units one check can ask for.
func (c Config) capacity() int64 {
	if c.Algorithm == TokenBucket {
		return c.Burst
	}
	return c.Limit
}

// withDefaults fills defaults and validates.
func (c Config) withDefaults() (Config, error) {
	if c.Algorithm == "" {
		c.Algorithm = FixedWindow
	}
	if _, err := ParseAlgorithm(string(c.Algorithm)); err != nil {
		return c, err
	}
	if c.Name == "" {
		return c, invalid(ErrInvalidName, "empty name; give every limiter a name such as \"login:ip\"")
	}
	if c.KeyMode == ReadableKeys && strings.Contains(c.Name, ":") {
		return c, invalid(ErrInvalidName, "%q contains ':', which readable keys use as the separator; rename it", c.Name)
	}
	if c.Limit <= 0 {
		return c, invalid(ErrInvalidLimit, "%d for %q; the limit must be at least 1", c.Limit, c.Name)
	}
	if c.Window <= 0 {
		return c, invalid(ErrInvalidWindow, "%v for %q; the window must be positive, such as time.Minute", c.Window, c.Name)
	}
	if c.Window < MinWindow || c.Window > MaxWindow {
		return c, invalid(ErrInvalidWindow, "%v for %q; use a window between %v and %v", c.Window, c.Name, MinWindow, MaxWindow)
	}
	if c.Window%time.Microsecond != 0 {
		return c, invalid(ErrInvalidWindow, "%v for %q; the window must be a whole number of microseconds", c.Window, c.Name)
	}
	if c.Burst < 0 {
		return c, invalid(ErrInvalidBurst, "%d for %q; the burst must be at least 1 (or 0 for the default, Limit)", c.Burst, c.Name)
	}
	if c.Burst == 0 {
		c.Burst = c.Limit
	}
	return c, nil
}

// checkCost validates one check's cost.
func (c Config) checkCost(n int64) error {
	if n <= 0 {
		return invalid(ErrInvalidCost, "%d for %q; a check costs at least 1", n, c.Name)
	}
	if n > c.capacity() {
		return invalid(ErrCostExceedsLimit, "cost %d for %q can never be admitted: the limit admits at most %d at once; raise the limit (or Burst) or split the work", n, c.Name, c.capacity())
	}
	return nil
}
