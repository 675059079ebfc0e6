package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/pgerr"
)

func TestConnStringOrder(t *testing.T) {
	t.Setenv(EnvDatabaseURL, "postgres://env/db")
	c, src := ConnString("postgres://flag/db")
	require.Equal(t, "postgres://flag/db", c)
	require.Equal(t, "--database-url", src)
	c, src = ConnString("")
	require.Equal(t, "postgres://env/db", c)
	require.Equal(t, EnvDatabaseURL, src)
	t.Setenv(EnvDatabaseURL, "")
	c, _ = ConnString("")
	require.Empty(t, c)
}

func TestParseConfigRedactsPassword(t *testing.T) {
	_, err := ParseConfig("postgres://u:hunter2@host:notaport/db", "t")
	require.Error(t, err)
	require.NotContains(t, err.Error(), "hunter2")
	cfg, err := ParseConfig("postgres://u@host/db", "myapp")
	require.NoError(t, err)
	require.Equal(t, "myapp", cfg.RuntimeParams["application_name"])
}

func TestExplain(t *testing.T) {
	require.Contains(t, Explain(&pgconn.PgError{Code: "55P03", Message: "canceling statement due to lock timeout"}), "--lock-timeout")
	require.Contains(t, Explain(&pgconn.PgError{Code: "42P01", Message: `relation "pgrl_fixed_window" does not exist`}), "rl-migrate up")
	require.Contains(t, Explain(&pgconn.PgError{Code: "0A000", Message: "functions used in the DO UPDATE SET clause of INSERTs on distributed tables must be marked IMMUTABLE"}), "docs/SCALING.md")
	require.Contains(t, Explain(&pgconn.PgError{Code: "3F000", Message: `schema "rl" does not exist`}), "rl-migrate up")
	// Each code Explain names a fix for, and one it does not.
	for code, fix := range map[string]string{
		"28P01": "check the user and password", "28000": "check the user and password",
		"3D000": "create the database first", "57014": "raise --statement-timeout",
		"25006": "read-only standby", "42501": "lacks a privilege", "40001": "(SQLSTATE 40001)",
	} {
		require.Contains(t, Explain(&pgconn.PgError{Code: code, Message: "m"}), fix, code)
	}
	// 0A000 during recovery is a standby's refusal, as 25006 is.
	require.Contains(t, Explain(&pgconn.PgError{Code: "0A000", Message: "cannot execute INSERT during recovery"}), "read-only standby")
	// A permission error names its grant: Explain keeps its words.
	denied := pgerr.Denied(&pgconn.PgError{Code: "42501", Message: "permission denied for schema rl"}, pgerr.Need{})
	require.Equal(t, "wrapped: "+denied.Error(), Explain(fmt.Errorf("wrapped: %w", denied)))

	// A refused connection: one line, each attempt once.
	cfg, err := pgx.ParseConfig("postgres://u:hunter2@127.0.0.1:1/db?connect_timeout=5")
	require.NoError(t, err)
	_, err = pgx.ConnectConfig(context.Background(), cfg)
	require.Error(t, err)
	msg := Explain(err)
	require.NotContains(t, msg, "\n")
	require.NotContains(t, msg, "hunter2")
	require.True(t, strings.HasPrefix(msg, "cannot reach the database: "), msg)
	require.Equal(t, 1, strings.Count(msg, "connection refused"), msg)

	require.Equal(t, "plain", Explain(errors.New("plain")))
	require.Empty(t, Explain(nil))
}

func TestPrintJSON(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, PrintJSON(&b, map[string]string{"error": "a <b>"}))
	require.Equal(t, "{\"error\":\"a <b>\"}\n", b.String())
}
