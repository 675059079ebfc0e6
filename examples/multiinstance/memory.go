package main

import (
	"context"
	"sync"
	"time"

	"github.com/pgrl/pgrl/ratelimit"
)

// memoryLimiter is the per-process limiter of the first round: a fixed
// window counter in a map, the kind of limiter an application starts with.
// Each process has its own map, which is the point of the demo.
type memoryLimiter struct {
	cfg    ratelimit.Config
	mu     sync.Mutex
	counts map[string]memoryWindow
}

type memoryWindow struct {
	end   time.Time
	count int64
}

func newMemoryLimiter(cfg ratelimit.Config) (allower, error) {
	return &memoryLimiter{cfg: cfg, counts: map[string]memoryWindow{}}, nil
}

// AllowN admits n units for key when the key's current window has room.
func (m *memoryLimiter) AllowN(_ context.Context, key string, n int64) (ratelimit.Decision, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	w := m.counts[key]
	if !now.Before(w.end) {
		w = memoryWindow{end: now.Truncate(m.cfg.Window).Add(m.cfg.Window)}
	}
	allowed := w.count+n <= m.cfg.Limit
	if allowed || m.cfg.Penalty {
		w.count += n
	}
	m.counts[key] = w
	return ratelimit.Decision{
		Allowed:   allowed,
		Limit:     m.cfg.Limit,
		Remaining: max(m.cfg.Limit-w.count, 0),
		ResetAt:   w.end,
		Now:       now,
		Store:     ratelimit.StoreMemory,
	}, nil
}
