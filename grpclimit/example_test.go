package grpclimit_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgrl/pgrl/grpclimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

func Example() {
	pool, _, done, err := dbtest.ForExamples()
	if err != nil {
		log.Fatal(err)
	}
	defer done()
	// A pinned clock, so that the output does not depend on when this
	// runs; applications leave Now unset.
	now := func() time.Time { return time.Date(2030, 1, 2, 3, 4, 30, 0, time.UTC) }
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: now})
	if err != nil {
		log.Fatal(err)
	}
	lim, err := limits.Limiter(ratelimit.Config{Name: "grpc", Algorithm: ratelimit.FixedWindow, Limit: 2,
		Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMetadata("x-api-key")})
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rl.Unary()), grpc.ChainStreamInterceptor(rl.Stream()))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	client := healthpb.NewHealthClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-api-key", "key-1")
	for range 3 {
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		st := status.Convert(err)
		fmt.Print(st.Code())
		for _, d := range st.Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok {
				fmt.Print(" retry in ", ri.RetryDelay.AsDuration())
			}
		}
		fmt.Println()
	}
	// Output:
	// OK
	// OK
	// ResourceExhausted retry in 30s
}
