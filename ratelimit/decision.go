package ratelimit

import (
	"math"
	"strconv"
	"time"
)

// Store names what answered a check.
type Store string

const (
	// StorePostgres means the shared counter in PostgreSQL decided.
	StorePostgres Store = "postgres"
	// StoreMemory means an in-process limiter decided: a MemoryLimiter, or
	// the memory fallback of a limiter whose database failed.
	StoreMemory Store = "memory"
	// StoreDenyCache means the local deny cache answered: PostgreSQL had
	// already denied the key until a known instant that has not yet come.
	StoreDenyCache Store = "deny_cache"
	// StorePolicy means no store answered: the database failed and the
	// limiter's failure policy (fail open or fail closed) decided.
	StorePolicy Store = "policy"
)

// Decision is the outcome of a check.
type Decision struct {
	// Allowed reports whether the request may proceed.
	Allowed bool
	// Limit is the most units the limit admits at once: the window's quota,
	// or the token bucket's capacity.
	Limit int64
	// Remaining is how many more units the limit would admit right now,
	// after this check. Never negative.
	Remaining int64
	// ResetAt is when the limit is fully available again if nothing else
	// is counted: the end of the fixed window, the instant the token bucket
	// is full, or the end of the sliding window's next window.
	ResetAt time.Time
	// RetryAfter is, for a denied check, how long until the same check
	// could be admitted; zero when allowed. Never negative.
	RetryAfter time.Duration
	// Now is the instant the decision was made at, on the clock of the
	// store that made it (the database's clock for StorePostgres).
	Now time.Time
	// Store says what answered.
	Store Store
	// ShadowDenied reports, for a limiter in shadow mode, that the limit
	// would have denied this check (Allowed is true regardless).
	ShadowDenied bool
	// Reason explains a decision that PostgreSQL did not make, such as
	// "database unavailable: fail open"; empty otherwise.
	Reason string
}

// ResetAfter is how long from Now until ResetAt; never negative.
func (d Decision) ResetAfter() time.Duration {
	return max(d.ResetAt.Sub(d.Now), 0)
}

// RetryAfterSeconds is RetryAfter in whole seconds, rounded up, as the HTTP
// Retry-After header wants it. It is 0 for an allowed check and at least 1
// for a denied one whose RetryAfter is positive.
func (d Decision) RetryAfterSeconds() int64 {
	return ceilSeconds(d.RetryAfter)
}

// RetryAfterHeader is RetryAfterSeconds formatted for the Retry-After header.
func (d Decision) RetryAfterHeader() string {
	return strconv.FormatInt(d.RetryAfterSeconds(), 10)
}

// ceilSeconds rounds a duration up to whole seconds; negative durations give 0.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(math.Ceil(d.Seconds()))
}
