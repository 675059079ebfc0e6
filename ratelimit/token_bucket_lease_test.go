package ratelimit_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/ratelimit"
)

// The lease time the Go side knows is the one migration 000016 counts
// leases with.
func TestTokenBucketLeaseTimeIsTheSQLOne(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	var us int64
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT pgrl_token_bucket_lease_us(0)").Scan(&us))
	require.Equal(t, ratelimit.TokenBucketLeaseTime.Microseconds(), us)
}

func i64(v int64) *int64 { return &v }

// TestTokenBucketLeasedVectors runs the lease helpers of migration 000016
// on rows' lease counts: what may still be out at an instant, the counts
// rolled forward to its epoch, the epoch that holds it, and when the
// leases are over.
func TestTokenBucketLeasedVectors(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	const e = 10_000_000 // a lease epoch: [10 s, 11 s)
	for _, v := range []struct {
		name       string
		epoch      *int64
		cur, prev  *int64
		nowUs      int64
		leased     int64 // units possibly out at nowUs
		rolledCur  int64 // leased, rolled to nowUs's epoch
		rolledPrev int64 // leased_prev, rolled to nowUs's epoch
		overAtUs   *int64
		nowEpochUs int64
	}{
		{name: "never leased", nowUs: e + 500_000, nowEpochUs: e},
		{name: "epoch but no units (a row a plain check made)", epoch: i64(e), nowUs: e + 500_000, nowEpochUs: e},
		{name: "no units left", epoch: i64(e), cur: i64(0), prev: i64(0), nowUs: e + 500_000, nowEpochUs: e},
		{name: "first microsecond of the lease epoch", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e,
			leased: 5, rolledCur: 3, rolledPrev: 2, overAtUs: i64(e + 2_000_000), nowEpochUs: e},
		{name: "last microsecond of the lease epoch", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e + 999_999,
			leased: 5, rolledCur: 3, rolledPrev: 2, overAtUs: i64(e + 2_000_000), nowEpochUs: e},
		{name: "next epoch: leased alone, rolled to the previous count", epoch: i64(e), cur: i64(3), prev: i64(2),
			nowUs: e + 1_000_000, leased: 3, rolledPrev: 3, overAtUs: i64(e + 2_000_000), nowEpochUs: e + 1_000_000},
		{name: "last microsecond of the next epoch", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e + 1_999_999,
			leased: 3, rolledPrev: 3, overAtUs: i64(e + 2_000_000), nowEpochUs: e + 1_000_000},
		{name: "two epochs on: over", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e + 2_000_000,
			overAtUs: i64(e + 2_000_000), nowEpochUs: e + 2_000_000},
		{name: "a clock one microsecond back counts both", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e - 1,
			leased: 5, rolledCur: 3, rolledPrev: 2, overAtUs: i64(e + 2_000_000), nowEpochUs: e - 1_000_000},
		{name: "a clock two epochs back counts both", epoch: i64(e), cur: i64(3), prev: i64(2), nowUs: e - 1_500_000,
			leased: 5, rolledCur: 3, rolledPrev: 2, overAtUs: i64(e + 2_000_000), nowEpochUs: e - 2_000_000},
		{name: "only the previous epoch's units", epoch: i64(e), cur: i64(0), prev: i64(4), nowUs: e + 1_200_000,
			overAtUs: i64(e + 2_000_000), nowEpochUs: e + 1_000_000},
		{name: "before 1970, in the lease epoch", epoch: i64(-2_000_000), cur: i64(4), prev: i64(1), nowUs: -1_500_000,
			leased: 5, rolledCur: 4, rolledPrev: 1, overAtUs: i64(0), nowEpochUs: -2_000_000},
		{name: "before 1970, next epoch", epoch: i64(-2_000_000), cur: i64(4), prev: i64(1), nowUs: -1,
			leased: 4, rolledPrev: 4, overAtUs: i64(0), nowEpochUs: -1_000_000},
		{name: "before 1970, two epochs on", epoch: i64(-2_000_000), cur: i64(4), prev: i64(1), nowUs: 0,
			overAtUs: i64(0), nowEpochUs: 0},
	} {
		t.Run(v.name, func(t *testing.T) {
			var leased, cur, prev, nowEpoch int64
			var overAt *int64
			require.NoError(t, pool.QueryRow(ctx, `
				SELECT pgrl_token_bucket_leased($1, $2, $3, $4),
				       pgrl_token_bucket_lease_roll($1, $2, $3, $4, false),
				       pgrl_token_bucket_lease_roll($1, $2, $3, $4, true),
				       pgrl_us(pgrl_token_bucket_lease_over_at($1, $2, $3)),
				       pgrl_token_bucket_lease_epoch_us($4)`,
				v.epoch, v.cur, v.prev, v.nowUs).Scan(&leased, &cur, &prev, &overAt, &nowEpoch))
			require.Equal(t, v.leased, leased, "leased")
			require.Equal(t, v.rolledCur, cur, "leased rolled")
			require.Equal(t, v.rolledPrev, prev, "leased_prev rolled")
			require.Equal(t, v.overAtUs, overAt, "lease over at")
			require.Equal(t, v.nowEpochUs, nowEpoch, "lease epoch of now")
		})
	}
}

