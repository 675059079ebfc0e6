package ratelimit

import (
	"crypto/sha256"
	"encoding/binary"
)

// Limits of readable keys (KeyMode ReadableKeys), where the table stores
// "name:key" as given and PostgreSQL's index holds it: an index entry must
// fit in a third of a page (about 2,700 bytes), so the two together stay
// well below that. Hashed keys (the default) take keys of any length.
const (
	// MaxReadableKeyBytes is the longest key a check accepts with
	// readable keys; a longer one gets ErrKeyTooLong.
	MaxReadableKeyBytes = 2048
	// MaxReadableNameBytes is the longest limiter name Database.Limiter accepts with
	// readable keys.
	MaxReadableNameBytes = 256
)

// digestSize is the size of a hashed key in the counter tables.
const digestSize = 16

// StoredKey returns the bytes a limiter named name stores in the key column
// for a caller's key, under mode: what to pass to package gen's queries to
// reach the same counter as the library (rl-bench's raw path does this). Any bytes are a valid key: empty, NUL, invalid UTF-8,
// megabytes long. Hashed keys are the first 16 bytes of
// SHA-256(len(name) || name || key), so names and keys cannot run into each
// other.
func StoredKey(mode KeyMode, name, key string) []byte {
	if mode == ReadableKeys {
		b := make([]byte, 0, len(name)+1+len(key))
		b = append(b, name...)
		b = append(b, ':')
		return append(b, key...)
	}
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(name)))])
	h.Write([]byte(name))
	h.Write([]byte(key))
	var sum [sha256.Size]byte
	return h.Sum(sum[:0])[:digestSize]
}
