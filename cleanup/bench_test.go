package cleanup_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
)

// BenchmarkCleanupLatency measures what a delete-mode cleanup of 1,000,000
// expired fixed-window rows does to the checks running beside it. In one run
// it times checks (4 goroutines, 1,000 live keys) for 3 s with no cleanup
// (after a 1 s warm-up),
// then while the cleanup runs, and reports both p99s and their ratio
// (p99-ratio; the target is at most 3). The whole scenario runs once per
// benchmark iteration: use -benchtime=1x.
//
//	go test ./cleanup -run XXX -bench BenchmarkCleanupLatency -benchtime=1x
func BenchmarkCleanupLatency(b *testing.B) {
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		db, _ := dbtest.Pool(b)
		ctx := context.Background()
		insertExpired(b, db, 1_000_000)
		_, err := db.Exec(ctx, "VACUUM ANALYZE pgrl_fixed_window")
		require.NoError(b, err)
		at := time.Now().Add(240 * time.Hour)
		const keys, workers = 1000, 4
		for k := 0; k < keys; k++ {
			_, err := take(ctx, db, liveKey(k), at)
			require.NoError(b, err)
		}

		measure := func(during func()) []time.Duration {
			var mu sync.Mutex
			var all []time.Duration
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					var mine []time.Duration
					for i := w; ; i += workers {
						select {
						case <-stop:
							mu.Lock()
							all = append(all, mine...)
							mu.Unlock()
							return
						default:
						}
						t0 := time.Now()
						if _, err := take(ctx, db, liveKey(i%keys), at); err != nil {
							b.Error(err)
						}
						mine = append(mine, time.Since(t0))
					}
				}(w)
			}
			during()
			close(stop)
			wg.Wait()
			slices.Sort(all)
			return all
		}
		pct := func(d []time.Duration, p float64) time.Duration { return d[int(float64(len(d)-1)*p)] }

		measure(func() { time.Sleep(time.Second) }) // warm up
		b.StartTimer()
		base := measure(func() { time.Sleep(3 * time.Second) })
		var res cleanup.Result
		during := measure(func() {
			res, err = cleanup.Run(ctx, db, cleanup.Options{})
			require.NoError(b, err)
		})
		b.StopTimer()
		require.Equal(b, int64(1_000_000), res.Tables.FixedWindow.Deleted)

		b.ReportMetric(float64(pct(base, 0.99).Microseconds()), "base-p99-us")
		b.ReportMetric(float64(pct(during, 0.99).Microseconds()), "cleanup-p99-us")
		b.ReportMetric(float64(pct(during, 0.99))/float64(pct(base, 0.99)), "p99-ratio")
		b.ReportMetric(float64(res.Duration.Milliseconds()), "cleanup-ms")
		b.Logf("checks without cleanup: n=%d p50=%s p99=%s; during cleanup (%s, %d batches): n=%d p50=%s p99=%s; p99 ratio %.2f",
			len(base), pct(base, 0.5), pct(base, 0.99), res.Duration.Round(time.Millisecond), res.Batches,
			len(during), pct(during, 0.5), pct(during, 0.99), float64(pct(during, 0.99))/float64(pct(base, 0.99)))
	}
}
