package grpclimit_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	grpcratelimit "github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgrl/pgrl/grpclimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// serve starts a gRPC server with the health service on the loopback,
// behind opts, and returns a client of it.
func serve(t *testing.T, opts ...grpc.ServerOption) healthpb.HealthClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return healthpb.NewHealthClient(conn)
}

func limiter(t *testing.T, name string, limit int64) *ratelimit.Limiter {
	t.Helper()
	pool, _ := dbtest.Pool(t)
	return testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Algorithm: ratelimit.FixedWindow, Limit: limit,
		Window: time.Hour})
}

// retryInfo returns the RetryInfo detail of err's status.
func retryInfo(t *testing.T, err error) *errdetails.RetryInfo {
	t.Helper()
	st, ok := status.FromError(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, codes.ResourceExhausted, st.Code(), "%v", err)
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri
		}
	}
	t.Fatalf("no RetryInfo in %v", st.Details())
	return nil
}

// Unary calls over the limit are refused with ResourceExhausted and a
// RetryInfo detail; each metadata key is counted apart; a call without the
// key is not checked.
func TestUnaryByMetadata(t *testing.T) {
	t.Parallel()
	rl, err := grpclimit.New(grpclimit.Config{Limiter: limiter(t, "grpc-unary", 2), Key: grpclimit.ByMetadata("X-API-Key")})
	require.NoError(t, err)
	client := serve(t, grpc.ChainUnaryInterceptor(rl.Unary()))
	call := func(key string) error {
		ctx := context.Background()
		if key != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "x-api-key", key)
		}
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	require.NoError(t, call("a"))
	require.NoError(t, call("a"))
	err = call("a")
	ri := retryInfo(t, err)
	require.Positive(t, ri.RetryDelay.AsDuration())
	require.LessOrEqual(t, ri.RetryDelay.AsDuration(), time.Hour)
	require.Contains(t, status.Convert(err).Message(), "/grpc.health.v1.Health/Check")
	require.NoError(t, call("b"), "another key counts apart")
	for range 3 {
		require.NoError(t, call(""), "no key: not checked")
	}
}

// A stream is one call, checked when it opens.
func TestStreamByMethod(t *testing.T) {
	t.Parallel()
	rl, err := grpclimit.New(grpclimit.Config{Limiter: limiter(t, "grpc-stream", 1), Key: grpclimit.ByMethod})
	require.NoError(t, err)
	client := serve(t, grpc.ChainStreamInterceptor(rl.Stream()))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = s.Recv()
	require.NoError(t, err, "the first stream is admitted and served")
	s2, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = s2.Recv()
	retryInfo(t, err)
}

// Keyed by peer and with a cost: the loopback client's address is the key.
func TestByPeerWithCost(t *testing.T) {
	t.Parallel()
	lim := limiter(t, "grpc-peer", 10)
	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.Combine(grpclimit.ByPeer, grpclimit.ByMethod),
		Cost: func(context.Context, string) int64 { return 4 }})
	require.NoError(t, err)
	client := serve(t, grpc.ChainUnaryInterceptor(rl.Unary()))
	for i := range 3 {
		_, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{})
		if i < 2 {
			require.NoError(t, err)
		} else {
			retryInfo(t, err)
		}
	}
	const method = "/grpc.health.v1.Health/Check"
	d, err := lim.Peek(context.Background(), fmt.Sprintf("9:127.0.0.1|%d:%s|", len(method), method))
	require.NoError(t, err)
	require.EqualValues(t, 8, d.Used, "counted under the peer's address and the method")
}

// A limiter that cannot answer: Unavailable, not a refusal; a bad setup:
// Internal.
func TestErrors(t *testing.T) {
	t.Parallel()
	dead := testkit.NewLimiter(t, testkit.DeadPool(t), ratelimit.Config{Name: "grpc-dead", Limit: 10,
		Window: time.Minute, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{Timeout: time.Second})
	rl, err := grpclimit.New(grpclimit.Config{Limiter: dead, Key: grpclimit.ByMethod})
	require.NoError(t, err)
	client := serve(t, grpc.ChainUnaryInterceptor(rl.Unary()))
	_, err = client.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)

	bad, err := grpclimit.New(grpclimit.Config{Limiter: limiter(t, "grpc-cost", 10), Key: grpclimit.ByMethod,
		Cost: func(context.Context, string) int64 { return 11 }})
	require.NoError(t, err)
	client = serve(t, grpc.ChainUnaryInterceptor(bad.Unary()))
	_, err = client.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)

	_, err = grpclimit.New(grpclimit.Config{Key: grpclimit.ByMethod})
	require.ErrorContains(t, err, "Limiter is nil")
	_, err = grpclimit.New(grpclimit.Config{Limiter: dead})
	require.ErrorContains(t, err, "Key is nil")
}

