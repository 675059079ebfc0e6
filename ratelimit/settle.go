package ratelimit

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/sqlops"
)

// Reserve, then settle: for a cost known only after the work (an LLM
// call's tokens, the bytes a download streams), Reserve takes an estimate
// now, as a check of that cost, and Settle later charges the actual cost:
// it gives back what the estimate took beyond it, or charges what it
// missed, past the limit if need be. Both are idempotent, and both are kept
// in PostgreSQL, so any process may settle a reservation that another made.

// ErrReservationNotFound: Settle found no reservation of the id for the
// key: it was never made (or made by another limiter, or for another key),
// its check was answered by the failure policy rather than PostgreSQL
// (Decision.Store other than StorePostgres), or it lapsed and rl-cleanup
// has since deleted it. Nothing was charged or refunded.
var ErrReservationNotFound = errors.New("ratelimit: no reservation of this id for this key")

// ErrReservationLapsed: Settle came after the reservation lapsed, Window
// after it was made: the estimate stays counted, and the settlement is
// refused. Settle reservations within the limiter's Window.
var ErrReservationLapsed = errors.New("ratelimit: the reservation has lapsed; its estimate stays counted")

// Settlement is what Settle did with a reservation.
type Settlement struct {
	// Reserved is what the reservation was granted: its estimate when it
	// was allowed, 0 when denied (a denied reservation settles as one of
	// nothing: the actual cost is all charged).
	Reserved int64 `json:"reserved"`
	// Actual is the actual cost Settle was given.
	Actual int64 `json:"actual"`
	// Refunded is the units given back, when Actual is below Reserved:
	// Reserved - Actual, or less when the units no longer count (a fixed
	// window that has ended, a sliding window two windows on, a token bucket
	// that has refilled to its capacity in the meantime: a bucket is never
	// fuller than its capacity).
	Refunded int64 `json:"refunded"`
	// Charged is the units charged, when Actual is above Reserved: Actual -
	// Reserved, counted whatever the key has left, as under Penalty: a
	// count stops at math.MaxInt64, a token bucket's balance at -Burst.
	Charged int64 `json:"charged"`
	// Overage is how many of the Charged units went past the limit: the
	// units the key had not left when they were charged.
	Overage int64 `json:"overage"`
	// Replayed reports a settlement made before, by this call's first
	// attempt or another process: this is that settlement, and nothing was
	// charged or refunded now.
	Replayed bool `json:"-"`
}

// Reserve checks and counts estimate units for key under the reservation
// id, as Allow with Cost(estimate) does, and stores its answer so that
// Settle can settle it later, from any process. A second Reserve of the
// same id and key returns the first's decision (Decision.Replayed) and
// counts nothing. id is any 1 to MaxRequestIDLength bytes, unique per
// reservation of a key (a request id, a job id): reservations are kept in
// pgrl_request under the key and a hash of id, and share its rules (see
// RequestID): not with Spread above 1 or a stored Policy; nor with
// Penalty, under which a denied reservation would count its estimate
// (ErrInvalidOption).
//
// A reservation lapses Window after it was made: Settle refuses it from
// then on (ErrReservationLapsed) and the estimate stays counted. The
// failure policy answers a Reserve as a check when PostgreSQL fails, but
// such a reservation is not stored, and Settle finds none
// (ErrReservationNotFound).
func (l *Limiter) Reserve(ctx context.Context, key, id string, estimate int64) (Decision, error) {
	if err := l.checkReservation(key, id); err != nil {
		return Decision{}, WithOutcome(err, OutcomeNotConsumed)
	}
	a, _, _, err := options(l.cfg.Name, []Option{Cost(estimate)}, true)
	if err != nil {
		return Decision{}, WithOutcome(err, OutcomeNotConsumed)
	}
	a.id = reservationHash("reserve", id)
	return l.check(ctx, nil, key, a)
}

