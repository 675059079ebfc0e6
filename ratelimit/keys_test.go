package ratelimit_test

import (
	"bytes"
	"testing"

	"github.com/pgrl/pgrl/ratelimit"
)

// TestStoredKeyIsANameScopedDigest checks what rl-bench's raw path and
// users of package gen rely on: a stable 16-byte digest scoped by the name.
func TestStoredKeyIsANameScopedDigest(t *testing.T) {
	t.Parallel()
	h := func(name, key string) []byte { return ratelimit.StoredKey(ratelimit.HashedKeys, name, key) }
	a, b := h("n", "k"), h("n", "k")
	if len(a) != 16 || !bytes.Equal(a, b) || bytes.Equal(a, h("m", "k")) || bytes.Equal(h("ab", "c"), h("a", "bc")) {
		t.Errorf("StoredKey is not a stable name-scoped 16-byte digest")
	}
	if got := ratelimit.StoredKey(ratelimit.ReadableKeys, "n", "k"); string(got) != "n:k" {
		t.Errorf("readable key %q, want n:k", got)
	}
}
