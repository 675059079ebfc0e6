package tests

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// How long fixed-window checks wait while `rl-migrate layout partitioned`
// switches a table of 100,000 live rows (docs/CLEANUP.md quotes the figures
// this logs; run it with -v). The partitions are made before the table is
// locked, so the longest wait must be well under the whole switch, and
// checks of the other algorithms never wait.
func TestPartitionSwitchWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, m := migrated(t, migration.Config{})
	admin := dbtest.Admin(t)
	const rows = 100_000
	_, err := admin.Exec(ctx, "INSERT INTO "+pgx.Identifier{s, "pgrl_fixed_window"}.Sanitize()+
		" SELECT decode(md5(i::text), 'hex'), date_trunc('hour', now()) + interval '1 hour', 1, true FROM generate_series(1, $1) AS i", rows)
	require.NoError(t, err)

	pool := dbtest.PoolOn(t, s, dbtest.WithMaxConns(8))
	// The checks measure how long the switch holds them: a Timeout longer
	// than any such wait (by default a check gives up after 500ms).
	l, err := testkit.New(pool, ratelimit.Config{Name: "w", Limit: 1 << 40, Window: time.Minute, OnFailure: ratelimit.FailError, DenyCacheSize: -1}, ratelimit.DatabaseOptions{DisableCoalescing: true, Timeout: time.Minute})
	require.NoError(t, err)
	// Warm up until the checks answer (a busy machine may be slow to start).
	for i := 0; ; i++ {
		_, err := l.Allow(ctx, "warm")
		if err == nil {
			break
		}
		require.Less(t, i, 100, "checks never answered: %v", err)
		time.Sleep(50 * time.Millisecond)
	}

	var stop atomic.Bool
	var mu sync.Mutex
	var waits []time.Duration
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				t0 := time.Now()
				_, err := l.Allow(ctx, string(rune('a'+w)))
				d := time.Since(t0)
				if err != nil {
					t.Errorf("check during the switch: %v", err)
					return
				}
				mu.Lock()
				waits = append(waits, d)
				mu.Unlock()
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	t0 := time.Now()
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	switchTook := time.Since(t0)
	time.Sleep(200 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	require.NoError(t, err)

	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	longest := waits[len(waits)-1]
	t.Logf("layout switch of %d live rows took %s; %d checks during it, median %s, p99 %s, longest %s",
		rows, switchTook.Round(time.Millisecond), len(waits), waits[len(waits)/2], waits[len(waits)*99/100], longest.Round(time.Millisecond))
	require.Less(t, longest, switchTook, "checks wait for the copy, not for partition creation")

	var n int
	require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{s, "pgrl_fixed_window"}.Sanitize()).Scan(&n))
	require.GreaterOrEqual(t, n, rows)
}
