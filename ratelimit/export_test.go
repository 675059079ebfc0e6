package ratelimit

// BatchedChecks reports how many of l's checks were decided in coalesced
// statements of two or more checks.
func BatchedChecks(l *Limiter) uint64 {
	if l.coalescer == nil {
		return 0
	}
	return l.coalescer.batched.Load()
}

// Coalesces reports whether l coalesces concurrent checks.
func Coalesces(l *Limiter) bool { return l.coalescer != nil }
