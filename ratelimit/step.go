package ratelimit

import (
	"math"
	"math/bits"
)

// The steps: each algorithm's admit-and-charge arithmetic, once, as the
// functions pgrl_fixed_window_take, pgrl_token_bucket_take and
// pgrl_sliding_window_take of migration 000012 write it in SQL. A step goes
// from a key's state, the check's instant, the check (cost, penalty, up_to)
// and the limit to the key's next state, the verdict and the units granted.
// The memory tier decides every check with them; the table of test vectors
// in testdata/steps.json is run against these and against the SQL steps.
//
// A check either asks for all of its cost or nothing (upTo false), or is a
// partial grant (upTo true): it takes as many units as are left, at most its
// cost, and an ask above the capacity is an ask of the capacity in every
// respect. Under penalty every attempt is charged: a count stops at
// math.MaxInt64, a balance at -capacity.
//
// The SQL compares and adds in numeric; here the same figures are computed
// exactly in 128 bits (wide). A count the SQL would find out of the bigint
// range below (possible only with negative costs, which the SQL then refuses
// with an error) stops at math.MinInt64 here.

// fixedWindowStep is pgrl_fixed_window_take: the window ending at windowEnd
// holds count units (0 for a window not seen yet) and a check asks for cost
// of maxCount. The window is the check's: the caller passes the state of the
// window the check's instant falls in (see fixedWindowRow). The next state's
// at is windowEnd.
func fixedWindowStep(windowEnd, count, cost, maxCount int64, penalty, upTo bool) (next memState, allowed bool, granted int64) {
	room := widen(maxCount).sub(widen(count)) // maxCount - count, exactly
	take := cost
	if upTo {
		take = min(cost, maxCount)
		granted = min(take, room.atLeastZero())
		allowed = take > 0 && room.sign() > 0
	} else if allowed = widen(cost).cmp(room) <= 0; allowed {
		granted = cost
	}
	if penalty {
		count = addClamped(count, take)
	} else {
		count = addClamped(count, granted)
	}
	return memState{at: windowEnd, count: count}, allowed, granted
}

// fixedWindowRow is the state a fixed-window check at now sees of a key
// whose stored window ends at end holding count: that window's when it is
// the one now falls in, else a new window (its end, 0 units), as the SQL
// finds the row of the window ending at pgrl_window_end_us(now) or makes it.
func fixedWindowRow(end, count, now, windowUs int64) (int64, int64) {
	if cur := windowStartUs(now, windowUs) + windowUs; end != cur {
		return cur, 0
	}
	return end, count
}

// tokenBucketStep is pgrl_token_bucket_take: a bucket that held tokens at
// updatedAt, refilled at refillPerUs tokens a microsecond up to capacity
// until now (never backwards), and a check of cost. A partial grant takes
// the refilled balance's whole tokens, at most its ask (its cost, or
// floor(capacity) when the cost is above it). Balances are float64, as
// PostgreSQL's float8, rounded at every operation as there. The next
// state's at is the later of updatedAt and now.
func tokenBucketStep(tokens float64, updatedAt, now, cost int64, capacity, refillPerUs float64, penalty, upTo bool) (next memState, allowed bool, granted int64) {
	// float64() around the product keeps it rounded on its own, as in SQL
	// (Go may otherwise fuse the multiply and the add on some platforms).
	avail := min(capacity, tokens+float64(float64(max(now-updatedAt, 0))*refillPerUs))
	take := float64(cost)
	var got float64
	if upTo {
		take = min(take, math.Floor(capacity))
		got = min(take, max(math.Floor(avail), 0))
		allowed = take >= 1 && avail >= 1
	} else if allowed = avail >= take; allowed {
		got = take
	}
	switch {
	case penalty:
		tokens = max(avail-take, 0-capacity)
	default:
		tokens = avail - got
	}
	return memState{at: max(updatedAt, now), tokens: tokens}, allowed, int64(got)
}

