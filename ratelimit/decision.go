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
	// StoreLease means a slice of the key's quota that this process had
	// already counted in PostgreSQL answered, without a round trip (package
	// lease). The units were counted in the shared counter before the
	// check: a lease never admits more than the limit.
	StoreLease Store = "lease"
)

// Decision is the outcome of a check.
type Decision struct {
	// Allowed reports whether the request may proceed.
	Allowed bool
	// Granted is how many units the check took: for Cost(n), n when
	// Allowed and 0 when not; for UpTo(n), what was left of n (0 to n,
	// never more than Limit, Allowed when more than 0). Under Penalty a
	// check is charged its whole cost whatever it was granted (a partial
	// grant its ask, at most Limit). A shadow-mode denial reports what the
	// check was granted, 0, though it proceeds.
	Granted int64
	// Limit is the most units the limit admits at once: the window's quota,
	// or the token bucket's capacity.
	Limit int64
	// Used is how much of Limit this key has used after this check: for
	// the fixed window, the units counted in the current window; for the
	// sliding window, its estimate (the current window's count plus the
	// previous window's, weighted by how much of it the sliding window
	// still covers), rounded up; for the token bucket, Burst minus the
	// balance, rounded up. Under Penalty it can exceed Limit (denied
	// attempts count too, and a token bucket can fall to -Burst, so Used
	// reaches 2*Burst). Remaining is max(Limit-Used, 0) for a single
	// limit; with Spread, both are estimates (a row's figure times Spread,
	// or the sum over rows for Peek). Zero for a decision that no store
	// counted (Store == StorePolicy, or a deny-cache answer for a check
	// that another limit of AllowAll denied).
	Used int64
	// Remaining is what a next check of this key may take right now: a
	// check of cost Remaining or less made at the same instant would be
	// admitted, one of more would not. Never negative, so it cannot tell
	// "exactly at the limit" from "over it": Used can.
	Remaining int64
	// ResetAt is when the limit is fully available again if nothing else
	// is counted (Used back to 0). For the fixed window it is the end of
	// the current window. For the token bucket it is the instant the bucket
	// is full, Used/Limit windows away: beyond one Window when Burst
	// exceeds Limit, and under Penalty when the balance is in debt (below
	// zero), up to twice Burst/Limit windows. For the sliding window it can be up to
	// two windows away: units counted in the current window still weigh in
	// the next one, so it is the end of the next window (or of the current
	// one when nothing was counted in it yet).
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
	// Replayed reports a check with a RequestID whose id was decided
	// before: the decision is that first one (its figures as they were
	// then), and nothing was counted now.
	Replayed bool
	// Reason explains a decision that PostgreSQL did not make, such as
	// "database unavailable: fail open"; empty otherwise.
	Reason string
}

// granting sets Granted.
func (d Decision) granting(n int64) Decision {
	d.Granted = n
	return d
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
