// Package httplimit puts pgrl's limiters in front of net/http handlers.
//
// A Middleware takes each request's key from a function (the client's
// address, a header such as an API key, the route, or a combination),
// checks one limit or several at once, and either calls the next handler or
// answers 429 Too Many Requests with:
//
//   - Retry-After: the decision's retry-after in whole seconds, rounded up;
//   - RateLimit-Policy and RateLimit, the structured fields of the IETF draft
//     draft-ietf-httpapi-ratelimit-headers (see docs/HTTP.md for the version
//     followed and how each value is derived);
//   - optionally the legacy X-RateLimit-Limit, X-RateLimit-Remaining and
//     X-RateLimit-Reset;
//   - a small JSON body: {"error":"rate_limited","retry_after":N}, or with
//     Config.ProblemDetails the draft's "quota-exceeded" problem (RFC 9457).
//
// Allowed responses carry the rate-limit fields too, unless configured not
// to. What happens when PostgreSQL is down is the limiter's failure policy
// (ratelimit.Config.OnFailure); only errors the policy passes on, or that
// mean the setup is wrong, reach the middleware's OnError.
//
// A concurrency limit (ratelimit.Concurrency) bounds the requests in flight
// instead of their rate: the middleware takes one of the limit's slots
// before the handler runs (ratelimit.Limiter.Acquire), holds it while the
// handler runs, and gives it back when the handler returns, panics
// included; a request that finds every slot held is answered 429 like one
// over a rate. One middleware holds one concurrency limit: to bound both
// the rate and the requests in flight, wrap one middleware in the other
// (see Config.Limiter).
//
// The middleware counts requests before the handler runs. A cost known only
// after the handler's work (the tokens a model call used) is the handler's
// to count: it reserves an estimate with ratelimit.Limiter.Reserve before
// the work and settles the actual cost with Settle after it, with the
// request's Idempotency-Key as the reservation id (docs/CERTAINTY.md shows
// such a handler).
package httplimit

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// Header field names the middleware writes.
const (
	HeaderRetryAfter      = "Retry-After"
	HeaderRateLimitPolicy = "RateLimit-Policy"
	HeaderRateLimit       = "RateLimit"
	HeaderLegacyLimit     = "X-RateLimit-Limit"
	HeaderLegacyRemaining = "X-RateLimit-Remaining"
	HeaderLegacyReset     = "X-RateLimit-Reset"
)

// Quota units of the draft's "qu" parameter (its RateLimit Quota Units
// registry), for Config.QuotaUnit and Rule.QuotaUnit.
const (
	// UnitRequests counts requests: the draft's default, so a limit whose
	// unit is left empty is reported in requests without a "qu".
	UnitRequests = "requests"
	// UnitContentBytes counts the bytes of request or response content: a
	// limit whose CostFunc returns a byte count.
	UnitContentBytes = "content-bytes"
	// UnitConcurrentRequests counts requests in flight at once.
	UnitConcurrentRequests = "concurrent-requests"
)

// PartitionKeyFunc returns the partition key a limit reports for a
// request's key, in the "pk" parameter of both fields (a Byte Sequence,
// base64 on the wire), or nil to report none. It runs once per limit per
// request; its result goes to the client, so it must not reveal what the
// client should not see. HashedPartitionKey is one.
type PartitionKeyFunc func(key string) []byte

// HashedPartitionKey is a PartitionKeyFunc: the first 12 bytes of the
// SHA-256 of the key. A client that knows its key (its API key, its
// address) can compute it to tell its partitions apart; the field reveals
// nothing of a key the client does not know.
func HashedPartitionKey(key string) []byte {
	sum := sha256.Sum256([]byte(key))
	return sum[:12]
}

// KeyFunc returns the key a request is limited by. Returning false skips
// the limit for that request (no key: an anonymous request for a per-user
// limit, say).
type KeyFunc func(r *http.Request) (key string, ok bool)

// CostFunc returns how many units a request costs. A cost of zero or less
// skips the limit for that request.
type CostFunc func(r *http.Request) int64

// Checker is one limit: ratelimit.Checker, which *ratelimit.Limiter (in
// PostgreSQL), *ratelimit.MemoryLimiter (in process memory) and
// *policy.Limiter (a limit stored in PostgreSQL, also a KeyedLimiter)
// satisfy.
type Checker = ratelimit.Checker

// KeyedLimiter is a limit whose rate depends on the key and may change
// while the middleware runs: *policy.Limiter, a limit stored in PostgreSQL
// with per-key overrides. For returns the *ratelimit.Limiter that decides
// for key now; Config names the limit. The middleware checks each request
// with the limiter For returns, and its RateLimit-Policy member reports
// that limiter's rate: the quota and window in force for this key and this
// request (an override's, when one applies), not the policy as it was when
// the middleware was made.
type KeyedLimiter interface {
	For(key string) (*ratelimit.Limiter, error)
	Config() ratelimit.Config
}

