// Package denywire is the payload of the NOTIFY that shares deny marks
// between processes: ratelimit writes it, package policy's Listener reads
// it. One payload carries the marks of one limiter at one rate.
package denywire

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"
)

// Version is the payload's format version.
const Version = 1

// MaxPayload is the most bytes a payload may hold: PostgreSQL refuses a
// NOTIFY payload of 8,000 bytes or more.
const MaxPayload = 7999

// MaxBody is the most bytes the Go side writes; the database adds the
// schema and re-serialises the object (jsonb adds a space after each ':'
// and ','), which must stay under MaxPayload.
const MaxBody = 5500

// maxRead bounds what Decode accepts, whatever the server let through.
const maxRead = 16 << 10

// Payload is one NOTIFY's content.
type Payload struct {
	V         int    `json:"v"`
	Schema    string `json:"schema"`  // filled by the database: the schema of pgrl's tables
	Limiter   string `json:"limiter"` // Config.Name of the limiter that asked PostgreSQL
	Algorithm string `json:"alg"`
	WindowUs  int64  `json:"window_us"`
	Limit     int64  `json:"limit"`
	Burst     int64  `json:"burst"`
	Marks     []Mark `json:"marks"`
}

// Mark is one denial: PostgreSQL denied the stored key Key (hex) for checks
// costing Cost or more until UntilUs, on the database's clock (microseconds
// since the Unix epoch).
type Mark struct {
	Key     string `json:"key"`
	Cost    int64  `json:"cost"`
	UntilUs int64  `json:"until_us"`
	ResetUs int64  `json:"reset_us"`
	Used    int64  `json:"used"`
}

// Decoded is a checked mark.
type Decoded struct {
	Key     []byte
	Cost    int64
	UntilUs int64
	ResetUs int64
	Used    int64
}

// ErrInvalid is wrapped by every error of Decode.
var ErrInvalid = errors.New("invalid deny mark payload")

// Decode parses and checks a payload. It never panics: anything malformed
// (bad JSON, unknown version, numbers out of range, bad hex) is an error
// wrapping ErrInvalid. Marks are checked one by one; a bad mark fails the
// whole payload, which only a writer other than pgrl can produce.
func Decode(s string) (Payload, []Decoded, error) {
	var p Payload
	if len(s) > maxRead {
		return p, nil, fmt.Errorf("%w: %d bytes", ErrInvalid, len(s))
	}
	if err := json.Unmarshal([]byte(s), &p); err != nil {
		return p, nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if p.V != Version {
		return p, nil, fmt.Errorf("%w: version %d", ErrInvalid, p.V)
	}
	if p.Limiter == "" || p.WindowUs <= 0 || p.Limit <= 0 || p.Burst <= 0 || len(p.Marks) == 0 {
		return p, nil, fmt.Errorf("%w: missing or non-positive limiter, window, limit or burst, or no marks", ErrInvalid)
	}
	if p.WindowUs > math.MaxInt64/1000 {
		return p, nil, fmt.Errorf("%w: window %dus", ErrInvalid, p.WindowUs)
	}
	out := make([]Decoded, 0, len(p.Marks))
	for _, m := range p.Marks {
		k, err := hex.DecodeString(m.Key)
		if err != nil || len(k) == 0 {
			return p, nil, fmt.Errorf("%w: key %.40q", ErrInvalid, m.Key)
		}
		if m.Cost <= 0 || m.UntilUs <= 0 || m.ResetUs < 0 || m.Used < 0 {
			return p, nil, fmt.Errorf("%w: cost %d, until %d, reset %d, used %d", ErrInvalid, m.Cost, m.UntilUs, m.ResetUs, m.Used)
		}
		out = append(out, Decoded{Key: k, Cost: m.Cost, UntilUs: m.UntilUs, ResetUs: m.ResetUs, Used: m.Used})
	}
	return p, out, nil
}

// Encode writes p (its Schema left out: the database adds it) as one or
// more bodies of at most MaxBody bytes each, splitting its marks. It also
// returns how many marks fit in no body (only with a limiter name of
// thousands of bytes).
func Encode(p Payload) (bodies []string, skipped int) {
	p.V = Version
	marks := p.Marks
	for len(marks) > 0 {
		n := len(marks)
		for {
			p.Marks = marks[:n]
			b, _ := json.Marshal(bodyOf(p))
			if len(b) <= MaxBody || n == 1 {
				if len(b) <= MaxBody {
					bodies = append(bodies, string(b))
				} else {
					skipped++
				}
				break
			}
			n = (n + 1) / 2
		}
		marks = marks[n:]
	}
	return bodies, skipped
}

// body is Payload without the schema.
type body struct {
	V         int    `json:"v"`
	Limiter   string `json:"limiter"`
	Algorithm string `json:"alg"`
	WindowUs  int64  `json:"window_us"`
	Limit     int64  `json:"limit"`
	Burst     int64  `json:"burst"`
	Marks     []Mark `json:"marks"`
}

func bodyOf(p Payload) body {
	return body{V: p.V, Limiter: p.Limiter, Algorithm: p.Algorithm, WindowUs: p.WindowUs, Limit: p.Limit, Burst: p.Burst, Marks: p.Marks}
}

// driftAllowance divides the time since the clocks were compared into what
// a converted deadline is brought forward by: 1/5000 is 200 ppm, ten times
// what a server's clock drifts under NTP.
const driftAllowance = 5000

// LocalDeadline converts until, a deadline on the database's clock, into
// a local instant that is never later, from one comparison of the clocks:
// dbAt is what the database's clock read (clock_timestamp()) in a query
// sent at the local instant sentAt (time.Now() read before sending). The
// database read its clock at sentAt or later, so sentAt + (until - dbAt)
// comes no later than the local instant at which the database's clock
// reads until: the round trip is all the conversion loses. A further 200
// ppm of the time since the comparison (now - sentAt) is taken off, for
// the clocks' drift. The result carries sentAt's monotonic reading, so a
// step of the wall clock does not move it.
func LocalDeadline(until, dbAt, sentAt, now time.Time) time.Time {
	local := sentAt.Add(until.Sub(dbAt))
	if age := now.Sub(sentAt); age > 0 {
		local = local.Add(-age / driftAllowance)
	}
	return local
}
