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
// A concurrency limit (ratelimit.Concurrency) bounds the calls in flight
// instead of their rate: the interceptor takes one of the limit's slots
// before the handler runs (Acquire), holds it while the call runs (a
// stream: until the handler returns), and gives it back when it returns or
// panics. The handler finds its slot with SlotFrom.
//
// An Interceptor is also a go-grpc-middleware/v2 ratelimit.Limiter (its
// Limit method), for servers that chain that package's interceptors; those
// answer ResourceExhausted without the RetryInfo detail. That interface
// has no end of the call, so a concurrency limit refuses every call made
// through it, with a message saying to use Unary and Stream instead.
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
	// Limiter checks the calls. Required. A concurrency limit
	// (ratelimit.Concurrency, a *ratelimit.Limiter or a
	// *ratelimit.MemoryLimiter) holds a slot for each call in flight.
	Limiter ratelimit.Checker
	// Key picks a call's key. Required: ByMethod, ByPeer, ByMetadata,
	// Combine, or a function of your own.
	Key KeyFunc
	// Cost, when set, is how many units a call costs (ratelimit.Cost); 0
	// or less lets the call through unchecked. Default: 1. Not with a
	// concurrency limit: a call in flight holds one slot.
	Cost func(ctx context.Context, fullMethod string) int64
}

// acquirer is a concurrency limit: *ratelimit.Limiter and
// *ratelimit.MemoryLimiter.
type acquirer interface {
	Acquire(ctx context.Context, key string) (*ratelimit.Slot, ratelimit.Decision, error)
}

// Interceptor checks gRPC calls against a limiter. It is safe for
// concurrent use.
type Interceptor struct {
	cfg   Config
	slots acquirer // set for a concurrency limit
}

// New returns an Interceptor, or an error naming what Config lacks.
func New(cfg Config) (*Interceptor, error) {
	switch {
	case cfg.Limiter == nil:
		return nil, errors.New("grpclimit: Config.Limiter is nil; pass a *ratelimit.Limiter (or any ratelimit.Checker)")
	case cfg.Key == nil:
		return nil, errors.New("grpclimit: Config.Key is nil; pass grpclimit.ByMethod, ByPeer, ByMetadata(name) or Combine")
	}
	i := &Interceptor{cfg: cfg}
	if lc := cfg.Limiter.Config(); lc.Algorithm == ratelimit.Concurrency {
		a, ok := cfg.Limiter.(acquirer)
		switch {
		case !ok:
			return nil, fmt.Errorf("grpclimit: Config.Limiter %q is a concurrency limit held by a %T, which cannot hold slots; pass the *ratelimit.Limiter itself", lc.Name, cfg.Limiter)
		case cfg.Cost != nil:
			return nil, fmt.Errorf("grpclimit: Config.Cost is set with %q, a concurrency limit; a call in flight holds one slot: drop Cost, and let calls through unchecked with Key", lc.Name)
		}
		i.slots = a
	}
	return i, nil
}

// enter admits one call: nil when it may proceed, else the status error
// to return. A concurrency limit's call gets its slot in the returned
// context and a release to call when it ends; any other call gets ctx and
// a release that does nothing.
func (i *Interceptor) enter(ctx context.Context, fullMethod string) (context.Context, func(), error) {
	if i.slots == nil {
		return ctx, func() {}, i.check(ctx, fullMethod)
	}
	key, ok := i.cfg.Key(ctx, fullMethod)
	if !ok {
		return ctx, func() {}, nil
	}
	slot, d, err := i.slots.Acquire(ctx, key)
	if err != nil {
		return ctx, nil, callErr(ctx, fullMethod, err)
	}
	if !d.Allowed {
		return ctx, nil, Denied(fullMethod, d.RetryAfter)
	}
	if slot == nil {
		return ctx, func() {}, nil // held nowhere: a failure policy let it through
	}
	release := func() {
		// The call's end cancels ctx; the release must still be sent.
		// One that fails leaves the slot to lapse after the Window.
		_ = slot.Release(context.WithoutCancel(ctx))
	}
	return context.WithValue(ctx, slotKey{}, slot), release, nil
}

type slotKey struct{}

// SlotFrom returns the concurrency limit's slot the interceptor holds for
// the call of ctx, or nil. A long call can watch its Done channel, closed
// when the slot is lost (its lease could not be extended), and stop.
func SlotFrom(ctx context.Context) *ratelimit.Slot {
	s, _ := ctx.Value(slotKey{}).(*ratelimit.Slot)
	return s
}

// callErr is the status error of a check or acquire that failed.
func callErr(ctx context.Context, fullMethod string, err error) error {
	switch {
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case ratelimit.IsConfigError(err):
		return status.Errorf(codes.Internal, "rate limit of %s: %v", fullMethod, err)
	}
	return status.Errorf(codes.Unavailable, "rate limiter unavailable: %v", err)
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
	case err != nil:
		return callErr(ctx, fullMethod, err)
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
		ctx, release, err := i.enter(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		defer release()
		return handler(ctx, req)
	}
}

// Stream returns the stream server interceptor: a stream is one call,
// checked when it opens (a concurrency limit's slot is held until the
// handler returns).
func (i *Interceptor) Stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, release, err := i.enter(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		defer release()
		if ctx != ss.Context() {
			ss = &slotStream{ServerStream: ss, ctx: ctx}
		}
		return handler(srv, ss)
	}
}

// slotStream is a stream whose context carries its slot.
type slotStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *slotStream) Context() context.Context { return s.ctx }

// Limit implements go-grpc-middleware/v2's ratelimit.Limiter: it checks the
// call of ctx (its method from grpc.Method) and returns an error when the
// call may not proceed.
func (i *Interceptor) Limit(ctx context.Context) error {
	method, _ := grpc.Method(ctx)
	if i.slots != nil {
		return status.Errorf(codes.Internal, "concurrency limit %q of %s: go-grpc-middleware's ratelimit interceptor never says when a call ends, so its slot could not be given back; chain grpclimit's Unary and Stream interceptors instead", i.cfg.Limiter.Config().Name, method)
	}
	return i.check(ctx, method)
}
