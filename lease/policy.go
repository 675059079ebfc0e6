package lease

import (
	"fmt"
	"sync"

	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// NewPolicy returns a lease limiter on a stored policy: each key's slices
// are taken at the policy's figures, or at the key's override's, as pl
// applies them now. pl must check from its Cache (policy.Options.FromCache),
// kept current by a policy.Listener: when the policy or the key's override
// changes, the Cache's reload gives pl a new limiter, and the key's next
// check ends its slice (returning the units) and takes the next one at the
// new figures. So a slice never outlives a change this process has seen;
// without a Listener, pl's Cache, and so the leases, never see one.
//
// The policy must be one New would lease (ErrUnsupported otherwise, at the
// first check of a key once the policy changes to one that is not);
// Options.Size is at least 1, and a slice is never more than the key's
// limit.
func NewPolicy(pl *policy.Limiter, opts Options) (*Limiter, error) {
	if pl == nil {
		return nil, ErrNilLimiter
	}
	l, err := pl.For("")
	if err != nil {
		return nil, err
	}
	if _, err := newSource(l); err != nil {
		return nil, err
	}
	s := &sources{pl: pl, m: map[*ratelimit.Limiter]*source{}}
	return start(pl, pl.Name(), s.source, opts)
}

// sources remembers the source of each limiter a policy gave, so that a
// key's check compares pointers: a new limiter is a changed policy.
type sources struct {
	pl *policy.Limiter
	mu sync.Mutex
	m  map[*ratelimit.Limiter]*source
}

// maxSources bounds sources.m: the limiters of policy versions long
// replaced are forgotten with the rest when it is full.
const maxSources = 1024

func (s *sources) source(key string) (*source, error) {
	l, err := s.pl.For(key)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if src := s.m[l]; src != nil {
		return src, nil
	}
	src, err := newSource(l)
	if err != nil {
		return nil, fmt.Errorf("policy %q as it is now: %w", s.pl.Name(), err)
	}
	if len(s.m) >= maxSources {
		clear(s.m)
	}
	s.m[l] = src
	return src, nil
}
