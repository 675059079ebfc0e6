package migration

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// opsFunctions are the functions of a migrated schema that no check calls:
// the partition layout's, which rl-migrate and rl-cleanup run as the
// migration role, the policy tables' triggers, which run as the table's
// writer, and pgrl_policy_key, which whoever writes overrides in SQL calls. Every other function is in appFunctions, so that Grant
// gives the application EXECUTE on it where PUBLIC has none.
var opsFunctions = []string{
	"pgrl_copy_privileges(regclass,regclass)",
	"pgrl_fixed_window_create_partitions(regclass,timestamp with time zone,timestamp with time zone,integer)",
	"pgrl_fixed_window_ensure_partitions(timestamp with time zone,timestamp with time zone)",
	"pgrl_fixed_window_partition_bounds(regclass)",
	"pgrl_fixed_window_partitions_needed(timestamp with time zone,timestamp with time zone,bigint)",
	"pgrl_fixed_window_set_layout(text,interval)",
	"pgrl_fixed_window_set_layout(text,interval,interval)",
	"pgrl_policy_override_columns()",
	"pgrl_policy_keep_key_mode()",
	"pgrl_policy_key(text,text)",
	"pgrl_policy_notify()",
	"pgrl_policy_override_check_key()",
	"pgrl_policy_override_flag()",
	"pgrl_policy_touch()",
}

// TestEveryFunctionGranted: each function the migrations create is either
// granted to the application by Grant or named in opsFunctions, so that a
// migration adding a function a check calls cannot leave it out of Grant
// (where PUBLIC's EXECUTE is revoked, the check would fail with 42501).
func TestEveryFunctionGranted(t *testing.T) {
	url := os.Getenv("PGRL_TEST_DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	schemaName := fmt.Sprintf("pgrl_test_functions_%d", time.Now().UnixNano())
	m, err := New(url, Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to the test database (PGRL_TEST_DATABASE_URL): %v", err)
	}
	defer conn.Close(context.Background())
	t.Cleanup(func() {
		_, _ = conn.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schemaName}.Sanitize()+" CASCADE")
	})
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	// regprocedure spells a signature as the catalog does; the listed
	// signatures are normalized the same way.
	var present []string
	if err := conn.QueryRow(ctx, `SELECT coalesce(array_agg(regexp_replace(p.oid::regprocedure::text, '[a-z0-9_"]+\.', '', 'g')), '{}')
  FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = $1`, schemaName).Scan(&present); err != nil {
		t.Fatal(err)
	}
	var granted []string
	for _, f := range appFunctions {
		var sig string
		qualified, _ := signature(schemaName, f)
		if err := conn.QueryRow(ctx, `SELECT regexp_replace(to_regprocedure($1)::text, '[a-z0-9_"]+\.', '', 'g')`,
			qualified).Scan(&sig); err != nil {
			t.Fatalf("appFunctions lists %s, which the migrated schema lacks: %v", f, err)
		}
		granted = append(granted, sig)
	}
	for _, f := range present {
		if !slices.Contains(granted, f) && !slices.Contains(opsFunctions, f) {
			t.Errorf("function %s is neither in appFunctions (granted to the application) nor in opsFunctions", f)
		}
	}
	for _, f := range opsFunctions {
		if !slices.Contains(present, f) {
			t.Errorf("opsFunctions lists %s, which the migrated schema lacks", f)
		}
	}
	if t.Failed() {
		t.Logf("present: %s", strings.Join(present, "\n"))
	}
}
