package ratelimit_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/pgrl/pgrl/ratelimit"
)

// BenchmarkMemoryAllow measures parallel checks through the memory tier:
// over 10,000 keys (spread over the shards) and on one hot key (one lock),
// for each algorithm, on the real monotonic clock.
func BenchmarkMemoryAllow(b *testing.B) {
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = "user:" + strconv.Itoa(i)
	}
	for _, alg := range ratelimit.Algorithms {
		for _, tc := range []struct {
			name string
			keys []string
		}{{"keys=10000", keys}, {"hotkey", keys[:1]}} {
			b.Run(string(alg)+"/"+tc.name, func(b *testing.B) {
				m, err := ratelimit.NewMemory(ratelimit.Config{Name: "bench", Algorithm: alg, Limit: 1000, Window: time.Second}, ratelimit.MemoryOptions{})
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					i := 0
					for pb.Next() {
						if _, err := m.Allow(ctx, tc.keys[i%len(tc.keys)]); err != nil {
							b.Fatal(err)
						}
						i += 7
					}
				})
			})
		}
	}
}
