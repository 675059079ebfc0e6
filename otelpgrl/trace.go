package otelpgrl

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgrl/pgrl/ratelimit"
)

// Span attribute keys that Annotate sets, besides AttrPolicy, AttrResult
// and AttrStore.
const (
	AttrGranted      = attribute.Key("pgrl.rate_limiting.granted")
	AttrLimit        = attribute.Key("pgrl.rate_limiting.limit")
	AttrRemaining    = attribute.Key("pgrl.rate_limiting.remaining")
	AttrRetryAfter   = attribute.Key("pgrl.rate_limiting.retry_after") // seconds, a float
	AttrReplayed     = attribute.Key("pgrl.rate_limiting.replayed")
	AttrErrorOutcome = attribute.Key("pgrl.rate_limiting.outcome") // of an error: ratelimit.Outcome's String
)

// Attributes returns a check's decision (or error) as span attributes:
// the limiter's name, the result and the store, and for a decision the
// units granted, the limit, what remains, the retry-after in seconds and
// whether it was a replay; for an error, its outcome (ratelimit.OutcomeOf).
// Keys and user data never appear: a limiter's name is fixed by the code.
func Attributes(limiter string, d ratelimit.Decision, err error) []attribute.KeyValue {
	kv := []attribute.KeyValue{AttrPolicy.String(limiter), AttrResult.String(Result(d, err)),
		AttrStore.String(store(d, err))}
	if err != nil {
		return append(kv, AttrErrorOutcome.String(ratelimit.OutcomeOf(err).String()))
	}
	kv = append(kv, AttrGranted.Int64(d.Granted), AttrLimit.Int64(d.Limit), AttrRemaining.Int64(d.Remaining),
		AttrRetryAfter.Float64(d.RetryAfter.Seconds()))
	if d.Replayed {
		kv = append(kv, AttrReplayed.Bool(true))
	}
	return kv
}

// Annotate adds a check's decision to the span in ctx (the caller's, as
// trace.SpanFromContext finds it) as Attributes; nothing when ctx holds no
// recording span. Call it after a check whose result belongs in the trace:
//
//	d, err := lim.Allow(ctx, key)
//	otelpgrl.Annotate(ctx, "api", d, err)
func Annotate(ctx context.Context, limiter string, d ratelimit.Decision, err error) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(Attributes(limiter, d, err)...)
}
