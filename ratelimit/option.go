package ratelimit

import (
	"context"
	"crypto/sha256"
)

// Checker is what every kind of limit does, with one set of methods:
// *Limiter (in PostgreSQL), *MemoryLimiter (in process memory) and package
// policy's *Limiter (a limit stored in PostgreSQL) satisfy it, and package
// httplimit takes it (the ulule store is built on a *Limiter's Allow, Peek
// and Reset with AtRate). Each verb takes the same options
// (Cost, UpTo, AtRate); a Limiter's verbs have …Tx twins that run in the
// caller's transaction (AllowTx, PeekTx, ResetTx).
type Checker interface {
	// Allow checks and counts what the options ask for (one unit by
	// default) for key.
	Allow(ctx context.Context, key string, opts ...Option) (Decision, error)
	// Peek reports key's state without counting anything.
	Peek(ctx context.Context, key string, opts ...Option) (Decision, error)
	// Reset forgets what was counted for key.
	Reset(ctx context.Context, key string, opts ...Option) error
	// Config is the limit's configuration.
	Config() Config
}

var (
	_ Checker = (*Limiter)(nil)
	_ Checker = (*MemoryLimiter)(nil)
)

// An Option varies one check: Cost and UpTo say what it asks for, AtRate
// the rate it counts against. A check without options asks for one unit at
// the limiter's own rate. Options are values (no allocation per check).
type Option struct {
	kind  optionKind
	n     int64
	min   int64 // Slice's min
	share int64 // Slice's share
	rate  Rate
	id    string // RequestID's id
}

type optionKind uint8

const (
	optCost optionKind = iota + 1
	optUpTo
	optSlice
	optRate
	optRequest
)

// Cost asks for n units (a cost, such as bytes or tokens), all of them or
// none. Without it a check asks for 1. n must be at least 1 and at most what
// the limit holds at once (Limit, or Burst for the token bucket):
// ErrInvalidCost and ErrCostExceedsLimit otherwise.
func Cost(n int64) Option { return Option{kind: optCost, n: n} }

// UpTo is a partial grant: the check takes as many of n units as the key
// has left, possibly none, and reports how many in Decision.Granted
// (Allowed when at least one). Use it to hand out what is left of a quota:
// the bytes an upload may still send, the rows a batch job may still
// process.
//
// n is a ceiling, not a cost: any n of at least 1 is valid (0 or less is
// ErrInvalidCost), and an n above what the limit holds at once (Limit, or
// Burst for the token bucket; a row's share with Spread) is an ask of that
// capacity in every respect, so UpTo(math.MaxInt64) takes all that is
// left. Under Penalty the ask is counted whatever is granted, as for any
// denied check: n, or the capacity when n is above it, so one huge ask
// cannot push a count further than the largest valid Cost. Concurrent
// partial grants and other checks of one key are decided one after
// another. The failure policy answers as for any check: the memory tier
// grants from its own count (its capacity is FallbackLimit's), FailOpen
// grants the whole ask (at most the capacity), FailClosed none. A
// shadow-mode denial proceeds with Granted 0.
func UpTo(n int64) Option { return Option{kind: optUpTo, n: n} }

// Slice is the partial grant a quota lease takes (package lease): the
// statement that decides it sizes it from what the key has left, so that
// the processes leasing one key share what is left fairly. It grants
// ceil(left/share) units, at least min and at most n, and is denied,
// granting nothing, when fewer than min are left (min is the cost of the
// check that asked for the slice). So slices shrink as the key nears its
// limit, and the last units go one at a time. Under Penalty a denied slice
// counts min, never the ask.
//
// 1 <= min <= n and share >= 1 (ErrInvalidCost and ErrInvalidOption
// otherwise); n above the capacity is the capacity, as for UpTo, and a min
// above it can never be granted (ErrCostExceedsLimit). A slice is one
// key's: it is refused with Spread above 1, a stored Policy, a token bucket
// with Penalty, and by a MemoryLimiter. Slices are coalesced with other
// checks; a token bucket's units count against the bucket's capacity until
// TokenBucketLeaseTime after the slice was taken, so that the bucket does
// not refill behind them (migration 000016). The failure
// policy answers a slice as a check of min units: a slice is only ever
// counted in PostgreSQL.
func Slice(min, n, share int64) Option {
	return Option{kind: optSlice, n: n, min: min, share: share}
}

// AtRate counts the check against rate r instead of the limiter's own: the
// per-call limit of clients that pass their limit with every check (a
// plan's quota, a per-tenant override), as redis_rate does. Counters
// follow the rules of Rate. Everything else is the limiter's: the failure
// policy, the deny cache, Shadow, Penalty and the Observer, which sees the
// limiter's own name at every rate. FallbackLimit scales with the rate
// (r.Limit × FallbackLimit / Limit, at least 1). With Spread, r's Limit
// and Burst must still give every row at least one unit. With Peek and
// Reset, it reads or forgets the rows that rate uses.
func AtRate(r Rate) Option { return Option{kind: optRate, rate: r} }

// MaxRequestIDLength is the longest request id RequestID takes, in bytes.
const MaxRequestIDLength = 1024

