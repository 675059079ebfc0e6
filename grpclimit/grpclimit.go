// Package grpclimit puts pgrl's limiters in front of gRPC services: unary
// and stream server interceptors that check each call against a limiter
// (a *ratelimit.Limiter, a *ratelimit.MemoryLimiter, a package policy
// *Limiter, any ratelimit.Checker) under a key chosen from the call (its
// method, the peer's address, a metadata value, or a combination), and
// refuse a call over the limit with codes.ResourceExhausted and a
// google.rpc.RetryInfo detail saying when to retry.
//
// It is a module of its own, so that pgrl's core module carries no gRPC.
//
//	lim, err := limits.Limiter(ratelimit.Config{Name: "grpc", Limit: 100, Window: time.Minute})
//	rl, err := grpclimit.New(grpclimit.Config{Limiter: lim, Key: grpclimit.ByMetadata("x-api-key")})
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rl.Unary()), grpc.ChainStreamInterceptor(rl.Stream()))
//
// An Interceptor is also a go-grpc-middleware/v2 ratelimit.Limiter (its
// Limit method), for servers that chain that package's interceptors; those
// answer ResourceExhausted without the RetryInfo detail.
package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgrl/pgrl/ratelimit"
)

// A KeyFunc picks the key a call is counted under. ok false lets the call
// through unchecked (a call the limit is not for). fullMethod is
// "/package.Service/Method".
type KeyFunc func(ctx context.Context, fullMethod string) (key string, ok bool)

// ByMethod counts each method under its full name: a limit per method,
// shared by every client.
func ByMethod(_ context.Context, fullMethod string) (string, bool) { return fullMethod, true }

// ByPeer counts each client address (without its port). A call without a
// peer (in-process transports) is counted under "unknown". Behind a proxy
// every call has the proxy's address: use ByMetadata with the header the
// proxy sets instead.
func ByPeer(ctx context.Context, _ string) (string, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "unknown", true
	}
	addr := p.Addr.String()
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host, true
	}
	return addr, true
}

// ByMetadata counts each value of the incoming metadata key name (an API
// key, a tenant id); a call without it is not checked by this limit.
func ByMetadata(name string) KeyFunc {
	name = strings.ToLower(name)
	return func(ctx context.Context, _ string) (string, bool) {
		md, _ := metadata.FromIncomingContext(ctx)
		if v := md.Get(name); len(v) > 0 && v[0] != "" {
			return v[0], true
		}
		return "", false
	}
}

// Combine counts each combination of the parts' keys, joined by "|"
// (length-prefixed, so that parts cannot run into each other); a call that
// any part skips is skipped.
func Combine(parts ...KeyFunc) KeyFunc {
	return func(ctx context.Context, fullMethod string) (string, bool) {
		var b strings.Builder
		for _, p := range parts {
			k, ok := p(ctx, fullMethod)
			if !ok {
				return "", false
			}
			fmt.Fprintf(&b, "%d:%s|", len(k), k)
		}
		return b.String(), true
	}
}

// Config configures an Interceptor.
type Config struct {
	// Limiter checks the calls. Required.
	Limiter ratelimit.Checker
	// Key picks a call's key. Required: ByMethod, ByPeer, ByMetadata,
	// Combine, or a function of your own.
	Key KeyFunc
	// Cost, when set, is how many units a call costs (ratelimit.Cost); 0
	// or less lets the call through unchecked. Default: 1.
	Cost func(ctx context.Context, fullMethod string) int64
}

// Interceptor checks gRPC calls against a limiter. It is safe for
// concurrent use.
type Interceptor struct {
	cfg Config
}

// New returns an Interceptor, or an error naming what Config lacks.
func New(cfg Config) (*Interceptor, error) {
	switch {
	case cfg.Limiter == nil:
		return nil, errors.New("grpclimit: Config.Limiter is nil; pass a *ratelimit.Limiter (or any ratelimit.Checker)")
	case cfg.Key == nil:
		return nil, errors.New("grpclimit: Config.Key is nil; pass grpclimit.ByMethod, ByPeer, ByMetadata(name) or Combine")
	}
	return &Interceptor{cfg: cfg}, nil
}

// check decides one call: nil when it may proceed, else the status error to
// return.
func (i *Interceptor) check(ctx context.Context, fullMethod string) error {
	key, ok := i.cfg.Key(ctx, fullMethod)
	if !ok {
		return nil
	}
	cost := int64(1)
	if i.cfg.Cost != nil {
		if cost = i.cfg.Cost(ctx, fullMethod); cost <= 0 {
			return nil
		}
	}
	d, err := i.cfg.Limiter.Allow(ctx, key, ratelimit.Cost(cost))
	switch {
	case err != nil && ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case err != nil && ratelimit.IsConfigError(err):
		return status.Errorf(codes.Internal, "rate limit of %s: %v", fullMethod, err)
	case err != nil:
		return status.Errorf(codes.Unavailable, "rate limiter unavailable: %v", err)
	case d.Allowed:
		return nil
	}
	return Denied(fullMethod, d.RetryAfter)
}

// Denied is the error a refused call gets: codes.ResourceExhausted with a
// google.rpc.RetryInfo detail of retryAfter.
func Denied(fullMethod string, retryAfter time.Duration) error {
	st := status.Newf(codes.ResourceExhausted, "rate limit exceeded for %s; retry in %s", fullMethod,
		retryAfter.Round(time.Millisecond))
	if ds, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)}); err == nil {
		st = ds
	}
	return st.Err()
}

// Unary returns the unary server interceptor.
func (i *Interceptor) Unary() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := i.check(ctx, info.FullMethod); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// Stream returns the stream server interceptor: a stream is one call,
// checked when it opens.
func (i *Interceptor) Stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if err := i.check(ss.Context(), info.FullMethod); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// Limit implements go-grpc-middleware/v2's ratelimit.Limiter: it checks the
// call of ctx (its method from grpc.Method) and returns an error when the
// call may not proceed.
func (i *Interceptor) Limit(ctx context.Context) error {
	method, _ := grpc.Method(ctx)
	return i.check(ctx, method)
}
