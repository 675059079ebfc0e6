package policy

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/ratelimit"
)

// Errors of this package. Test with errors.Is; the returned error's text adds
// the offending value and the fix. An invalid limit, window or burst also
// matches ratelimit's error for it (ratelimit.ErrInvalidLimit, ...).
var (
	// ErrNotFound: no policy has this name (or no override this key).
	ErrNotFound = errors.New("policy: not found")
	// ErrInvalid: a policy or override that ratelimit.Config or the
	// tables' constraints refuse (a limit of 0, an unknown algorithm, a
	// window of a month, a name with a space, a key that is too long).
	ErrInvalid = errors.New("policy: invalid policy")
	// ErrNotMigrated: the policy tables are missing; it is
	// ratelimit.ErrNotMigrated, so errors.Is matches either.
	ErrNotMigrated = ratelimit.ErrNotMigrated
	// ErrPermission: the database user may not read or write the policy
	// tables, or may not use the schema that holds them (PostgreSQL then
	// hides the tables, which look missing). The message names the grant.
	// The application role reads them only (rl-migrate up --grant-to);
	// write them as the migration role. It is ratelimit.ErrPermission (and
	// cleanup's and migration's), so errors.Is matches any of them.
	ErrPermission = ratelimit.ErrPermission
)

// invalid wraps ErrInvalid, and base too when it is not nil.
func invalid(base error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if base != nil && msg == "" {
		return fmt.Errorf("%w: %w", ErrInvalid, base)
	}
	if base != nil {
		return fmt.Errorf("%w: %w: %s", ErrInvalid, base, msg)
	}
	return fmt.Errorf("%w: %s", ErrInvalid, msg)
}

// constraintFix explains each constraint of migrations 000007 to 000009 in words that
// name the fix.
var constraintFix = map[string]string{
	"pgrl_policy_name_check":               "a policy name is 1 to 128 characters of A-Z a-z 0-9 _ . : / + -, starting with a letter or digit",
	"pgrl_policy_algorithm_check":          "the algorithm must be fixed_window, token_bucket or sliding_window",
	"pgrl_policy_limit_check":              "the limit must be at least 1",
	"pgrl_policy_window_check":             "the window must be from 1 millisecond to 366 days, without months or years (write '30 days', not '1 month')",
	"pgrl_policy_burst_check":              "the burst must be NULL (the limit) or from 1 to 2^53",
	"pgrl_policy_token_bucket_check":       "a token bucket holds at most 2^53 tokens and must refill within 1,000 years: lower the burst or raise the limit",
	"pgrl_policy_key_mode_check":           "key_mode must be hashed or readable",
	"pgrl_policy_readable_name_check":      "with readable keys a policy name may not contain ':'",
	"pgrl_policy_description_check":        "a description is at most 1,000 characters",
	"pgrl_policy_override_key_check":       "an override's key is the stored key, 1 to 2,305 bytes (pgrl_policy_key(policy, key))",
	"pgrl_policy_override_limit_check":     "an override's limit must be NULL (inherit) or at least 1",
	"pgrl_policy_override_window_check":    "an override's window must be NULL (inherit) or from 1 millisecond to 366 days, without months or years",
	"pgrl_policy_override_burst_check":     "an override's burst must be NULL (inherit) or from 1 to 2^53",
	"pgrl_policy_override_something_check": "an override must set at least one of limit, window and burst",
	"pgrl_policy_override_note_check":      "a note is at most 1,000 characters",
	"pgrl_policy_override_policy_fkey":     "the override's policy does not exist: create the policy first (rl-policy set)",
	"pgrl_policy_override_pkey":            "this key already has an override",
	"pgrl_policy_pkey":                     "a policy of this name already exists",
	"pgrl_policy_key_mode_overrides_check": "the policy has overrides, whose keys are stored in its key mode: delete them first, change the key mode, then set them again",
	"pgrl_policy_name_overrides_check":     "the policy has overrides, whose keys are stored under its name: create a policy of the new name with its own overrides, then delete this one",
	"pgrl_policy_override_key_mode_check":  "an override's key is the caller's key in its stored form under the policy's key mode: write it as pgrl_policy_key(policy, key) in SQL, or with Policy.StoredKey in Go",

	// Migration 000009.
	"pgrl_policy_override_key_length_check": "an override's key under readable keys holds at most 2,048 bytes after the policy's name and ':', the longest key a check takes: shorten the key, or use hashed keys",
}

// mapErr turns database errors into this package's errors, keeping the
// *pgconn.PgError in the chain for errors.As.
func mapErr(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrNotMigrated) || errors.Is(err, ErrPermission) || errors.Is(err, ratelimit.ErrUnsupported) {
		return err // mapped already
	}
	kind, pgErr := pgerr.Classify(err)
	switch {
	case pgErr == nil:
		return fmt.Errorf("policy: %w", err)
	case kind == pgerr.Undefined:
		return fmt.Errorf("%w: the policy tables are missing; run `rl-migrate up` (migration 7 adds pgrl_policy and pgrl_policy_override): %w", ErrNotMigrated, pgErr)
	case kind == pgerr.Permission:
		// Without a connection to ask, the message cannot tell a read
		// from a write: it names the grants of a write.
		return fmt.Errorf("policy: %w", pgerr.Denied(pgErr, pgerr.PolicyWrite))
	case pgerr.IsForeignKeyViolation(pgErr):
		return fmt.Errorf("%w: %s: %w", ErrNotFound, constraintFix[pgErr.ConstraintName], pgErr)
	case kind == pgerr.Unsupported:
		return fmt.Errorf("%w: run `rl-migrate up` with this version of pgrl: %w", ratelimit.ErrUnsupported, pgErr)
	case kind == pgerr.Input, kind == pgerr.NoPartition:
		fix := constraintFix[pgErr.ConstraintName]
		if fix == "" {
			fix = pgErr.Message
		}
		return fmt.Errorf("%w: %s: %w", ErrInvalid, fix, pgErr)
	}
	return fmt.Errorf("policy: %w", err)
}

// explainRead is mapErr for a read of the policies on db that failed
// with err: a missing grant, including a schema without USAGE (which makes
// the tables look missing), becomes an ErrPermission that names the grants
// the role lacks, read from db's catalog. Other errors are mapErr's.
func explainRead(ctx context.Context, db DB, err error) error {
	if err == nil {
		return nil
	}
	if pe := pgerr.Diagnose(ctx, db, pgerr.PolicyRead, err); pe != nil {
		return fmt.Errorf("policy: %w", pe)
	}
	return mapErr(err)
}