// RequestID makes the check idempotent: a check that carries id counts
// once for its key and limiter, however often it is sent. The check's
// answer is stored with the units it counts, in the same transaction
// (table pgrl_request, migration 000017); a later check of the same id and
// key is not made again but returns that first decision, with
// Decision.Replayed set, and counts nothing. Two checks of one id at once
// are counted once too: the second waits for the first and returns its
// answer. So a client may retry a check whose error was OutcomeUnknown
// (see Outcome) with the same id: the retry's decision says what the first
// did (Replayed: it was counted), or the retry is the first to count.
//
// id is the caller's (an Idempotency-Key header, a job id): 1 to
// MaxRequestIDLength bytes, any content; it is stored as a hash. An answer
// is kept for the limiter's window after the check, and until rl-cleanup
// deletes it. A check with a request id is one statement of its own, never
// coalesced with others, and the deny cache does not answer it. It is
// refused (ErrInvalidOption) with Slice, with Spread above 1, with a stored
// Policy, by a MemoryLimiter and by package lease; AllowAll takes none.
// When the database fails, the failure policy answers as for any check,
// without the id.
func RequestID(id string) Option { return Option{kind: optRequest, id: id} }

// OptionValue is what one Option gives, as Option.Value reports it.
type OptionValue struct {
	// Sized is set for Cost(n) and UpTo(n), and Units is their n (which
	// may be invalid: the check refuses it with ErrInvalidCost).
	Sized bool
	Units int64
	// UpTo is set for UpTo(n) and Slice(min, n, share): Units is a
	// ceiling, not a cost.
	UpTo bool
	// SliceMin and SliceShare are Slice's min and share, and Sliced is
	// set for it.
	SliceMin, SliceShare int64
	Sliced               bool
	// Rate is r for AtRate(r), and Rated is set for it.
	Rate  Rate
	Rated bool
	// RequestID is RequestID's id; empty for any other option.
	RequestID string
}

// Value reports what o gives, for wrappers of a Checker that read a
// check's options themselves: package policy refuses a rate given with
// the call (its policy holds the rate), package lease answers Cost and
// UpTo from its slices. The zero Option gives nothing: Sized and Rated
// false.
func (o Option) Value() OptionValue {
	switch o.kind {
	case optCost:
		return OptionValue{Sized: true, Units: o.n}
	case optUpTo:
		return OptionValue{Sized: true, Units: o.n, UpTo: true}
	case optSlice:
		return OptionValue{Sized: true, Units: o.n, UpTo: true, SliceMin: o.min, SliceShare: o.share, Sliced: true}
	case optRate:
		return OptionValue{Rate: o.rate, Rated: true}
	case optRequest:
		return OptionValue{RequestID: o.id}
	}
	return OptionValue{}
}

// options returns what opts ask for, and the rate they give when rated.
// A check may give Cost or UpTo once, and AtRate once; counts says whether
// the caller counts units (Peek and Reset do not, and refuse Cost and
// UpTo).
func options(name string, opts []Option, counts bool) (a ask, r Rate, rated bool, err error) {
	a = ask{n: 1}
	sized := false
	var id []byte
	for _, o := range opts {
		switch o.kind {
		case optCost, optUpTo, optSlice:
			if !counts {
				return a, r, false, invalid(ErrInvalidOption, "Cost, UpTo or Slice for %q where nothing is counted; Peek and Reset take only AtRate", name)
			}
			if sized {
				return a, r, false, invalid(ErrInvalidOption, "Cost, UpTo or Slice given twice for %q; give one of them, once", name)
			}
			sized = true
			a = ask{n: o.n, upTo: o.kind != optCost}
			if o.kind == optSlice {
				a.slice, a.min, a.share = true, o.min, o.share
			}
		case optRate:
			if rated {
				return a, r, false, invalid(ErrInvalidOption, "AtRate given twice for %q; give it once", name)
			}
			rated = true
			r = o.rate
		case optRequest:
			switch {
			case !counts:
				return a, r, false, invalid(ErrInvalidOption, "RequestID for %q where nothing is counted; Peek and Reset take only AtRate", name)
			case id != nil:
				return a, r, false, invalid(ErrInvalidOption, "RequestID given twice for %q; give it once", name)
			case o.id == "" || len(o.id) > MaxRequestIDLength:
				return a, r, false, invalid(ErrInvalidOption, "RequestID of %d bytes for %q; give 1 to %d bytes", len(o.id), name, MaxRequestIDLength)
			}
			sum := sha256.Sum256([]byte(o.id))
			id = sum[:16]
		default:
			return a, r, false, invalid(ErrInvalidOption, "the zero Option for %q; use Cost, UpTo, Slice, AtRate or RequestID", name)
		}
	}
	a.id = id
	return a, r, rated, nil
}

// resolve resolves opts for l: the limiter that decides (l, or l at the rate
// AtRate gives) and the ask.
func (l *Limiter) resolve(opts []Option, counts bool) (*Limiter, ask, error) {
	a, r, rated, err := options(l.cfg.Name, opts, counts)
	if err != nil || !rated {
		return l, a, err
	}
	lr, err := l.WithRate(r)
	return lr, a, err
}