// slidingWindowStep is pgrl_sliding_window_take: a row of the window
// starting at rowStart holding count and prev, rolled forward to the window
// of windowUs microseconds that holds now (a row of a later window, seen
// only when the clock went back, is kept as it is), and a check of cost
// against maxCount per window. The check fits when
//
//	prev*(windowUs-elapsed) + (count+cost)*windowUs <= maxCount*windowUs,
//
// exactly. Counts and maxCount are not negative.
func slidingWindowStep(rowStart, count, prev, now, windowUs, cost, maxCount int64, penalty, upTo bool) (next memState, allowed bool, granted int64) {
	ws := windowStartUs(now, windowUs)
	start := max(rowStart, ws)
	var cur, before int64
	switch {
	case rowStart >= ws:
		cur, before = count, prev
	case rowStart == ws-windowUs:
		before = count
	}
	elapsed := min(max(now-start, 0), windowUs)
	// room = floor((maxCount*windowUs - before*(windowUs-elapsed))/windowUs) - cur
	//      = maxCount - ceil(before*(windowUs-elapsed)/windowUs) - cur.
	hi, lo := bits.Mul64(uint64(before), uint64(windowUs-elapsed))
	q, r := bits.Div64(hi, lo, uint64(windowUs)) // q <= before: hi < windowUs
	if r > 0 {
		q++
	}
	room := widen(maxCount).sub(widen(int64(q))).sub(widen(cur))
	take := cost
	if upTo {
		take = min(cost, maxCount)
		granted = min(take, room.atLeastZero())
		allowed = take > 0 && room.sign() > 0
	} else if allowed = widen(cost).cmp(room) <= 0; allowed {
		granted = cost
	}
	if penalty {
		cur = addClamped(cur, take)
	} else {
		cur = addClamped(cur, granted)
	}
	return memState{at: start, count: cur, prev: before}, allowed, granted
}

// windowStartUs is the start of the window of windowUs microseconds that
// holds now: now floored to a multiple of windowUs, also before 1970, as
// pgrl_window_start_us computes it (Go's % truncates towards zero, as
// PostgreSQL's does, so a negative remainder is moved up by one window).
func windowStartUs(now, windowUs int64) int64 {
	return now - ((now%windowUs)+windowUs)%windowUs
}

// wide is a signed 128-bit integer, in two's complement: wide enough for
// the sums and differences of int64 figures the SQL computes in numeric.
type wide struct{ hi, lo uint64 }

func widen(x int64) wide { return wide{hi: uint64(x >> 63), lo: uint64(x)} }

func (a wide) sub(b wide) wide {
	lo, borrow := bits.Sub64(a.lo, b.lo, 0)
	hi, _ := bits.Sub64(a.hi, b.hi, borrow)
	return wide{hi: hi, lo: lo}
}

func (a wide) add(b wide) wide {
	lo, carry := bits.Add64(a.lo, b.lo, 0)
	hi, _ := bits.Add64(a.hi, b.hi, carry)
	return wide{hi: hi, lo: lo}
}

// cmp is -1, 0 or 1 as a is less than, equal to or greater than b.
func (a wide) cmp(b wide) int {
	switch {
	case int64(a.hi) < int64(b.hi):
		return -1
	case int64(a.hi) > int64(b.hi):
		return 1
	case a.lo < b.lo:
		return -1
	case a.lo > b.lo:
		return 1
	}
	return 0
}

func (a wide) sign() int { return a.cmp(wide{}) }

// clamp is a in the int64 range: math.MinInt64 or math.MaxInt64 beyond it.
func (a wide) clamp() int64 {
	switch {
	case a.cmp(widen(math.MaxInt64)) > 0:
		return math.MaxInt64
	case a.cmp(widen(math.MinInt64)) < 0:
		return math.MinInt64
	}
	return int64(a.lo)
}

// atLeastZero is max(a, 0), stopping at math.MaxInt64.
func (a wide) atLeastZero() int64 { return max(a.clamp(), 0) }

// addClamped is a+b, stopping at math.MaxInt64 (and math.MinInt64).
func addClamped(a, b int64) int64 { return widen(a).add(widen(b)).clamp() }