// An Interceptor is a go-grpc-middleware/v2 ratelimit.Limiter: that
// package's interceptors refuse the call over the limit.
func TestGoGRPCMiddlewareLimiter(t *testing.T) {
	t.Parallel()
	rl, err := grpclimit.New(grpclimit.Config{Limiter: limiter(t, "grpc-mw", 1), Key: grpclimit.ByMethod})
	require.NoError(t, err)
	var _ grpcratelimit.Limiter = rl
	client := serve(t, grpc.ChainUnaryInterceptor(grpcratelimit.UnaryServerInterceptor(rl)))
	_, err = client.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = client.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
}

func slots(t *testing.T, name string, limit int64) *ratelimit.Limiter {
	t.Helper()
	pool, _ := dbtest.Pool(t)
	return testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Algorithm: ratelimit.Concurrency, Limit: limit,
		Window: 10 * time.Second})
}

// A concurrency limit holds a slot while each unary call runs: at most
// Limit at once, the next refused with RetryInfo; the slot is given back
// when the handler returns or panics, and the handler finds it in its
// context.
func TestConcurrencyUnary(t *testing.T) {
	t.Parallel()
	lim := slots(t, "grpc-inflight", 2)
	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMethod})
	require.NoError(t, err)
	unary := rl.Unary()
	info := &grpc.UnaryServerInfo{FullMethod: "/reports.Reports/Generate"}
	held := func() int64 {
		d, err := lim.Peek(context.Background(), info.FullMethod)
		require.NoError(t, err)
		return d.Used
	}

	finish := make(chan struct{})
	entered := make(chan *ratelimit.Slot, 2)
	done := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := unary(context.Background(), nil, info, func(ctx context.Context, _ any) (any, error) {
				entered <- grpclimit.SlotFrom(ctx)
				<-finish
				return "report", nil
			})
			done <- err
		}()
	}
	var inside []*ratelimit.Slot
	for range 2 {
		inside = append(inside, <-entered)
	}
	for _, s := range inside {
		require.NotNil(t, s, "the handler finds its slot")
		require.NoError(t, s.Err())
	}
	require.EqualValues(t, 2, held())
	_, err = unary(context.Background(), nil, info, func(context.Context, any) (any, error) {
		t.Error("a third call ran")
		return nil, nil
	})
	ri := retryInfo(t, err)
	require.Positive(t, ri.RetryDelay.AsDuration())
	close(finish)
	for range 2 {
		require.NoError(t, <-done)
	}
	for _, s := range inside {
		require.ErrorIs(t, s.Err(), ratelimit.ErrSlotReleased)
	}
	require.Zero(t, held(), "given back when the handlers returned")

	func() {
		defer func() { require.NotNil(t, recover()) }()
		_, _ = unary(context.Background(), nil, info, func(context.Context, any) (any, error) { panic("boom") })
	}()
	require.Zero(t, held(), "given back when the handler panicked")
}

// A stream holds its slot until the handler returns: with a limit of one,
// a second Watch is refused while the first is open, and admitted once it
// was cancelled.
func TestConcurrencyStream(t *testing.T) {
	t.Parallel()
	lim := slots(t, "grpc-watch", 1)
	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMethod})
	require.NoError(t, err)
	client := serve(t, grpc.ChainStreamInterceptor(rl.Stream()))
	ctx, cancel := context.WithCancel(context.Background())
	s, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = s.Recv()
	require.NoError(t, err, "the first stream is admitted and served")
	s2, err := client.Watch(context.Background(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = s2.Recv()
	retryInfo(t, err)
	cancel()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			return false
		}
		_, err = s.Recv()
		return err == nil
	}, 10*time.Second, 50*time.Millisecond, "the place of the cancelled stream is free again")
}

// A concurrency limit with Cost is refused; through go-grpc-middleware's
// interceptor, which never says when a call ends, every call is refused
// (that interceptor answers ResourceExhausted with Limit's message).
func TestConcurrencyMisuse(t *testing.T) {
	t.Parallel()
	lim := slots(t, "grpc-misuse", 1)
	_, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMethod,
		Cost: func(context.Context, string) int64 { return 1 }})
	require.ErrorContains(t, err, "a call in flight holds one slot")
	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMethod})
	require.NoError(t, err)
	client := serve(t, grpc.ChainUnaryInterceptor(grpcratelimit.UnaryServerInterceptor(rl)))
	_, err = client.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), "Unary and Stream")
}