// Rule is one limit of a multi-limit middleware, decided together with the
// others in one round trip by ratelimit.AllowAll.
type Rule struct {
	// Limiter is the limit. Either Limiter or Keyed is required. Every
	// rule's limiter must use the same database.
	Limiter *ratelimit.Limiter
	// Keyed is a limit whose rate depends on the key (*policy.Limiter),
	// set instead of Limiter: each request is checked with the limiter
	// Keyed.For returns for its key.
	Keyed KeyedLimiter
	// Leased is a leased limit (package lease), set instead of Limiter:
	// its checks are answered from slices of its quota. Rules are then
	// all leased, or none: lease.AllowAll decides leased rules together
	// in Mode, from their slices, and their limiters must send their
	// statements to one database.
	Leased *lease.Limiter
	// Key returns the request's key for this limit; false skips this
	// limit (the others still apply). Defaults to Config.Key.
	Key KeyFunc
	// Cost returns the request's cost for this limit. Defaults to
	// Config.Cost, or 1 when that is nil too.
	Cost CostFunc
	// Policy names the limit in the RateLimit-Policy and RateLimit fields:
	// printable ASCII. Defaults to the limiter's name.
	Policy string
	// QuotaUnit is the unit of this limit's quota, reported as "qu":
	// UnitRequests, UnitContentBytes or UnitConcurrentRequests. Defaults
	// to Config.QuotaUnit.
	QuotaUnit string
	// PartitionKey reports this limit's partition key as "pk". Defaults
	// to Config.PartitionKey.
	PartitionKey PartitionKeyFunc
}

// HeaderMode chooses the rate-limit fields written.
type HeaderMode int

const (
	// HeadersDraft writes RateLimit-Policy and RateLimit on every
	// response, allowed or denied. The default.
	HeadersDraft HeaderMode = iota
	// HeadersDraftAndLegacy also writes X-RateLimit-Limit,
	// X-RateLimit-Remaining and X-RateLimit-Reset on every response.
	HeadersDraftAndLegacy
	// HeadersDeniedOnly writes RateLimit-Policy and RateLimit on 429
	// responses only; allowed responses carry no rate-limit field.
	HeadersDeniedOnly
	// HeadersNone writes no rate-limit field at all; 429 responses still
	// carry Retry-After.
	HeadersNone
)

// Config configures a Middleware. Set either Limiter (one limit) or Rules
// (several limits decided together).
type Config struct {
	// Limiter is the limit checked for every request. Either Limiter or
	// Rules is required. A Checker that is also a KeyedLimiter (such as
	// *policy.Limiter) is checked through For, per request.
	//
	// A *ratelimit.Limiter whose Algorithm is ratelimit.Concurrency bounds
	// the requests in flight per key: each admitted request holds one of
	// its slots until the handler returns (or panics), then gives it back.
	// Such a limit is reported with the unit "concurrent-requests" and no
	// window, needs no Cost (a request holds one slot) and no
	// RequestIDHeader, and cannot be one of Rules: to bound the rate too,
	// give each limit a middleware of its own and nest them,
	// inflight.Handler(rates.Handler(h)), so that a request refused for
	// its rate holds a slot only for the check.
	Limiter Checker

	// Rules are several limits decided together, in one round trip, by
	// ratelimit.AllowAll in Mode (a login's per email+IP, per IP and per
	// email limits, or a per-client limit and a global ceiling). When only
	// one rule applies to a request (the others' keys skipped it), it is
	// checked alone. Rules are rates: a concurrency limit goes in a
	// middleware of its own (Limiter).
	Rules []Rule

	// Mode says what Rules consume when one of them denies. Defaults to
	// ratelimit.AllOrNothing.
	Mode ratelimit.MultiMode

	// Key returns the request's key: for Limiter, and for every rule
	// without a Key of its own. Required with Limiter. See ByIP, ByHeader,
	// ByRoute, Constant and Combine.
	Key KeyFunc

	// Cost returns the request's cost, for Limiter and for every rule
	// without a Cost of its own. Defaults to 1 per request. Not with a
	// concurrency limit, where every request holds one slot (skip a
	// request with Key instead).
	Cost CostFunc

	// Policy names Limiter's limit in the RateLimit-Policy and RateLimit
	// fields: printable ASCII. Defaults to the limiter's name.
	Policy string

	// Headers chooses the rate-limit fields written. Defaults to
	// HeadersDraft.
	Headers HeaderMode

	// QuotaUnit is the unit of the quota, reported as the "qu" parameter
	// of RateLimit-Policy, for Limiter and every rule without a unit of
	// its own: UnitRequests or UnitContentBytes for a rate, the units the
	// draft registers. Empty (the default) sends no "qu", which the draft
	// reads as requests: set it when Cost counts something else. A
	// concurrency limit is always reported in UnitConcurrentRequests
	// (leave QuotaUnit empty); a rate never is.
	QuotaUnit string

	// PartitionKey reports each request's partition key as the "pk"
	// parameter of both fields, for Limiter and every rule without one of
	// its own, so that a client acting for several users or keys can tell
	// their quotas apart. Nil (the default) sends none. The request's key
	// can be a secret (an API key) or personal (an address): report a
	// digest such as HashedPartitionKey, never the key itself.
	PartitionKey PartitionKeyFunc

	// ProblemDetails makes denied requests answer with the draft's
	// "quota-exceeded" problem type (RFC 9457, application/problem+json),
	// naming the denying limits in "violated-policies", instead of the
	// default JSON body. Not with DenyHandler.
	ProblemDetails bool

	// DenyHandler writes the response to a denied request. The status is
	// not yet written, but Retry-After and the rate-limit fields are already
	// set on w.Header(). Defaults to a 429 with the JSON body
	// {"error":"rate_limited","retry_after":N}.
	DenyHandler func(w http.ResponseWriter, r *http.Request, d ratelimit.MultiDecision)

	// OnError writes the response when a check returns an error instead of
	// a decision. With the default failure policy (fail to memory) a
	// database outage is not an error; errors here mean the limiter's
	// policy is FailError, the setup is wrong (tables missing, a read-only
	// standby), a request's cost can never be admitted, or the request's
	// context ended. The error is logged first. Defaults to a 503 with
	// {"error":"rate_limiter_unavailable"}, or a 413 with
	// {"error":"cost_exceeds_limit"} for ratelimit.ErrCostExceedsLimit: a
	// check that cannot be made must not let the request through
	// unlimited. To let requests through instead, pass a function that
	// calls the next handler, or set the limiter's OnFailure to FailOpen.
	OnError func(w http.ResponseWriter, r *http.Request, err error)

	// Logger receives check errors (level Error), failures to give a
	// concurrency limit's slot back (level Warn: the slot lapses by itself
	// after the limit's Window) and denials (level Debug). Defaults to
	// slog.Default().
	Logger *slog.Logger

	// RequestIDHeader names a request header, such as HeaderIdempotencyKey,
	// whose value makes the check idempotent (ratelimit.RequestID): a
	// client that sends a request again with the same value (a retry after
	// a timeout) is counted once, and gets the first decision again. A
	// request without the header is checked as usual; one whose value is
	// longer than ratelimit.MaxRequestIDLength is answered 400 with
	// {"error":"invalid_request_id"}, and not checked. The handler still
	// runs for every allowed copy: the limiter counts the request once, it
	// does not make the handler idempotent. Needs Limiter to be a
	// *ratelimit.Limiter without a stored Policy and with Spread 1, and
	// not a concurrency limit (New refuses others: they cannot keep ids);
	// empty by default.
	RequestIDHeader string
}