// TestTokenBucketSliceVectors runs pgrl_token_bucket_slice, a slice's step
// composed of the token bucket's step, on bucket states whose results were
// worked out from its rules (migration 000016): probe what is left (at most
// n * share), ask ceil(probe / share) (at most n, at least min), grant it
// when at least min is granted, else decide the check of min.
func TestTokenBucketSliceVectors(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	const refill = 1.0 / 1024 // tokens per microsecond, exact in binary
	const big = 1 << 53
	for _, v := range []struct {
		name               string
		tokens             float64
		updatedAtUs, nowUs int64
		n, min, share      int64
		capacity           float64
		penalty            bool
		wantTokens         float64
		wantUpdatedAtUs    int64
		wantAllowed        bool
		wantGranted        int64
	}{
		{name: "full bucket grants n", tokens: 10, n: 4, min: 1, share: 1, capacity: 10,
			wantTokens: 6, wantAllowed: true, wantGranted: 4},
		{name: "n above what is left grants what is left", tokens: 3, n: 8, min: 1, share: 1, capacity: 10,
			wantTokens: 0, wantAllowed: true, wantGranted: 3},
		{name: "share shrinks the grant", tokens: 10, n: 8, min: 1, share: 4, capacity: 10,
			wantTokens: 7, wantAllowed: true, wantGranted: 3},
		{name: "share: the last units go one by one", tokens: 2, n: 8, min: 1, share: 8, capacity: 10,
			wantTokens: 1, wantAllowed: true, wantGranted: 1},
		{name: "share never shrinks the grant below min", tokens: 10, n: 8, min: 5, share: 4, capacity: 10,
			wantTokens: 5, wantAllowed: true, wantGranted: 5},
		{name: "fractional balance: whole tokens only", tokens: 3.75, n: 8, min: 1, share: 1, capacity: 10,
			wantTokens: 0.75, wantAllowed: true, wantGranted: 3},
		{name: "min above what is left is a denial of min", tokens: 2.5, n: 5, min: 3, share: 1, capacity: 10,
			wantTokens: 2.5, wantAllowed: false, wantGranted: 0},
		{name: "under penalty a denial charges min, not n", tokens: 2.5, n: 5, min: 3, share: 1, capacity: 10,
			penalty: true, wantTokens: -0.5, wantAllowed: false, wantGranted: 0},
		{name: "under penalty a grant charges what it grants", tokens: 4, n: 8, min: 1, share: 1, capacity: 10,
			penalty: true, wantTokens: 0, wantAllowed: true, wantGranted: 4},
		{name: "nothing left", tokens: 0.5, n: 3, min: 1, share: 1, capacity: 10,
			wantTokens: 0.5, wantAllowed: false, wantGranted: 0},
		{name: "a penalised debt stops at -capacity", tokens: -9.5, n: 3, min: 2, share: 1, capacity: 10, penalty: true,
			wantTokens: -10, wantAllowed: false, wantGranted: 0},
		{name: "refilled to the check's instant first", tokens: 0, updatedAtUs: 1000, nowUs: 1000 + 3*1024,
			n: 5, min: 1, share: 1, capacity: 10,
			wantTokens: 0, wantUpdatedAtUs: 1000 + 3*1024, wantAllowed: true, wantGranted: 3},
		{name: "a clock that steps back does not refill", tokens: 2, updatedAtUs: 5000, nowUs: 4000,
			n: 5, min: 1, share: 1, capacity: 10,
			wantTokens: 0, wantUpdatedAtUs: 5000, wantAllowed: true, wantGranted: 2},
		{name: "refill stops at the capacity less the leased units", tokens: 4, nowUs: 1_000_000,
			n: 8, min: 1, share: 1, capacity: 10 - 6,
			wantTokens: 0, wantUpdatedAtUs: 1_000_000, wantAllowed: true, wantGranted: 4},
		{name: "a balance above the lowered capacity is cut to it", tokens: 10, nowUs: 0,
			n: 8, min: 1, share: 1, capacity: 10 - 7,
			wantTokens: 0, wantAllowed: true, wantGranted: 3},
		{name: "n times share saturates", tokens: big, n: big, min: 1, share: 1 << 20, capacity: big,
			wantTokens: big - (1 << 33), wantAllowed: true, wantGranted: 1 << 33},
	} {
		t.Run(v.name, func(t *testing.T) {
			var bits, upd, granted int64
			var allowed bool
			require.NoError(t, pool.QueryRow(ctx, `
				SELECT pgrl_float8_bits((s).tokens), (s).updated_at_us, (s).allowed, (s).granted
				  FROM (SELECT pgrl_token_bucket_slice($1::float8, $2::bigint, $3::bigint, $4::bigint, $5::bigint,
				                                       $6::bigint, $7::float8, $8::float8, $9::boolean) AS s) AS x`,
				v.tokens, v.updatedAtUs, v.nowUs, v.n, v.min, v.share, v.capacity, refill, v.penalty,
			).Scan(&bits, &upd, &allowed, &granted))
			got := math.Float64frombits(uint64(bits))
			require.Equal(t, v.wantTokens, got, "tokens")
			require.Equal(t, v.wantUpdatedAtUs, upd, "updated_at_us")
			require.Equal(t, v.wantAllowed, allowed, "allowed")
			require.Equal(t, v.wantGranted, granted, "granted")
		})
	}
}

