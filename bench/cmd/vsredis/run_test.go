package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/ratelimit"
)

func TestParseVariant(t *testing.T) {
	v, err := parseVariant("in-flight=1,batch=32")
	if err != nil {
		t.Fatal(err)
	}
	if v.maxInFlight != 1 || v.maxBatch != 32 || v.name != "pgrl_inflight1_batch32" {
		t.Fatalf("got %+v", v)
	}
	v, err = parseVariant("conns=8,coalescing=off")
	if err != nil || v.conns != 8 || !v.off || v.name != "pgrl_conns8_coalescingoff" {
		t.Fatalf("got %+v, %v", v, err)
	}
	for _, bad := range []string{"", "in-flight", "in-flight=0", "batch=x", "speed=4", "coalescing=maybe"} {
		if _, err := parseVariant(bad); err == nil {
			t.Errorf("parseVariant(%q): no error", bad)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--callers", "0"},
		{"--keys", "x"},
		{"--duration", "0s"},
		{"--output", "xml"},
		{"--variant", "speed=3"},
		{"--mix", "shop"},
		{"--mix-requests", "0"},
		{"--keys", "none", "--mix", "none"},
		{"extra"},
		{"--algorithm", "gcra"},
		{"--lease-size", "-1", "--algorithm", "fixed_window"},
		{"--lease-size", "10", "--lease-share", "0"},
		{"--lease-size", "10", "--lease-idle", "0s"},
	} {
		var stderr bytes.Buffer
		if code := run(context.Background(), args, &bytes.Buffer{}, &stderr); code != cli.ExitUsage {
			t.Errorf("%v: exit %d, want %d (%s)", args, code, cli.ExitUsage, stderr.String())
		}
	}
}

func TestLeaseFlags(t *testing.T) {
	o, err := parseFlags([]string{"--lease-size", "100", "--algorithm", "sliding_window"}, &bytes.Buffer{})
	if err != nil || o.leaseSize != 100 || o.algorithm != ratelimit.SlidingWindow {
		t.Fatalf("got %+v, %v", o, err)
	}
	o, err = parseFlags(nil, &bytes.Buffer{})
	if err != nil || o.leaseSize != 0 || o.algorithm != ratelimit.TokenBucket {
		t.Fatalf("defaults: got lease size %d, algorithm %q, %v; want no leases and the token bucket", o.leaseSize, o.algorithm, err)
	}
	o, err = parseFlags([]string{"--lease-size", "10"}, &bytes.Buffer{})
	if err != nil || o.leaseSize != 10 || o.algorithm != ratelimit.TokenBucket || o.leaseShare != 1 || o.leaseIdle != time.Minute {
		t.Fatalf("a leased token bucket: got %+v, %v", o, err)
	}
	leased, unleased := leasedMixLimits()
	if strings.Join(leased, ",") != "login-email-ip,login-ip,login-email,contact,confirmation-email,admin-writes,uploads,public-api" || len(unleased) != 1 {
		t.Errorf("leased %v, unleased %v: want every limit PostgreSQL keeps leased (the login's three with lease.AllowAll), the beacon not", leased, unleased)
	}
}

func TestTargets(t *testing.T) {
	cases := []Case{
		{Callers: 8, Keys: 100_000, Ratio: 0.49},
		{Callers: 32, Keys: 100_000, Ratio: 1.0},
		{Callers: 64, Keys: 1, Ratio: 0.3}, // hot key: no target
		{Callers: 1, Keys: 100_000, Ratio: 0.3},
	}
	ok, misses := defaultTargets.check(cases)
	if ok || len(misses) != 1 || !strings.HasPrefix(misses[0], "8 callers") {
		t.Fatalf("check: %v %v", ok, misses)
	}
	if !defaultTargets.apply(cases) || defaultTargets.apply(cases[2:]) {
		t.Fatal("apply: want a target for 8 callers over 100,000 keys, none for 64 over 1 or 1 over 100,000")
	}
	if got := defaultTargets.callerList(); got != "8, 32 and 64" {
		t.Fatalf("callerList: %q", got)
	}
	// A run with no case of the targets' size says so rather than that
	// they were met.
	var out strings.Builder
	if err := printText(&out, Report{Cases: cases[2:3], Targets: defaultTargets, TargetsMet: true}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "no targets apply (they are for 100000 keys or more at 8, 32 and 64 callers)") {
		t.Fatalf("text report:\n%s", out.String())
	}
}

func TestInfoField(t *testing.T) {
	info := "# Server\r\nredis_version:7.0.15\r\nused_cpu_sys:1.5\r\n"
	if got := infoField(info, "redis_version"); got != "7.0.15" {
		t.Fatalf("got %q", got)
	}
	if got := infoField(info, "missing"); got != "" {
		t.Fatalf("got %q", got)
	}
}