// HeaderIdempotencyKey is the request header of the IETF's draft "The
// Idempotency-Key HTTP Header Field", a choice for
// Config.RequestIDHeader.
const HeaderIdempotencyKey = "Idempotency-Key"

// Middleware limits requests before they reach a handler. It is safe for
// concurrent use.
type Middleware struct {
	rules     []rule
	requestID string // Config.RequestIDHeader
	problem   bool   // Config.ProblemDetails
	mode      ratelimit.MultiMode
	multi     bool
	headers   HeaderMode
	deny      func(http.ResponseWriter, *http.Request, ratelimit.MultiDecision)
	onError   func(http.ResponseWriter, *http.Request, error)
	logger    *slog.Logger
}

type rule struct {
	checker Checker
	limiter *ratelimit.Limiter // set for Rules
	keyed   KeyedLimiter       // set for a limit resolved per key
	leased  *lease.Limiter     // set for a leased rule
	key     KeyFunc
	cost    CostFunc
	slots   *ratelimit.Limiter // set for a concurrency limit: Acquire, not Allow
	name    string
	unit    string           // the quota unit, "" for requests
	pk      PartitionKeyFunc // nil: no partition key reported
	policy  string           // the member of RateLimit-Policy: "name";q=Q[;qu=U][;w=W]
}

// ErrInvalidConfig is wrapped by every error New returns.
var ErrInvalidConfig = errors.New("httplimit: invalid configuration")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
}

