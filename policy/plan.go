package policy

import (
	"fmt"
	"sort"
	"strings"

	"github.com/pgrl/pgrl/ratelimit"
)

// Change is one difference between the stored policies and wanted ones.
type Change struct {
	// Op is "create", "update" or "delete".
	Op string
	// Name is the policy's name.
	Name string
	// Before is the stored policy (nil for a create); After the wanted
	// one (nil for a delete).
	Before, After *Policy
}

// Plan compares the stored policies with the wanted ones and returns what
// makes the first into the second, by name: a create for each wanted policy
// not stored, an update for each that differs (description included), and,
// with prune, a delete for each stored policy not wanted (its overrides go
// with it). It validates every wanted policy and refuses a name given
// twice, before anything is compared: a refused plan changes nothing.
func Plan(stored, want []Policy, prune bool) ([]Change, error) {
	byName := make(map[string]Policy, len(stored))
	for _, p := range stored {
		byName[p.Name] = p
	}
	seen := map[string]bool{}
	var out []Change
	for _, w := range want {
		if w.Algorithm == "" {
			w.Algorithm = ratelimit.DefaultAlgorithm
		}
		if err := w.Validate(); err != nil {
			return nil, err
		}
		if seen[w.Name] {
			return nil, invalid(nil, "policy %q is given twice; keep one", w.Name)
		}
		seen[w.Name] = true
		cur, ok := byName[w.Name]
		switch {
		case !ok:
			out = append(out, Change{Op: "create", Name: w.Name, After: &w})
		case !cur.same(w) || cur.Description != w.Description:
			out = append(out, Change{Op: "update", Name: w.Name, Before: &cur, After: &w})
		}
	}
	if prune {
		for _, p := range stored {
			if !seen[p.Name] {
				out = append(out, Change{Op: "delete", Name: p.Name, Before: &p})
			}
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// String describes the change in one line. What Summary leaves out is
// shown when it changes: the description (also when a policy is created
// with one), and the burst of an algorithm that does not use it.
func (c Change) String() string {
	switch c.Op {
	case "create":
		s := fmt.Sprintf("create %s: %s", c.Name, c.After.Summary())
		if c.After.Description != "" {
			s += fmt.Sprintf("; description %q", c.After.Description)
		}
		return s
	case "delete":
		return fmt.Sprintf("delete %s (was %s) and its overrides", c.Name, c.Before.Summary())
	}
	var hidden []string
	if c.Before.Burst != c.After.Burst && c.Before.Algorithm != ratelimit.TokenBucket && c.After.Algorithm != ratelimit.TokenBucket {
		hidden = append(hidden, fmt.Sprintf("burst %s -> %s (used by token_bucket only)", burstWords(c.Before.Burst), burstWords(c.After.Burst)))
	}
	if c.Before.Description != c.After.Description {
		hidden = append(hidden, fmt.Sprintf("description %q -> %q", c.Before.Description, c.After.Description))
	}
	if before, after := c.Before.Summary(), c.After.Summary(); before != after {
		return strings.Join(append([]string{fmt.Sprintf("update %s: %s -> %s", c.Name, before, after)}, hidden...), "; ")
	}
	return fmt.Sprintf("update %s: %s (limit unchanged: %s)", c.Name, strings.Join(hidden, "; "), c.After.Summary())
}

// burstWords is a stored burst in words: 0 is the limit.
func burstWords(b int64) string {
	if b == 0 {
		return "=limit"
	}
	return fmt.Sprint(b)
}

// Summary describes the policy's limit in a few words, such as
// "fixed_window, 100 per 1m0s, hashed keys".
func (p Policy) Summary() string {
	s := fmt.Sprintf("%s, %d per %s", p.Algorithm, p.Limit, p.Window)
	if p.Algorithm == ratelimit.TokenBucket {
		if p.Burst == 0 {
			s += ", burst =limit"
		} else {
			s += fmt.Sprintf(", burst %d", p.Burst)
		}
	}
	if p.Penalty {
		s += ", penalty"
	}
	if p.KeyMode == ratelimit.ReadableKeys {
		return s + ", readable keys"
	}
	return s + ", hashed keys"
}
