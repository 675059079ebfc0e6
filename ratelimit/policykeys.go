package ratelimit

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/sqlops"
)

// maxPolicyKeys is the most override keys a limiter holds for its stored
// policy (about 1 MB of hashed keys). A limiter of a policy with more reads
// the key's override in every check's statement.
const maxPolicyKeys = 10_000

// policyKeys is what a limiter (Config.Policy) knows of its stored
// policy's overrides: the stored keys they had at one overrides_revision
// (migration 000021), read together in one statement. A key outside them
// has no override while the policy's row holds that revision.
type policyKeys struct {
	revision int64
	keys     map[string]struct{}
}

// policyOverrides is what a Database knows of one stored policy's
// overrides, shared by the limiters it made for that policy (package policy
// builds a new one whenever its policy changes), which lets a check of a
// key without one read the policy's row alone (takeUnderPolicy).
type policyOverrides struct {
	// known is nil until a check found the policy with overrides, and then
	// holds their keys as last read.
	known atomic.Pointer[policyKeys]
	// reading serialises reads of the keys; a check that finds one under
	// way does not wait for it.
	reading sync.Mutex
}

// policyOverrides returns what st knows of the overrides of the stored
// policy named policy.
func (st *Database) policyOverrides(policy string) *policyOverrides {
	if p, ok := st.policies.Load(policy); ok {
		return p.(*policyOverrides)
	}
	p, _ := st.policies.LoadOrStore(policy, &policyOverrides{})
	return p.(*policyOverrides)
}

// leanPolicy reports whether a check of key (stored as k) may send
// takeUnderPolicy, with the revision to send (0 when no keys were read: the
// statement then counts only while the policy has no override at all) and
// the knowledge that is based on. okey is the key as the policy's overrides
// store it, when it was needed (else nil).
func (l *Limiter) leanPolicy(key string, k []byte) (okey []byte, revision int64, seen *policyKeys, lean bool) {
	if l.overrides == nil || l.overridesOff.Load() {
		return nil, 0, nil, false
	}
	seen = l.overrides.known.Load()
	if seen == nil {
		return nil, 0, nil, true
	}
	okey = l.policyKey(key, k)
	_, overridden := seen.keys[string(okey)]
	return okey, seen.revision, seen, !overridden
}

// rereadPolicyKeys reads the policy's override keys again after a
// takeUnderPolicy sent with seen counted nothing, unless another check has
// read them since. When the revision is the one seen, the policy's row no
// longer holds the limiter's figures: its checks read the key's override
// from then on (overridesOff), as they do when the policy has more than
// maxPolicyKeys overrides or no longer exists (takePolicy reports that).
// An error leaves what is known as it is: the check that sent the
// statement has its decision already.
func (l *Limiter) rereadPolicyKeys(ctx context.Context, db DB, seen *policyKeys) {
	p := l.overrides
	if !p.reading.TryLock() {
		return
	}
	defer p.reading.Unlock()
	if p.known.Load() != seen {
		return
	}
	r, err := sqlops.New().PolicyOverrideKeys(ctx, db, sqlops.PolicyOverrideKeysParams{Policy: l.cfg.Policy, MaxKeys: maxPolicyKeys})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		l.overridesOff.Store(true)
		return
	case err != nil:
		return
	case len(r.Keys) > maxPolicyKeys || (seen != nil && r.OverridesRevision == seen.revision):
		l.overridesOff.Store(true)
		return
	}
	next := &policyKeys{revision: r.OverridesRevision, keys: make(map[string]struct{}, len(r.Keys))}
	for _, k := range r.Keys {
		next.keys[string(k)] = struct{}{}
	}
	p.known.Store(next)
}