// New validates cfg and returns the middleware.
func New(cfg Config) (*Middleware, error) {
	m := &Middleware{mode: cfg.Mode, headers: cfg.Headers, deny: cfg.DenyHandler, onError: cfg.OnError, logger: cfg.Logger}
	if m.logger == nil {
		m.logger = slog.Default()
	}
	if m.deny == nil {
		m.deny = DefaultDenyHandler
	}
	if m.onError == nil {
		m.onError = DefaultErrorHandler
	}
	if cfg.Headers < HeadersDraft || cfg.Headers > HeadersNone {
		return nil, invalid("header mode %d; use HeadersDraft, HeadersDraftAndLegacy, HeadersDeniedOnly or HeadersNone", cfg.Headers)
	}
	if cfg.ProblemDetails {
		if cfg.DenyHandler != nil {
			return nil, invalid("both ProblemDetails and DenyHandler are set; a DenyHandler writes its own body, so set one")
		}
		m.problem = true
	}
	if cfg.Mode != ratelimit.AllOrNothing && cfg.Mode != ratelimit.ConsumeAll {
		return nil, invalid("multi mode %d; use ratelimit.AllOrNothing or ratelimit.ConsumeAll", cfg.Mode)
	}
	cost := cfg.Cost
	if cost == nil {
		cost = func(*http.Request) int64 { return 1 }
	}
	switch {
	case cfg.Limiter != nil && len(cfg.Rules) > 0:
		return nil, invalid("both Limiter and Rules are set; use Limiter for one limit, Rules for several")
	case cfg.Limiter != nil:
		if isNilChecker(cfg.Limiter) {
			return nil, invalid("Limiter is a nil pointer")
		}
		if cfg.Key == nil {
			return nil, invalid("no Key function; use ByIP, ByHeader, ByRoute, Constant or your own")
		}
		lc := cfg.Limiter.Config()
		r, err := newRule(lc, cfg.Key, cost, cfg.Policy, cfg.QuotaUnit, cfg.PartitionKey)
		if err != nil {
			return nil, err
		}
		r.checker = cfg.Limiter
		if k, ok := cfg.Limiter.(KeyedLimiter); ok {
			r.keyed = k
		}
		if lc.Algorithm == ratelimit.Concurrency {
			if err := slotsOnly(cfg, lc); err != nil {
				return nil, err
			}
			r.slots, r.keyed = cfg.Limiter.(*ratelimit.Limiter), nil
		}
		m.rules = []rule{r}
	case len(cfg.Rules) > 0:
		if cfg.Policy != "" {
			return nil, invalid("Policy is set with Rules; name each rule's policy in Rule.Policy")
		}
		names := map[string]int{}
		for i, rr := range cfg.Rules {
			var lc ratelimit.Config
			set := 0
			for _, ok := range []bool{rr.Limiter != nil, rr.Keyed != nil, rr.Leased != nil} {
				if ok {
					set++
				}
			}
			switch {
			case set > 1:
				return nil, invalid("rule %d sets more than one of Limiter, Keyed and Leased; set one", i)
			case rr.Limiter != nil:
				lc = rr.Limiter.Config()
			case rr.Keyed != nil:
				lc = rr.Keyed.Config()
			case rr.Leased != nil:
				lc = rr.Leased.Config()
			default:
				return nil, invalid("rule %d has no Limiter (nor Keyed, nor Leased)", i)
			}
			if leased := rr.Leased != nil; leased != (cfg.Rules[0].Leased != nil) {
				state := "not leased but rule 0 is"
				if leased {
					state = "leased but rule 0 is not"
				}
				return nil, invalid("rule %d (%q) is %s; Rules are decided together, by lease.AllowAll when leased and by ratelimit.AllowAll otherwise: lease every rule (lease.New), or none", i, lc.Name, state)
			}
			if lc.Algorithm == ratelimit.Concurrency {
				return nil, invalid("rule %d (%q) is a concurrency limit; Rules are rates decided together by ratelimit.AllowAll, and a slot is held while the handler runs: give it a middleware of its own (Config.Limiter) and nest the two, inflight.Handler(rules.Handler(h))", i, lc.Name)
			}
			key, c := rr.Key, rr.Cost
			if key == nil {
				key = cfg.Key
			}
			if key == nil {
				return nil, invalid("rule %d (%q) has no Key, and Config.Key is not set", i, lc.Name)
			}
			if c == nil {
				c = cost
			}
			unit, pk := rr.QuotaUnit, rr.PartitionKey
			if unit == "" {
				unit = cfg.QuotaUnit
			}
			if pk == nil {
				pk = cfg.PartitionKey
			}
			r, err := newRule(lc, key, c, rr.Policy, unit, pk)
			if err != nil {
				return nil, fmt.Errorf("rule %d: %w", i, err)
			}
			r.limiter, r.keyed, r.leased = rr.Limiter, rr.Keyed, rr.Leased
			if rr.Leased != nil {
				r.checker = rr.Leased
			}
			if j, dup := names[r.name]; dup {
				return nil, invalid("rules %d and %d are both named %q in the RateLimit fields; set Rule.Policy to tell them apart", j, i, r.name)
			}
			names[r.name] = i
			m.rules = append(m.rules, r)
		}
		m.multi = true
	default:
		return nil, invalid("neither Limiter nor Rules is set")
	}
	if cfg.RequestIDHeader != "" {
		if len(m.rules) == 1 && m.rules[0].slots != nil {
			return nil, invalid("RequestIDHeader %q with %q, a concurrency limit; a request sent again is another request in flight, holding a slot of its own, so it cannot be counted once: drop RequestIDHeader from this middleware (a rate limit's middleware, nested in it, can keep it)", cfg.RequestIDHeader, m.rules[0].slots.Config().Name)
		}
		l, ok := cfg.Limiter.(*ratelimit.Limiter)
		if !ok || l.Config().Policy != "" || l.Config().Spread > 1 {
			return nil, invalid("RequestIDHeader %q needs Limiter to be a *ratelimit.Limiter without a stored Policy and with Spread 1, which keeps request ids (ratelimit.RequestID); drop RequestIDHeader, or check with such a limiter", cfg.RequestIDHeader)
		}
		m.requestID = http.CanonicalHeaderKey(cfg.RequestIDHeader)
	}
	return m, nil
}

