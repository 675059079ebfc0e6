package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--trusted-proxies", "10.0.0.0/8,lb.internal"}, `trusted proxy "lb.internal"`},
		{[]string{"--ipv6-prefix", "200"}, "IPv6 prefix 200"},
		{[]string{"--no-such-flag"}, "flag provided but not defined"},
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"--schema", ""}, "--schema"},
		{[]string{"--schema", strings.Repeat("s", 64)}, "1 to 63 bytes"},
	} {
		var stderr strings.Builder
		if code := run(context.Background(), c.args, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2", c.args, code)
		}
		if !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: stderr %q lacks %q", c.args, stderr.String(), c.want)
		}
	}
}

func TestWithSearchPath(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, schema, want string }{
		{"postgres://u@h/d?sslmode=disable&search_path=myapp", "pgrl_example_app", "postgres://u@h/d?search_path=%22pgrl_example_app%22&sslmode=disable"},
		{"postgres://u@h/d", `My "S"`, "postgres://u@h/d?search_path=%22My%20%22%22S%22%22%22"},
		{"host=h dbname=d", "it's", `host=h dbname=d search_path='"it\'s"'`},
	} {
		got, err := withSearchPath(c.in, c.schema)
		if err != nil || got != c.want {
			t.Errorf("withSearchPath(%q, %q) = %q, %v; want %q", c.in, c.schema, got, err, c.want)
			continue
		}
		cfg, err := pgx.ParseConfig(got)
		if err != nil || cfg.RuntimeParams["search_path"] != (pgx.Identifier{c.schema}).Sanitize() {
			t.Errorf("%q parses to search_path %q, %v", got, cfg.RuntimeParams["search_path"], err)
		}
	}
}

func TestKeys(t *testing.T) {
	t.Parallel()
	form := func(v url.Values) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/login", strings.NewReader(v.Encode()))
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		return r
	}
	if k, ok := emailKey(form(url.Values{"email": {"  Ann@Example.COM "}})); !ok || k != "ann@example.com" {
		t.Errorf("emailKey = %q, %v", k, ok)
	}
	if _, ok := emailKey(form(url.Values{"password": {"x"}})); ok {
		t.Error("emailKey without an email should skip")
	}
	big := form(url.Values{"email": {"a@b.c"}, "pad": {strings.Repeat("x", maxFormBytes)}})
	if _, ok := emailKey(big); ok {
		t.Error("emailKey read a form larger than maxFormBytes")
	}

	byIP := func(*http.Request) (string, bool) { return "192.0.2.1", true }
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	if k, _ := apiKeyOrIP(byIP)(r); k != "ip:192.0.2.1" {
		t.Errorf("anonymous API key = %q", k)
	}
	r.Header.Set("X-API-Key", "192.0.2.1")
	if k, _ := apiKeyOrIP(byIP)(r); k != "key:192.0.2.1" {
		t.Errorf("keyed API key = %q (must differ from the address's key)", k)
	}
	if _, ok := adminUser(r); ok {
		t.Error("adminUser without Authorization should skip")
	}
	r.Header.Set("Authorization", "Bearer tok")
	if k, _ := userOrIP(byIP)(r); k != "user:tok" {
		t.Errorf("upload key = %q", k)
	}
}
