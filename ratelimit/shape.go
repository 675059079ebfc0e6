package ratelimit

// shape is a limit's arithmetic: how a counter's state after a check becomes
// a Decision. The Postgres limiter and the memory limiter share it, so both
// report exactly the same figures for the same state. The decisions
// themselves are built in each algorithm's file.
type shape struct {
	cfg         Config    // defaults filled in
	alg         algorithm // cfg.Algorithm's implementation
	windowUs    int64
	refillPerUs float64 // token bucket refill, tokens per microsecond
}

func newShape(cfg Config) shape {
	w := cfg.Window.Microseconds()
	return shape{cfg: cfg, alg: algorithmOf(cfg.Algorithm), windowUs: w, refillPerUs: float64(cfg.Limit) / float64(w)}
}