// leaseRow is a bucket row's lease counts.
type leaseRow struct {
	epochUs, cur, prev int64
	fullAt             time.Time
}

func readLeaseRow(t *testing.T, pool *pgxpool.Pool, key string) leaseRow {
	t.Helper()
	var r leaseRow
	require.NoError(t, pool.QueryRow(context.Background(), `
		SELECT lease_epoch_us, leased, leased_prev, full_at FROM pgrl_token_bucket WHERE key = $1`, []byte(key),
	).Scan(&r.epochUs, &r.cur, &r.prev, &r.fullAt))
	return r
}

// pin is the instant d after base (a whole second: a lease epoch's start).
func pin(d time.Duration) *time.Time {
	ts := base.Add(d)
	return &ts
}

// A slice counts its units in the lease epoch of its instant, rolling the
// row's counts forward one epoch (leased becomes leased_prev) or more
// (both start again), and keeps the row's later epoch for a check whose
// clock is behind it. full_at stays after the leases.
func TestTokenBucketSliceRollsTheLeaseEpochs(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	sec := base.UnixMicro()
	slice := func(at time.Duration, n int64) sqlops.TokenBucketTakeChecksRow {
		t.Helper()
		r := sliceTB(t, pool, "k", *pin(at), n, 100, 1e-4)
		require.True(t, r.Allowed)
		require.Equal(t, n, r.Granted)
		return r
	}
	check := func(epochUs, cur, prev int64) {
		t.Helper()
		r := readLeaseRow(t, pool, "k")
		require.Equal(t, leaseRow{epochUs: epochUs, cur: cur, prev: prev}, leaseRow{epochUs: r.epochUs, cur: r.cur, prev: r.prev})
		require.False(t, r.fullAt.Before(time.UnixMicro(epochUs+2_000_000)), "full_at %v is before the leases are over", r.fullAt)
	}

	r := slice(500*time.Millisecond, 3)
	require.Equal(t, sec+2_000_000, r.FullAtUs, "full_at: the end of the next epoch, not the refill's 30 ms")
	check(sec, 3, 0)
	slice(1200*time.Millisecond, 2) // one epoch on
	check(sec+1_000_000, 2, 3)
	slice(1500*time.Millisecond, 1) // same epoch
	check(sec+1_000_000, 3, 3)
	slice(900*time.Millisecond, 4) // a check whose clock is behind the row's epoch
	check(sec+1_000_000, 7, 3)
	slice(3100*time.Millisecond, 1) // two epochs on
	check(sec+3_000_000, 1, 0)
}

