package main

import (
	"github.com/pgrl/pgrl/ratelimit"
)

// newMemoryLimiter returns the per-process limiter of the first round:
// pgrl's in-process memory tier, with the same configuration as the
// PostgreSQL round. Each process has its own, which is the point of the demo.
func newMemoryLimiter(cfg ratelimit.Config) (ratelimit.Checker, error) {
	return ratelimit.NewMemory(cfg, ratelimit.MemoryOptions{})
}
