package notmigrated

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestErrorIsErrAndNamesTheLocation(t *testing.T) {
	e := &Error{Location: Location{Database: "app", User: "app", Schema: "public", SearchPath: `"$user", public`}}
	var err error = fmt.Errorf("clean: %w", e)
	if !errors.Is(err, Err) {
		t.Fatal("errors.Is(*Error, Err) is false")
	}
	for _, want := range []string{`pgrl's tables are missing in schema "public" of database "app" (user "app")`, "rl-migrate up --schema public"} {
		if !strings.Contains(e.Error(), want) {
			t.Errorf("%q lacks %q", e.Error(), want)
		}
	}
	e.NoURL = true
	if !strings.Contains(e.Error(), "no database URL is configured") || strings.Contains(e.Error(), "rl-migrate up --schema") {
		t.Errorf("with NoURL: %q", e.Error())
	}
	e = &Error{Location: Location{Database: "app", User: "u", SearchPath: `"rl", public`}, Missing: []string{"pgrl_token_bucket"}}
	for _, want := range []string{`no schema of search_path "\"rl\", public" exists in database "app" (user "u")`, "(not found: pgrl_token_bucket)", "rl-migrate up --schema rl"} {
		if !strings.Contains(e.Error(), want) {
			t.Errorf("%q lacks %q", e.Error(), want)
		}
	}
}

// The schema the fix names is read from search_path as PostgreSQL reads
// it, and quoted for the shell when it needs to be.
func TestFixNamesTheFirstSchema(t *testing.T) {
	for path, want := range map[string]string{
		`"$user", public`:            "--schema public",
		` "$user" , App `:            "--schema app",
		`"Rate, ""Limits""", public`: `--schema 'Rate, "Limits"'`,
		`"it's", x`:                  `--schema 'it'\''s'`,
		`$user`:                      "--schema '<schema>'",
		`  "a b"  ,"c"`:              "--schema 'a b'",
	} {
		e := &Error{Location: Location{Database: "app", User: "u", SearchPath: path}}
		if !strings.Contains(e.Error(), "rl-migrate up "+want+"`") {
			t.Errorf("search_path %s: %q lacks %q", path, e.Error(), want)
		}
	}
}

func TestDefaultsOnly(t *testing.T) {
	for _, v := range connectionVars {
		t.Setenv(v, "")
	}
	if !DefaultsOnly("") {
		t.Error("no URL and no PG* variable: want defaults only")
	}
	if DefaultsOnly("postgres://db/app") {
		t.Error("a URL is a configuration")
	}
	t.Setenv("PGDATABASE", "app")
	if DefaultsOnly("") {
		t.Error("PGDATABASE set: not defaults only")
	}
}