// Settle settles the reservation id of key (Reserve) with its actual cost,
// 0 or more: it refunds what the reservation took beyond actual, or charges
// actual's excess over it, counted even past the limit (Settlement.Overage
// says how far), in one transaction with a record of the settlement. So a
// reservation settles once: settling it again, from any process, changes
// nothing and returns the first settlement (Settlement.Replayed), and a
// Settle whose answer was lost can be sent again. A reservation whose
// process died can be settled by another.
//
// It fails with ErrReservationNotFound when no such reservation is stored,
// with ErrReservationLapsed when it lapsed (Window after it was made), and
// with ErrInvalidCost for a negative actual. Its errors carry their
// outcome (OutcomeOf), as a check's do. It runs within
// DatabaseOptions.Timeout; there is no failure policy: retry a failed
// Settle before the reservation lapses.
func (l *Limiter) Settle(ctx context.Context, key, id string, actual int64) (Settlement, error) {
	if err := l.checkReservation(key, id); err != nil {
		return Settlement{}, WithOutcome(err, OutcomeNotConsumed)
	}
	if actual < 0 {
		return Settlement{}, WithOutcome(invalid(ErrInvalidCost, "actual cost %d for %q; a settlement's actual cost is 0 or more", actual, l.cfg.Name), OutcomeNotConsumed)
	}
	ctx, cancel := l.st.deadlines.within(ctx, l.st.opts.Timeout)
	defer cancel()
	tx, err := begin(ctx, l.st.db)
	if err != nil {
		return Settlement{}, WithOutcome(mapErr(err), OutcomeNotConsumed)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // after Commit, a no-op
	s, err := l.settle(ctx, tx, l.key(key), id, actual)
	if err != nil {
		// Before the COMMIT: the server rolls the transaction back.
		return Settlement{}, WithOutcome(mapErr(err), OutcomeNotConsumed)
	}
	if s.Replayed {
		return s, nil
	}
	if err := tx.Commit(ctx); err != nil {
		return Settlement{}, WithOutcome(mapErr(err), statementOutcome(err, false))
	}
	return s, nil
}

// checkReservation refuses a reservation id, key or limiter that cannot
// keep one.
func (l *Limiter) checkReservation(key, id string) error {
	if id == "" || len(id) > MaxRequestIDLength {
		return invalid(ErrInvalidOption, "reservation id of %d bytes for %q; give 1 to %d bytes", len(id), l.cfg.Name, MaxRequestIDLength)
	}
	if l.cfg.Penalty {
		// A denied reservation would have counted its estimate, which its
		// stored answer (granted 0) does not tell.
		return invalid(ErrInvalidOption, "a reservation of %q, which has Penalty; reserve with a limiter of the same Name without Penalty", l.cfg.Name)
	}
	if err := l.cfg.checkRequestID(ask{}); err != nil {
		return err
	}
	return l.cfg.checkKey(key)
}

// reservationHash is the stored id of a reservation's answer (kind
// "reserve") or of its settlement ("settle"): apart from each other and
// from RequestID's ids.
func reservationHash(kind, id string) []byte {
	sum := sha256.Sum256([]byte("pgrl " + kind + "\x00" + id))
	return sum[:16]
}

// reservation is the stored answer of a reservation's check (the first row
// its check statement returned), as much of it as settling needs.
type reservation struct {
	Granted int64 `json:"granted"`
	// The fixed window's end and the instant of the check; the sliding
	// window's start.
	ExpiresAtUs   int64 `json:"expires_at_us"`
	NowUs         int64 `json:"now_us"`
	WindowStartUs int64 `json:"window_start_us"`
	// settledAtUs is the instant of the settlement, on the same clock.
	settledAtUs int64
}

// settle settles reservation id of the stored key k in tx.
func (l *Limiter) settle(ctx context.Context, tx pgx.Tx, k []byte, id string, actual int64) (Settlement, error) {
	q := sqlops.New()
	sid := reservationHash("settle", id)
	c, err := q.SettleClaim(ctx, tx, sqlops.SettleClaimParams{
		Key: k, ReserveID: reservationHash("reserve", id), SettleID: sid, At: l.at(),
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Settlement{}, fmt.Errorf("%w: %q of limiter %q (made by another limiter or key, answered by the failure policy, or lapsed and cleaned up)", ErrReservationNotFound, id, l.cfg.Name)
	}
	if err != nil {
		return Settlement{}, err
	}
	if !c.Claimed {
		stored, err := q.SettleRead(ctx, tx, sqlops.SettleReadParams{Key: k, SettleID: sid})
		if errors.Is(err, pgx.ErrNoRows) {
			return Settlement{}, fmt.Errorf("%w: %q of limiter %q lapsed %s ago", ErrReservationLapsed, id, l.cfg.Name, usToDuration(float64(c.NowUs-c.ExpiresAtUs)))
		}
		if err != nil {
			return Settlement{}, err
		}
		var s Settlement
		if err := json.Unmarshal(stored, &s); err != nil {
			return Settlement{}, fmt.Errorf("pgrl: reading the settlement of %q: %w", id, err)
		}
		s.Replayed = true
		return s, nil
	}
	var rows []reservation
	if err := json.Unmarshal(c.Result, &rows); err != nil || len(rows) == 0 {
		return Settlement{}, fmt.Errorf("pgrl: reading the reservation %q (%d rows): %v", id, len(rows), err)
	}
	r := rows[0]
	r.settledAtUs = c.NowUs
	s := Settlement{Reserved: r.Granted, Actual: actual}
	switch {
	case actual < r.Granted:
		if s.Refunded, err = l.alg.refund(ctx, l, tx, k, r, r.Granted-actual); err != nil {
			return Settlement{}, err
		}
	case actual > r.Granted:
		s.Charged = actual - r.Granted
		// Counted whatever is left, as a denied check is under Penalty.
		charge := &Limiter{shape: l.shape, st: l.st, name: l.name, q: l.q}
		charge.cfg.Penalty = true
		decs, err := l.alg.takeQueue(ctx, tx, newCheckQueue([]*pendingCheck{{l: charge, skey: k, ask: ask{n: s.Charged}}}))
		if err != nil {
			return Settlement{}, err
		}
		s.Overage = min(max(decs[0].Used-decs[0].Limit, 0), s.Charged)
	}
	stored, err := json.Marshal(s)
	if err != nil {
		return Settlement{}, err
	}
	if _, err := q.SettleRecord(ctx, tx, sqlops.SettleRecordParams{Key: k, SettleID: sid, Result: stored}); err != nil {
		return Settlement{}, err
	}
	return s, nil
}