// tbChecker is one way a plain check reaches a token bucket: every
// statement and function that decides token bucket checks.
type tbChecker struct {
	name string
	take func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool
}

// The figures of the property tests: capacity 10, 10 tokens a second.
const (
	propCapacity = 10
	propRefill   = 10.0 / 1e6
)

func tbCheckers() []tbChecker {
	ctx := context.Background()
	q, ops := gen.New(), sqlops.New()
	return []tbChecker{
		{"TokenBucketTake", func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool {
			r, err := q.TokenBucketTake(ctx, pool, gen.TokenBucketTakeParams{
				Key: []byte(key), Cost: 1, Capacity: propCapacity, RefillPerUs: propRefill, At: at})
			require.NoError(t, err)
			return r.Allowed
		}},
		{"TokenBucketTakeMany", func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool {
			rows, err := ops.TokenBucketTakeMany(ctx, pool, sqlops.TokenBucketTakeManyParams{
				Keys: [][]byte{[]byte(key)}, Costs: []int64{1}, Capacity: propCapacity, RefillPerUs: propRefill, At: at})
			require.NoError(t, err)
			require.Len(t, rows, 1)
			return rows[0].Allowed
		}},
		{"TokenBucketTakeUpTo", func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool {
			r, err := q.TokenBucketTakeUpTo(ctx, pool, gen.TokenBucketTakeUpToParams{
				Key: []byte(key), N: 1, Capacity: propCapacity, RefillPerUs: propRefill, At: at})
			require.NoError(t, err)
			return r.Allowed
		}},
		{"TokenBucketTakeChecks", func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool {
			rows, err := ops.TokenBucketTakeChecks(ctx, pool, sqlops.TokenBucketTakeChecksParams{
				Keys: [][]byte{[]byte(key)}, Capacities: []float64{propCapacity}, RefillsPerUs: []float64{propRefill},
				Penalties: []bool{false}, Runs: []int32{1}, Ends: []int32{1}, Rows: []int32{1}, Costs: []int64{1},
				UpTo: []bool{false}, Vetoes: []bool{true}, Mins: []int64{0}, Shares: []int64{0}, At: at})
			require.NoError(t, err)
			require.Len(t, rows, 1)
			return rows[0].Allowed
		}},
		{"TokenBucketTakePolicy", func(t *testing.T, pool *pgxpool.Pool, key string, at *time.Time) bool {
			r, err := ops.TokenBucketTakePolicy(ctx, pool, sqlops.TokenBucketTakePolicyParams{
				Key: []byte(key), Cost: 1, At: at, Policy: "tb-lease", OverrideKey: []byte(key), KeyMode: "hashed"})
			require.NoError(t, err)
			return r.Allowed
		}},
	}
}

// admitted is how many units plain checks admitted at an instant.
type admitted struct {
	atUs  int64
	units int64
}

// overBy is the most the plain checks admitted over any span [a, b] of
// their instants, plus the units a slice may spend in it, exceed what the
// bucket allows over that span (capacity + refill * (b - a)); <= 0 when
// never over. The slice's units may be spent at any instant of their
// lease, so they count in every span.
func overBy(events []admitted, slice int64) float64 {
	worst := math.Inf(-1)
	for i := range events {
		var sum int64
		for j := i; j < len(events); j++ {
			sum += events[j].units
			allowed := propCapacity + propRefill*float64(events[j].atUs-events[i].atUs)
			worst = max(worst, float64(sum+slice)-allowed)
		}
	}
	return worst
}

