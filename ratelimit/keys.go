package ratelimit

import (
	"crypto/sha256"
	"encoding/binary"
)

// digestSize is the size of a hashed key in the counter tables.
const digestSize = 16

// storedKey returns the bytes stored in the key column for a limiter's name
// and a caller's key. Any bytes are a valid key: empty, NUL, invalid UTF-8,
// megabytes long. Hashed keys are the first 16 bytes of
// SHA-256(len(name) || name || key), so names and keys cannot run into each
// other.
func storedKey(mode KeyMode, name, key string) []byte {
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
