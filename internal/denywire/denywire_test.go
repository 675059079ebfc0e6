package denywire

import (
	"strings"
	"testing"
	"time"
)

// Whatever the offset between the clocks and wherever in the round trip
// the database read its clock, the converted deadline is never later than
// the local instant at which the database's clock reaches the deadline,
// and early by at most the round trip (plus the drift allowance).
func TestLocalDeadlineNeverLate(t *testing.T) {
	base := time.Now()
	for _, offset := range []time.Duration{-time.Hour, -3 * time.Second, 0, 7 * time.Millisecond, 2 * time.Hour} {
		for _, rtt := range []time.Duration{0, 300 * time.Microsecond, 40 * time.Millisecond} {
			for _, readAt := range []float64{0, 0.5, 1} {
				for _, age := range []time.Duration{0, time.Second, time.Minute} {
					sent := base
					read := sent.Add(time.Duration(float64(rtt) * readAt)) // local instant of the read
					dbAt := read.Add(offset)                               // what the database's clock said
					until := dbAt.Add(10 * time.Minute)                    // PostgreSQL's deadline, its clock
					truth := until.Add(-offset)                            // the same instant, local clock
					got := LocalDeadline(until, dbAt, sent, sent.Add(age))
					if got.After(truth) {
						t.Fatalf("offset %v rtt %v read %.1f age %v: %v later than %v", offset, rtt, readAt, age, got.Sub(truth), truth)
					}
					if early := truth.Sub(got); early > rtt+age/driftAllowance+time.Microsecond {
						t.Fatalf("offset %v rtt %v: %v early", offset, rtt, early)
					}
				}
			}
		}
	}
}

// Encode splits many marks into payloads Decode reads back, each under the
// size limit once the database has added the schema.
func TestEncodeDecode(t *testing.T) {
	var marks []Mark
	for i := range 500 {
		marks = append(marks, Mark{Key: strings.Repeat("ab", 16), Cost: int64(i + 1), UntilUs: 1e15, ResetUs: 1e15, Used: 3})
	}
	bodies, skipped := Encode(Payload{Limiter: "login:ip", Algorithm: "fixed_window", WindowUs: 6e7, Limit: 5, Burst: 5, Marks: marks})
	if skipped != 0 || len(bodies) < 2 {
		t.Fatalf("%d bodies, %d skipped", len(bodies), skipped)
	}
	n := 0
	for _, b := range bodies {
		if len(b) > MaxBody {
			t.Fatalf("body of %d bytes", len(b))
		}
		p, ms, err := Decode(b)
		if err != nil || p.Limiter != "login:ip" {
			t.Fatal(err)
		}
		n += len(ms)
	}
	if n != len(marks) {
		t.Fatalf("%d marks back of %d", n, len(marks))
	}
	if b, skipped := Encode(Payload{Limiter: strings.Repeat("x", MaxBody), WindowUs: 1, Limit: 1, Burst: 1, Marks: marks[:1]}); len(b) != 0 || skipped != 1 {
		t.Fatalf("an oversized mark: %d bodies, %d skipped", len(b), skipped)
	}
}

// Decode never panics and refuses what pgrl does not write.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		``, `{}`, `{"v":1}`, `[1]`,
		`{"v":1,"limiter":"a","window_us":1,"limit":1,"burst":1,"marks":[{"key":"00","cost":1,"until_us":1}]}`,
		`{"v":1,"limiter":"a","window_us":9223372036854775807,"limit":1,"burst":1,"marks":[{"key":"00","cost":1,"until_us":1}]}`,
		`{"v":1,"limiter":"a","window_us":1,"limit":1,"burst":1,"marks":[{"key":"0","cost":1,"until_us":1}]}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, marks, err := Decode(s)
		if err == nil && (len(marks) == 0 || p.WindowUs <= 0 || p.Limit <= 0) {
			t.Fatalf("accepted %q", s)
		}
		for _, m := range marks {
			if m.Cost <= 0 || m.UntilUs <= 0 || len(m.Key) == 0 {
				t.Fatalf("accepted mark %+v", m)
			}
		}
	})
}
