// Package cli holds what pgrl's command-line tools share: exit codes, how a
// connection string is found, how a connection is opened with safe session
// settings, how errors become one actionable line, and, for the commands
// and the benchmarks, signal handling, list flags and warmed-up pools.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/pgerr"
)

// Exit codes shared by rl-migrate and rl-cleanup.
const (
	// ExitOK: success, or nothing to do.
	ExitOK = 0
	// ExitError: a runtime error (database unreachable, SQL failed, ...).
	ExitError = 1
	// ExitUsage: bad flags or arguments; nothing was done.
	ExitUsage = 2
	// ExitDirty: the migrations table is marked dirty; run `rl-migrate force`.
	ExitDirty = 3
	// ExitPending: `rl-migrate status --check` found migrations not applied.
	ExitPending = 4
)

// EnvDatabaseURL is read when no --database-url flag is given.
const EnvDatabaseURL = "DATABASE_URL"

// ConnString picks the connection string: the flag's value, else
// $DATABASE_URL, else "" (pgx then reads the libpq PG* variables: PGHOST,
// PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, ...). It also says where
// the value came from, for logs.
func ConnString(flagValue string) (conn, source string) {
	if flagValue != "" {
		return flagValue, "--database-url"
	}
	if v := os.Getenv(EnvDatabaseURL); v != "" {
		return v, EnvDatabaseURL
	}
	return "", "PG* environment variables"
}

// ParseConfig parses a connection string (see ConnString) and sets the
// application name.
func ParseConfig(connString, appName string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("invalid connection string: %v; pass a URL such as postgres://user:pass@host:5432/db via --database-url or DATABASE_URL", redact(err))
	}
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = appName
	}
	return cfg, nil
}

// Connect opens one connection with the given settings applied as session
// parameters (for example lock_timeout and statement_timeout).
func Connect(ctx context.Context, cfg *pgx.ConnConfig, settings map[string]string) (*pgx.Conn, error) {
	cfg = cfg.Copy()
	for k, v := range settings {
		cfg.RuntimeParams[k] = v
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, errors.New(Explain(err))
	}
	return conn, nil
}

// Explain turns an error into one line that says what went wrong and how to
// fix it. Passwords never appear in it.
func Explain(err error) string {
	if err == nil {
		return ""
	}
	if errors.Is(err, pgerr.ErrPermission) {
		return err.Error() // names the role and the grant already
	}
	kind, pgErr := pgerr.Classify(err)
	if kind == pgerr.Undefined {
		return fmt.Sprintf("%s: pgrl's tables are missing; run `rl-migrate up` against this database (and the same --schema)", pgErr.Message)
	}
	if kind == pgerr.Unsupported {
		return fmt.Sprintf("%s (SQLSTATE %s): this server does not run pgrl's SQL; run `rl-migrate up` with this version of pgrl, "+
			"use PostgreSQL 13 to 18, and on Citus see docs/SCALING.md", pgErr.Message, pgErr.Code)
	}
	if pgErr != nil {
		switch {
		case pgerr.IsAuthFailure(pgErr):
			return fmt.Sprintf("authentication failed (%s): check the user and password in --database-url, DATABASE_URL or PGUSER/PGPASSWORD", pgErr.Message)
		case pgerr.IsMissingDatabase(pgErr):
			return fmt.Sprintf("%s: create the database first, or point --database-url at an existing one", pgErr.Message)
		case pgerr.IsLockTimeout(pgErr):
			return fmt.Sprintf("%s: another session holds a conflicting lock; retry when it has finished, or raise --lock-timeout", pgErr.Message)
		case pgerr.IsQueryCanceled(pgErr):
			return fmt.Sprintf("%s: the statement ran past its timeout; retry, or raise --statement-timeout", pgErr.Message)
		case kind == pgerr.ReadOnly:
			return fmt.Sprintf("%s: this server is a read-only standby; point the tool at the primary", pgErr.Message)
		case kind == pgerr.Permission:
			return fmt.Sprintf("%s: the database user lacks a privilege; run as the owner of pgrl's tables or grant it", pgErr.Message)
		}
		return fmt.Sprintf("%s (SQLSTATE %s)", pgErr.Message, pgErr.Code)
	}
	var netErr net.Error
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) || errors.As(err, &netErr) {
		msg := dedupeLines(redact(err))
		if strings.Contains(msg, "password authentication failed") {
			return "authentication failed: check the user and password in --database-url, DATABASE_URL or PGUSER/PGPASSWORD"
		}
		if strings.Contains(msg, "does not exist") && strings.Contains(msg, "database") {
			return msg + ": create the database first, or point --database-url at an existing one"
		}
		return "cannot reach the database: " + msg + "; check that PostgreSQL is running and that --database-url, DATABASE_URL or PGHOST/PGPORT point at it"
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "timed out talking to the database; check that it is reachable and not overloaded"
	}
	return redact(err)
}

// dedupeLines joins the distinct lines of s with "; ". pgconn reports every
// connection attempt (with and without TLS, every address of a host) on a
// line of its own, often the same line twice.
func dedupeLines(s string) string {
	seen := map[string]bool{}
	var out []string
	for _, l := range strings.Split(s, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || seen[l] {
			continue
		}
		seen[l] = true
		out = append(out, l)
	}
	var b strings.Builder
	for i, l := range out {
		if i > 0 {
			if strings.HasSuffix(out[i-1], ":") {
				b.WriteString(" ")
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(l)
	}
	return b.String()
}

// redact removes anything that looks like a password from an error's text.
func redact(err error) string {
	s := err.Error()
	for _, marker := range []string{"password="} {
		if i := strings.Index(s, marker); i >= 0 {
			j := strings.IndexAny(s[i:], " &")
			if j < 0 {
				j = len(s) - i
			}
			s = s[:i] + marker + "xxxxx" + s[i+j:]
		}
	}
	return s
}

// PrintJSON writes v to w as one JSON object followed by a newline.
func PrintJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}