// slotsOnly checks what a middleware of the concurrency limit lc needs: a
// *ratelimit.Limiter, which holds slots, and no Cost.
func slotsOnly(cfg Config, lc ratelimit.Config) error {
	if _, ok := cfg.Limiter.(*ratelimit.Limiter); !ok {
		return invalid("Limiter %q is a concurrency limit held by a %T; the middleware holds slots of a *ratelimit.Limiter only: use one (Database.Limiter), whose Acquire holds a slot in PostgreSQL for each request in flight", lc.Name, cfg.Limiter)
	}
	if cfg.Cost != nil {
		return invalid("Cost is set with %q, a concurrency limit; every request in flight holds one slot: drop Cost, and skip the requests that should not count by returning false from Key", lc.Name)
	}
	return nil
}

func isNilChecker(c Checker) bool {
	switch v := c.(type) {
	case *ratelimit.Limiter:
		return v == nil
	case *ratelimit.MemoryLimiter:
		return v == nil
	}
	return false
}

func newRule(lc ratelimit.Config, key KeyFunc, cost CostFunc, name, unit string, pk PartitionKeyFunc) (rule, error) {
	if name == "" {
		name = lc.Name
	}
	if err := validPolicyName(name); err != nil {
		return rule{}, err
	}
	switch unit {
	case "", UnitRequests, UnitContentBytes, UnitConcurrentRequests:
	default:
		return rule{}, invalid("quota unit %q is not one the draft registers; use UnitRequests or UnitContentBytes (UnitConcurrentRequests for a concurrency limit), or leave it empty and describe the unit in your API's documentation", unit)
	}
	switch {
	case lc.Algorithm == ratelimit.Concurrency && unit == "":
		unit = UnitConcurrentRequests
	case lc.Algorithm == ratelimit.Concurrency && unit != UnitConcurrentRequests:
		return rule{}, invalid("quota unit %q for %q, a concurrency limit; it counts requests in flight, always reported as %q: leave the quota unit empty", unit, lc.Name, UnitConcurrentRequests)
	case lc.Algorithm != ratelimit.Concurrency && unit == UnitConcurrentRequests:
		return rule{}, invalid("quota unit %q for %q, a %s limit; it counts requests per window, not requests in flight: leave the quota unit empty (or set the unit Cost counts), or bound requests in flight with a ratelimit.Concurrency limit", unit, lc.Name, lc.Algorithm)
	}
	r := rule{key: key, cost: cost, name: name, unit: unit, pk: pk}
	r.policy = r.member(lc)
	return r, nil
}

// member is the rule's RateLimit-Policy member for the limit c:
// "name";q=Q;qu="unit";w=W, with qu only for a unit set. A concurrency
// limit has no window: its member is "name";q=Q;qu="concurrent-requests".
// The partition key is per request, added by setFields.
func (r *rule) member(c ratelimit.Config) string {
	q, w := quota(c)
	s := sfString(r.name) + ";q=" + strconv.FormatInt(q, 10)
	if r.unit != "" {
		s += ";qu=" + sfString(r.unit)
	}
	if c.Algorithm == ratelimit.Concurrency {
		// Its Window is a slot's lease, not a period the quota is
		// allocated over; the draft's w is optional.
		return s
	}
	return s + ";w=" + strconv.FormatInt(w, 10)
}

// quota is a limit's RateLimit-Policy quota and window in seconds: Limit
// per Window for the window algorithms; for the token bucket, Burst per the
// time an empty bucket takes to refill it (Limit per Window when Burst is
// the default).
func quota(c ratelimit.Config) (q, w int64) {
	q, window := c.Limit, c.Window
	if c.Algorithm == ratelimit.TokenBucket && c.Burst > 0 && c.Burst != c.Limit {
		q = c.Burst
		window = time.Duration(math.Ceil(float64(c.Window) * float64(c.Burst) / float64(c.Limit)))
	}
	return q, max(ceilSeconds(window), 1)
}

// validPolicyName accepts what a structured-field String can carry.
func validPolicyName(s string) error {
	if s == "" {
		return invalid("empty policy name")
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return invalid("policy name %q has a byte (%#x) a RateLimit field cannot carry; set Policy to printable ASCII", s, s[i])
		}
	}
	return nil
}

