package ratelimit

import (
	"strconv"
	"sync"
	"time"
)

// Rate is a limit given with a check instead of in Config: Limit units per
// Window, and for the token bucket a capacity of Burst (0 means Limit).
// A Rate is validated exactly as Config's Limit, Window and Burst are, with
// the limiter's algorithm, and refused with the same errors
// (ErrInvalidLimit, ErrInvalidWindow, ErrInvalidBurst).
//
// Which counter a rate's checks use, per algorithm:
//
//   - FixedWindow and SlidingWindow: a rate with the limiter's own Window
//     counts in the limiter's own rows, whatever its Limit: raising or
//     lowering a key's limit keeps what the key has used in the current
//     window. A rate with another Window counts in rows of its own (the
//     stored key is that of the name "Name@<window in µs>us", see
//     RateName), so windows of different lengths never share a count: a
//     fixed-window row is keyed by its window's end, and a 1-minute and a
//     2-minute window end at the same instant every other minute.
//   - TokenBucket: every rate uses the key's one bucket. The balance
//     carries over from one rate to another: a check refills the balance
//     at its own rate since the last check and caps it at its own Burst.
//     Lowering the rate of a key therefore never hands it fresh tokens.
type Rate struct {
	// Limit is the most units per Window (the token bucket's refill).
	Limit int64
	// Window is the window's length, or the refill period.
	Window time.Duration
	// Burst is the token bucket's capacity; 0 means Limit. Ignored by the
	// window algorithms.
	Burst int64
}

// maxRates bounds the limiters a Limiter keeps for per-call rates. When it
// is reached the cache is emptied and rebuilt on demand: correctness does not
// depend on it (counters live in PostgreSQL), only the memory fallback's and
// the deny cache's state for those rates is lost.
const maxRates = 256

// rateCache holds the limiters built for per-call rates, by rate.
type rateCache struct {
	mu sync.Mutex
	m  map[Rate]*Limiter
}

// Rate returns the limiter's own rate, defaults filled in.
func (l *Limiter) Rate() Rate {
	return Rate{Limit: l.cfg.Limit, Window: l.cfg.Window, Burst: l.cfg.Burst}
}

// RateName is the name whose stored keys hold the counters of a window
// algorithm's checks at a window other than the limiter's own: name, '@',
// and the window in whole microseconds followed by "us" ("api@60000000us"),
// so that ratelimit.StoredKey(mode, RateName(name, w), key) (or
// pgrl_stored_key in SQL) reaches those rows.
func RateName(name string, window time.Duration) string {
	return name + "@" + strconv.FormatInt(window.Microseconds(), 10) + "us"
}

// WithRate returns the limiter that checks the same keys as l at rate r,
// which AtRate and Check.Rate use: l itself when r is l's own rate,
// otherwise a limiter with l's configuration but r's Limit, Window and
// Burst, which counts as Rate describes and shares l's Database. It is
// built once per distinct rate and kept (up to 256 rates per limiter), so
// a rate given with every check is cheap. Package policy hands it out for
// a key with an override.
func (l *Limiter) WithRate(r Rate) (*Limiter, error) {
	if r.Burst == 0 {
		r.Burst = r.Limit
	}
	if r == l.Rate() {
		return l, nil
	}
	l.rates.mu.Lock()
	defer l.rates.mu.Unlock()
	if d, ok := l.rates.m[r]; ok {
		return d, nil
	}
	cfg := l.cfg
	cfg.Limit, cfg.Window, cfg.Burst = r.Limit, r.Window, r.Burst
	if l.cfg.FallbackLimit != l.cfg.Limit && r.Limit > 0 {
		cfg.FallbackLimit = max(1, mulDiv(l.cfg.FallbackLimit, r.Limit, l.cfg.Limit))
	} else {
		cfg.FallbackLimit = 0 // the rate's Limit
	}
	if r.Window != l.cfg.Window && l.cfg.Algorithm != TokenBucket && !l.cfg.KeyByWindow {
		cfg.Name = RateName(l.cfg.Name, r.Window)
	}
	// The store's: one database, one judgement of its health.
	d, err := newLimiter(l.st, cfg)
	if err != nil {
		return nil, err
	}
	// Metrics, dashboards and the receivers of shared denials see one
	// limiter, whatever the rate.
	d.name = l.name
	if l.rates.m == nil || len(l.rates.m) >= maxRates {
		l.rates.m = make(map[Rate]*Limiter)
	}
	l.rates.m[r] = d
	return d, nil
}

// Validate reports whether Database.Limiter would accept c, with the error it would
// return (ErrInvalidLimit, ErrInvalidWindow, ...), without a database: for
// configurations read from elsewhere (a file, package policy's table)
// before they are stored or used.
func (c Config) Validate() error {
	if c.KeyMode == ReadableKeys && len(c.Name) > MaxReadableNameBytes {
		return invalid(ErrInvalidName, "%d bytes with readable keys; use a name of at most %d bytes, or HashedKeys (the default)", len(c.Name), MaxReadableNameBytes)
	}
	_, err := c.withDefaults()
	return err
}
