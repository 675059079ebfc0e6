package testkit

import (
	"sync"
	"time"

	"github.com/pgrl/pgrl/ratelimit"
)

// Observer is a ratelimit.Observer that records what it is shown, for
// tests: the name and decision of every check, and the breaker's events.
type Observer struct {
	mu        sync.Mutex
	names     []string
	decisions []ratelimit.Decision
	breaker   []string
}

// ObserveDecision records the check's limiter name and decision.
func (o *Observer) ObserveDecision(name string, d ratelimit.Decision, _ time.Duration, _ error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.names = append(o.names, name)
	o.decisions = append(o.decisions, d)
}

// ObserveBreaker records "open NAME" or "closed NAME".
func (o *Observer) ObserveBreaker(name string, open bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	state := "closed "
	if open {
		state = "open "
	}
	o.breaker = append(o.breaker, state+name)
}

// Names is the limiter name of every decision seen so far, in order.
func (o *Observer) Names() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.names...)
}

// Decisions is every decision seen so far, in order.
func (o *Observer) Decisions() []ratelimit.Decision {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]ratelimit.Decision(nil), o.decisions...)
}

// BreakerEvents is every breaker event seen so far, in order.
func (o *Observer) BreakerEvents() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.breaker...)
}