// sfString serialises s as a structured-field String (RFC 9651, 4.1.6).
func sfString(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// Handler returns next behind the limit.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

// HandlerFunc is Handler for a function.
func (m *Middleware) HandlerFunc(next func(http.ResponseWriter, *http.Request)) http.Handler {
	return m.Handler(http.HandlerFunc(next))
}

type active struct {
	r    *rule
	key  string
	cost int64
	// lim is the limiter that checks this request: the rule's, or for a
	// keyed rule the one For returned; nil for a Config.Limiter checked
	// through its Checker.
	lim *ratelimit.Limiter
	// policy is the RateLimit-Policy member of the rate lim applies.
	policy string
	// pk is the ";pk=:…:" parameter of both fields, or "".
	pk string
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	var act []active
	for i := range m.rules {
		ru := &m.rules[i]
		key, ok := ru.key(r)
		if !ok {
			continue
		}
		cost := ru.cost(r)
		if cost <= 0 {
			continue
		}
		a := active{r: ru, key: key, cost: cost, lim: ru.limiter, policy: ru.policy}
		if ru.pk != nil {
			if b := ru.pk(key); len(b) > 0 {
				a.pk = ";pk=:" + base64.StdEncoding.EncodeToString(b) + ":"
			}
		}
		if ru.keyed != nil {
			// The rate in force for this key now (a stored policy, or the
			// key's override), reported as such in RateLimit-Policy.
			lim, err := ru.keyed.For(key)
			if err != nil {
				m.fail(w, r, append(act, a), err)
				return
			}
			a.lim, a.policy = lim, ru.member(lim.Config())
		}
		act = append(act, a)
	}
	if len(act) == 0 {
		next.ServeHTTP(w, r)
		return
	}
	var opts []ratelimit.Option
	if m.requestID != "" {
		if id := r.Header.Get(m.requestID); len(id) > ratelimit.MaxRequestIDLength {
			writeJSON(w, http.StatusBadRequest, `{"error":"invalid_request_id"}`)
			return
		} else if id != "" {
			opts = append(opts, ratelimit.RequestID(id))
		}
	}
	if act[0].r.slots != nil {
		m.hold(w, r, next, act[0])
		return
	}
	md, err := m.decide(r.Context(), act, opts)
	if err != nil {
		m.fail(w, r, act, err)
		return
	}
	shown := representative(md)
	m.setFields(w.Header(), act, md, shown)
	if md.Allowed {
		next.ServeHTTP(w, r)
		return
	}
	m.refuse(w, r, act, md, shown)
}

// hold serves a request under the concurrency limit of a: it takes one of
// the limit's slots, calls next while holding it, and gives it back when
// next returns or panics.
func (m *Middleware) hold(w http.ResponseWriter, r *http.Request, next http.Handler, a active) {
	act := []active{a}
	slot, d, err := a.r.slots.Acquire(r.Context(), a.key)
	if err != nil {
		m.fail(w, r, act, err)
		return
	}
	md := single(d)
	m.setFields(w.Header(), act, md, 0)
	if !d.Allowed {
		m.refuse(w, r, act, md, 0)
		return
	}
	if slot != nil {
		defer m.release(r, a, slot)
		r = r.WithContext(context.WithValue(r.Context(), slotKey{}, slot))
	}
	next.ServeHTTP(w, r)
}

type slotKey struct{}

// SlotFrom returns the concurrency limit's slot that the middleware holds
// for the request whose context is ctx, or nil (no concurrency limit, or
// none held: a failure policy that let the request through). A long
// handler can watch its Done channel: closed when the slot is lost (its
// lease could not be extended, so another request may have its place),
// at which point the work should stop.
func SlotFrom(ctx context.Context) *ratelimit.Slot {
	s, _ := ctx.Value(slotKey{}).(*ratelimit.Slot)
	return s
}

// release gives back the slot a request held, with a context the request's
// end does not cancel: a client that went away still frees its place. A
// release that fails is logged, not answered: the slot, no longer
// extended, lapses by itself after the limit's Window.
func (m *Middleware) release(r *http.Request, a active, slot *ratelimit.Slot) {
	ctx := context.WithoutCancel(r.Context())
	if err := slot.Release(ctx); err != nil {
		m.logger.WarnContext(ctx, "pgrl: giving back a request's slot failed; it lapses after the limit's Window", "policy", a.r.name,
			"lease", a.r.slots.Config().Window, "method", r.Method, "path", r.URL.Path, "err", err)
	}
}

// refuse answers a request the limits of act denied (md), shown being the
// limit the RateLimit field reports first.
func (m *Middleware) refuse(w http.ResponseWriter, r *http.Request, act []active, md ratelimit.MultiDecision, shown int) {
	w.Header().Set(HeaderRetryAfter, strconv.FormatInt(ceilSeconds(md.RetryAfter()), 10))
	m.logger.DebugContext(r.Context(), "pgrl: request rate limited", "policy", act[shown].r.name,
		"retry_after", md.RetryAfter(), "method", r.Method, "path", r.URL.Path)
	if m.problem {
		denyProblem(w, act, md)
		return
	}
	m.deny(w, r, md)
}

// fail logs a check's error and answers with OnError.
func (m *Middleware) fail(w http.ResponseWriter, r *http.Request, act []active, err error) {
	names := make([]string, len(act))
	for i, a := range act {
		names[i] = a.r.name
	}
	m.logger.ErrorContext(r.Context(), "pgrl: rate limit check failed", "policies", names, "method", r.Method, "path", r.URL.Path, "err", err)
	m.onError(w, r, err)
}

// decide checks the active rules: one alone, several in one round trip.
// opts are the options of every check (a request id).
func (m *Middleware) decide(ctx context.Context, act []active, opts []ratelimit.Option) (ratelimit.MultiDecision, error) {
	if len(act) == 1 {
		var d ratelimit.Decision
		var err error
		opts = append(opts, ratelimit.Cost(act[0].cost))
		if act[0].lim != nil {
			d, err = act[0].lim.Allow(ctx, act[0].key, opts...)
		} else {
			d, err = act[0].r.checker.Allow(ctx, act[0].key, opts...)
		}
		if err != nil {
			return ratelimit.MultiDecision{}, err
		}
		return single(d), nil
	}
	if act[0].r.leased != nil {
		checks := make([]lease.Check, len(act))
		for i, a := range act {
			checks[i] = lease.Check{Limiter: a.r.leased, Key: a.key, Cost: a.cost}
		}
		return lease.AllowAll(ctx, m.mode, checks...)
	}
	checks := make([]ratelimit.Check, len(act))
	for i, a := range act {
		checks[i] = ratelimit.Check{Limiter: a.lim, Key: a.key, Cost: a.cost}
	}
	return ratelimit.AllowAll(ctx, m.mode, checks...)
}

// single is the MultiDecision of one limit's decision d.
func single(d ratelimit.Decision) ratelimit.MultiDecision {
	md := ratelimit.MultiDecision{Allowed: d.Allowed, Decisions: []ratelimit.Decision{d}, DeniedBy: -1}
	if !d.Allowed {
		md.DeniedBy = 0
	}
	return md
}

// representative picks the decision the RateLimit field reports: when
// denied, the denying limit that makes the client wait longest (the one
// Retry-After comes from); when allowed, the one with the fewest units
// remaining, then the one that takes longest to reset.
func representative(md ratelimit.MultiDecision) int {
	best := 0
	for i := 1; i < len(md.Decisions); i++ {
		d, b := md.Decisions[i], md.Decisions[best]
		if !md.Allowed {
			if !d.Allowed && (b.Allowed || d.RetryAfter > b.RetryAfter) {
				best = i
			}
			continue
		}
		if d.Remaining < b.Remaining || (d.Remaining == b.Remaining && d.ResetAfter() > b.ResetAfter()) {
			best = i
		}
	}
	return best
}

// setFields writes the rate-limit fields for the decisions md of the
// limits act. RateLimit-Policy lists every limit in rule order; RateLimit
// has a member per limit too, the one at shown (the most restrictive)
// first, so that a client reading only the first member honours them all.
//
// Fields already set, by a middleware this one is nested in, are kept:
// this one's policies follow theirs, and its RateLimit members follow
// theirs too, or come first when it denies the request.
func (m *Middleware) setFields(h http.Header, act []active, md ratelimit.MultiDecision, shown int) {
	d := md.Decisions[shown]
	switch {
	case m.headers == HeadersNone:
		return
	case m.headers == HeadersDeniedOnly && md.Allowed:
		return
	case md.Allowed && d.Store == ratelimit.StorePolicy:
		// No store decided (the database failed and the policy let the
		// request through): there is nothing true to report.
		return
	}
	policies := make([]string, len(act))
	for i, a := range act {
		policies[i] = a.policy + a.pk
	}
	addField(h, HeaderRateLimitPolicy, strings.Join(policies, ", "), false)
	limits := make([]string, 0, len(act))
	limits = append(limits, m.serviceLimit(act[shown], d, md.Allowed))
	for i, a := range act {
		if i != shown {
			limits = append(limits, m.serviceLimit(a, md.Decisions[i], md.Allowed))
		}
	}
	addField(h, HeaderRateLimit, strings.Join(limits, ", "), !md.Allowed)
	if m.headers == HeadersDraftAndLegacy {
		h.Set(HeaderLegacyLimit, strconv.FormatInt(d.Limit, 10))
		h.Set(HeaderLegacyRemaining, strconv.FormatInt(max(d.Remaining, 0), 10))
		switch {
		case act[shown].r.slots == nil:
			h.Set(HeaderLegacyReset, strconv.FormatInt(legacyReset(d), 10))
		case !d.Allowed:
			// A concurrency limit has no reset: a refusal reports when
			// to retry, as Retry-After does.
			d.ResetAt = d.Now.Add(d.RetryAfter)
			h.Set(HeaderLegacyReset, strconv.FormatInt(legacyReset(d), 10))
		default:
			h.Del(HeaderLegacyReset)
		}
	}
}

// addField sets the list field name to v, after (or, first, before) the
// members it already has.
func addField(h http.Header, name, v string, first bool) {
	had := h.Values(name)
	switch {
	case len(had) == 0:
	case first:
		v = v + ", " + strings.Join(had, ", ")
	default:
		v = strings.Join(had, ", ") + ", " + v
	}
	h.Set(name, v)
}

// serviceLimit is the RateLimit member of the limit a for its decision d
// of a request allowed or not: "name";r=R;t=T, and the partition key when
// one is reported. A concurrency limit that admitted the request has no t:
// a place frees when a request in flight ends, which nothing foretells.
func (m *Middleware) serviceLimit(a active, d ratelimit.Decision, allowed bool) string {
	remaining := max(d.Remaining, 0)
	if !allowed && d.Allowed && m.mode == ratelimit.AllOrNothing {
		// Another limit denied, so this one's units were given back: its
		// decision counts them as taken (MultiDecision), the key has them.
		remaining += a.cost
	}
	s := sfString(a.r.name) + ";r=" + strconv.FormatInt(remaining, 10)
	if a.r.slots == nil || !d.Allowed {
		s += ";t=" + strconv.FormatInt(fieldReset(d), 10)
	}
	return s + a.pk
}

// fieldReset is the RateLimit field's t: the seconds, rounded up, until
// more quota is available: the retry-after of a denied decision, the time
// until the limit resets for an allowed one.
func fieldReset(d ratelimit.Decision) int64 {
	if !d.Allowed {
		return ceilSeconds(d.RetryAfter)
	}
	return ceilSeconds(d.ResetAfter())
}

// legacyReset is X-RateLimit-Reset: the Unix time, in whole seconds rounded
// up, at which the limit resets (as GitHub's API and most libraries write
// it).
func legacyReset(d ratelimit.Decision) int64 {
	at := d.ResetAt
	if at.Before(d.Now) {
		at = d.Now
	}
	s := at.Unix()
	if at.Nanosecond() > 0 {
		s++
	}
	return s
}

// ceilSeconds rounds a duration up to whole seconds; never negative.
func ceilSeconds(d time.Duration) int64 {
	return ratelimit.Decision{RetryAfter: d}.RetryAfterSeconds()
}

// DefaultDenyHandler answers 429 Too Many Requests with the JSON body
// {"error":"rate_limited","retry_after":N}, N being Retry-After's value.
func DefaultDenyHandler(w http.ResponseWriter, _ *http.Request, d ratelimit.MultiDecision) {
	writeJSON(w, http.StatusTooManyRequests,
		`{"error":"rate_limited","retry_after":`+strconv.FormatInt(ceilSeconds(d.RetryAfter()), 10)+"}\n")
}

// ProblemQuotaExceeded is the type of the problem a denied request gets
// with Config.ProblemDetails: the draft's "quota-exceeded".
const ProblemQuotaExceeded = "https://iana.org/assignments/http-problem-types#quota-exceeded"

// denyProblem answers a denied request with the quota-exceeded problem,
// naming the limits that denied it.
func denyProblem(w http.ResponseWriter, act []active, md ratelimit.MultiDecision) {
	p := struct {
		Type       string   `json:"type"`
		Title      string   `json:"title"`
		Status     int      `json:"status"`
		Violated   []string `json:"violated-policies"`
		RetryAfter int64    `json:"retry_after"`
	}{Type: ProblemQuotaExceeded, Title: "Rate limit exceeded", Status: http.StatusTooManyRequests,
		Violated: []string{}, RetryAfter: ceilSeconds(md.RetryAfter())}
	for i, d := range md.Decisions {
		if !d.Allowed {
			p.Violated = append(p.Violated, act[i].r.name)
		}
	}
	b, _ := json.Marshal(p) // strings and integers: cannot fail
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(http.StatusTooManyRequests)
	_, _ = w.Write(append(b, '\n'))
}

// DefaultErrorHandler answers 413 with {"error":"cost_exceeds_limit"} when
// the request costs more than the limit can ever admit, and 503 Service
// Unavailable with {"error":"rate_limiter_unavailable"} for any other error.
func DefaultErrorHandler(w http.ResponseWriter, _ *http.Request, err error) {
	if errors.Is(err, ratelimit.ErrCostExceedsLimit) {
		writeJSON(w, http.StatusRequestEntityTooLarge, `{"error":"cost_exceeds_limit"}`+"\n")
		return
	}
	writeJSON(w, http.StatusServiceUnavailable, `{"error":"rate_limiter_unavailable"}`+"\n")
}

func writeJSON(w http.ResponseWriter, status int, body string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write([]byte(body))
}

// ByIP keys requests by client address, as res resolves it (a nil res
// uses the socket address). Requests whose socket address is not an IP
// address (a Unix socket) share the key "unknown".
func ByIP(res *clientip.Resolver) KeyFunc {
	return func(r *http.Request) (string, bool) {
		a := res.ClientIP(r)
		if !a.IsValid() {
			return "unknown", true
		}
		return a.String(), true
	}
}

// ByHeader keys requests by a header's value (an API key, a tenant); a
// request without it, or with it empty, skips the limit.
func ByHeader(name string) KeyFunc {
	return func(r *http.Request) (string, bool) {
		v := r.Header.Get(name)
		return v, v != ""
	}
}

// ByRoute keys requests by the route that serves them: the ServeMux pattern
// that matched (http.Request.Pattern, such as "POST /items/{id}"), set when
// the middleware wraps a handler registered on a ServeMux; otherwise the
// method and the path, whose values a client chooses, so prefer wrapping
// each handler.
func ByRoute(r *http.Request) (string, bool) {
	if r.Pattern != "" {
		return r.Pattern, true
	}
	return r.Method + " " + r.URL.Path, true
}

// Constant keys every request by the same key: one budget shared by all
// clients, such as a global ceiling behind a per-client limit.
func Constant(key string) KeyFunc {
	return func(*http.Request) (string, bool) { return key, true }
}

// Combine keys requests by several parts at once (email and address, user
// and route); a request that any part skips skips the limit. Parts are
// joined unambiguously: ("a:b", "c") and ("a", "b:c") give different keys.
func Combine(parts ...KeyFunc) KeyFunc {
	return func(r *http.Request) (string, bool) {
		var b strings.Builder
		for _, p := range parts {
			k, ok := p(r)
			if !ok {
				return "", false
			}
			b.WriteString(strconv.Itoa(len(k)))
			b.WriteByte(':')
			b.WriteString(k)
		}
		return b.String(), true
	}
}