// runSchedule sends plain checks of one unit at each instant (offsets from
// t0), as many as are admitted, and returns what each instant admitted.
func runSchedule(t *testing.T, pool *pgxpool.Pool, c tbChecker, key string, t0 time.Time, offsets []time.Duration) []admitted {
	t.Helper()
	var out []admitted
	for _, d := range offsets {
		at := t0.Add(d)
		var n int64
		for n < 3*propCapacity && c.take(t, pool, key, &at) {
			n++
		}
		out = append(out, admitted{atUs: at.UnixMicro(), units: n})
	}
	return out
}

// The never-over property: a slice of s units taken from a full bucket at
// t0, then plain checks as fast as they are admitted. Over every span of
// [t0, t0 + lease time], the plain checks plus s stay within capacity +
// refill * span, for every statement that decides plain checks, whether
// they drain the bucket steadily or wait and then burst. Without the leased
// count (the same slice taken as a plain partial grant) the burst exceeds
// it: that is what the lease columns are for.
func TestTokenBucketSliceNeverOver(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst)
		VALUES ('tb-lease', 'token_bucket', 10, interval '1 second', 10)`)
	require.NoError(t, err)
	const s = 6
	t0 := base.Add(300 * time.Millisecond) // the lease spans two epochs
	tau := ratelimit.TokenBucketLeaseTime
	var steady, burst []time.Duration
	for d := time.Duration(0); d <= tau; d += 20 * time.Millisecond {
		steady = append(steady, d)
		if d >= 600*time.Millisecond {
			burst = append(burst, d)
		}
	}
	schedules := map[string][]time.Duration{"steady": steady, "idle then burst": burst}
	for _, c := range tbCheckers() {
		for name, offsets := range schedules {
			key := c.name + "/" + name
			r := sliceTB(t, pool, key, t0, s, propCapacity, propRefill)
			require.Equal(t, int64(s), r.Granted)
			events := append([]admitted{{atUs: t0.UnixMicro()}}, runSchedule(t, pool, c, key, t0, offsets)...)
			require.LessOrEqual(t, overBy(events, s), 1e-9, "%s, %s: over the bucket: %v", c.name, name, events)
		}
	}

	// The same slice as a plain partial grant, leased nowhere: the bucket
	// refills to its capacity while the units are out.
	at := t0
	g, err := gen.New().TokenBucketTakeUpTo(ctx, pool, gen.TokenBucketTakeUpToParams{
		Key: []byte("unleased"), N: s, Capacity: propCapacity, RefillPerUs: propRefill, At: &at})
	require.NoError(t, err)
	require.Equal(t, int64(s), g.Granted)
	events := append([]admitted{{atUs: t0.UnixMicro()}}, runSchedule(t, pool, tbCheckers()[0], "unleased", t0, burst)...)
	require.Greater(t, overBy(events, s), 1.0, "without the leased count the burst exceeds the bucket: %v", events)
	require.Equal(t, int64(propCapacity), events[1].units, "the unleased bucket refilled to its capacity")
}

// Peek reads the balance as the checks do: refilled up to the capacity
// less the units out on lease.
func TestTokenBucketPeekCountsLeasedUnits(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	sliceTB(t, pool, "k", *pin(0), 6, propCapacity, propRefill)
	for _, c := range []struct {
		at   time.Duration
		want float64
	}{{0, 4}, {900 * time.Millisecond, 4}, {1999 * time.Millisecond, 4}, {2 * time.Second, 10}} {
		p, err := gen.New().TokenBucketPeek(ctx, pool, gen.TokenBucketPeekParams{
			Key: []byte("k"), Capacity: propCapacity, RefillPerUs: propRefill, At: pin(c.at)})
		require.NoError(t, err)
		require.Equal(t, c.want, math.Float64frombits(uint64(p.TokensBits)), "at %v", c.at)
	}
}

// Returned units are tokens again and stop counting against the capacity;
// a return takes back at most what its epoch's count holds, from leased
// or, once the row moved one epoch on, from leased_prev, and nothing once
// the lease is over or the row moved two epochs on.
func TestTokenBucketReturnSlice(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	ops := sqlops.New()
	// slice returns the lease's instant: the statement's, as a lease keeps
	// it (its decision's Now).
	slice := func(key string, at time.Duration, n int64) int64 {
		t.Helper()
		r := sliceTB(t, pool, key, *pin(at), n, propCapacity, propRefill)
		require.Equal(t, n, r.Granted)
		require.Equal(t, pin(at).UnixMicro(), r.UpdatedAtUs)
		return r.UpdatedAtUs
	}
	give := func(key string, leaseUs int64, n int64, now time.Duration) int64 {
		t.Helper()
		got, err := ops.TokenBucketReturnSlice(ctx, pool, sqlops.TokenBucketReturnSliceParams{
			Key: []byte(key), At: time.UnixMicro(leaseUs), N: n, Capacity: propCapacity, RefillPerUs: propRefill,
			Now: pin(now)})
		require.NoError(t, err)
		return got
	}
	peek := func(key string, at time.Duration) float64 {
		t.Helper()
		p, err := gen.New().TokenBucketPeek(ctx, pool, gen.TokenBucketPeekParams{
			Key: []byte(key), Capacity: propCapacity, RefillPerUs: propRefill, At: pin(at)})
		require.NoError(t, err)
		return math.Float64frombits(uint64(p.TokensBits))
	}

	t.Run("units come back as tokens", func(t *testing.T) {
		lease := slice("a", 500*time.Millisecond, 6) // 4 tokens left, 6 leased
		require.Equal(t, 4.0, peek("a", 600*time.Millisecond))
		require.Equal(t, int64(4), give("a", lease, 4, 600*time.Millisecond))
		r := readLeaseRow(t, pool, "a")
		require.Equal(t, int64(2), r.cur)
		require.Equal(t, 8.0, peek("a", 600*time.Millisecond), "4 tokens and the 4 returned")
		require.Equal(t, 8.0, peek("a", 900*time.Millisecond), "the 2 still leased count")
		// A return never takes a count below zero: 2 were left of 6.
		require.Equal(t, int64(2), give("a", lease, 6, 900*time.Millisecond))
		require.Equal(t, int64(0), readLeaseRow(t, pool, "a").cur)
		require.Equal(t, 10.0, peek("a", 900*time.Millisecond))
		require.Equal(t, int64(0), give("a", lease, 1, 900*time.Millisecond), "nothing left to return")
		// Plain checks spend the returned units at once.
		c := tbCheckers()[0]
		require.Equal(t, int64(10), runSchedule(t, pool, c, "a", base, []time.Duration{900 * time.Millisecond})[0].units)
	})
	t.Run("from the previous epoch's count", func(t *testing.T) {
		first := slice("b", 500*time.Millisecond, 3)
		slice("b", 1200*time.Millisecond, 2) // one epoch on: the 3 are leased_prev
		require.Equal(t, int64(3), give("b", first, 3, 1300*time.Millisecond))
		r := readLeaseRow(t, pool, "b")
		require.Equal(t, leaseRow{epochUs: base.UnixMicro() + 1_000_000, cur: 2, prev: 0},
			leaseRow{epochUs: r.epochUs, cur: r.cur, prev: r.prev})
	})
	t.Run("after the row moved two epochs on", func(t *testing.T) {
		first := slice("c", 500*time.Millisecond, 3)
		slice("c", 2500*time.Millisecond, 1)
		require.Equal(t, int64(0), give("c", first, 3, 2600*time.Millisecond))
		require.Equal(t, int64(1), readLeaseRow(t, pool, "c").cur)
	})
	t.Run("once the lease is over", func(t *testing.T) {
		first := slice("d", 500*time.Millisecond, 3)
		tokens := peek("d", 2100*time.Millisecond)
		require.Equal(t, int64(0), give("d", first, 3, 2100*time.Millisecond), "two epochs past the lease's")
		require.Equal(t, tokens, peek("d", 2100*time.Millisecond))
		require.Equal(t, int64(3), give("d", first, 3, 1999*time.Millisecond), "still counted in the next epoch")
	})
	t.Run("a key without a row", func(t *testing.T) {
		require.Equal(t, int64(0), give("none", base.UnixMicro(), 3, 0))
		var n int64
		require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_token_bucket WHERE key = 'none'").Scan(&n))
		require.Zero(t, n)
	})
	t.Run("a reset key", func(t *testing.T) {
		lease := slice("e", 500*time.Millisecond, 3)
		_, err := gen.New().TokenBucketReset(ctx, pool, []byte("e"))
		require.NoError(t, err)
		require.Equal(t, int64(0), give("e", lease, 3, 600*time.Millisecond))
	})
}
