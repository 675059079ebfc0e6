package notifier_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/notifier"
)

// batched is a topic that records its batches and connections.
type batched struct {
	channel   string
	mu        sync.Mutex
	got       []string
	connected atomic.Int32
	pids      chan uint32
}

func (b *batched) Channel() string { return b.channel }
func (b *batched) Connected(_ context.Context, conn *pgx.Conn) error {
	b.connected.Add(1)
	b.pids <- conn.PgConn().PID()
	return nil
}
func (b *batched) Receive(_ context.Context, p []string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.got = append(b.got, p...)
	return nil
}
func (b *batched) payloads() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.got)
}

// streamed is a Streamer and a Pinger.
type streamed struct {
	batched
	offered chan string
	pings   atomic.Int32
}

func (s *streamed) Offer(p string) { s.offered <- p }
func (s *streamed) Ping(ctx context.Context, conn *pgx.Conn) error {
	s.pings.Add(1)
	return conn.Ping(ctx)
}

// timed is a Timer that asks for a tick every 50ms.
type timed struct {
	batched
	next  time.Time
	ticks chan struct{}
}

func (t *timed) Due() (time.Time, bool) { return t.next, true }
func (t *timed) Tick(context.Context) error {
	t.next = time.Now().Add(50 * time.Millisecond)
	select {
	case t.ticks <- struct{}{}:
	default:
	}
	return nil
}

// TestTopicsShareOneConnection sends to two channels and checks that each
// topic gets its own payloads, in order, over one connection; that a
// Streamer gets them one by one and a Pinger's query replaces the ping;
// that a Timer ticks; and that after the connection is terminated every
// topic catches up again on a new one.
func TestTopicsShareOneConnection(t *testing.T) {
	t.Parallel()
	admin := dbtest.Admin(t)
	ctx := context.Background()
	suffix := fmt.Sprintf("%d", time.Now().UnixNano())
	a := &batched{channel: "pgrl_test_a_" + suffix, pids: make(chan uint32, 10)}
	s := &streamed{batched: batched{channel: "pgrl_test_s_" + suffix, pids: make(chan uint32, 10)}, offered: make(chan string, 100)}
	tm := &timed{batched: batched{channel: "pgrl_test_t_" + suffix, pids: make(chan uint32, 10)}, ticks: make(chan struct{}, 1)}
	cfg, err := pgx.ParseConfig(dbtest.URL())
	require.NoError(t, err)
	n := notifier.New(cfg, notifier.Options{
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
		PingInterval: 20 * time.Millisecond, PingTimeout: 5 * time.Second,
		Name: "test notifier", Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, a, s, tm)
	n.Close() // before Start: returns at once
	n.Start(ctx)
	defer n.Close()

	pid := <-a.pids
	require.Equal(t, pid, <-s.pids, "one connection for every topic")
	require.Equal(t, pid, <-tm.pids)
	require.Eventually(t, n.Connected, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, pid, n.PID())

	for i := range 20 {
		_, err := admin.Exec(ctx, "SELECT pg_notify($1, $2), pg_notify($3, $4)", a.channel, fmt.Sprint("a", i), s.channel, fmt.Sprint("s", i))
		require.NoError(t, err)
	}
	for i := range 20 {
		select {
		case p := <-s.offered:
			require.Equal(t, fmt.Sprint("s", i), p)
		case <-time.After(10 * time.Second):
			t.Fatalf("streamed payload %d never came", i)
		}
	}
	require.Eventually(t, func() bool { return len(a.payloads()) == 20 }, 10*time.Second, 5*time.Millisecond)
	for i, p := range a.payloads() {
		require.Equal(t, fmt.Sprint("a", i), p)
	}
	require.Empty(t, tm.payloads(), "no payload crosses to another topic")
	require.Empty(t, s.payloads(), "a Streamer gets nothing through Receive")
	<-tm.ticks
	<-tm.ticks
	require.Eventually(t, func() bool { return s.pings.Load() > 0 }, 10*time.Second, 5*time.Millisecond, "the Pinger pings")

	// Cut the connection: the notifier reconnects and every topic catches
	// up on the new one.
	_, err = admin.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(pid))
	require.NoError(t, err)
	var pid2 uint32
	select {
	case pid2 = <-a.pids:
	case <-time.After(15 * time.Second):
		t.Fatal("no reconnection")
	}
	require.NotEqual(t, pid, pid2)
	require.Equal(t, pid2, <-s.pids)
	require.Equal(t, pid2, <-tm.pids)
	require.GreaterOrEqual(t, n.Reconnects(), uint64(1))
	require.Error(t, n.LastError(), "the lost connection is recorded")
	_, err = admin.Exec(ctx, "SELECT pg_notify($1, 'after')", a.channel)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return slices.Contains(a.payloads(), "after") }, 10*time.Second, 5*time.Millisecond)

	n.Close()
	require.False(t, n.Connected())
	require.Zero(t, n.PID())
}
