package clientip_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/pgrl/pgrl/clientip"
)

func mustResolver(t *testing.T, cfg clientip.Config) *clientip.Resolver {
	t.Helper()
	r, err := clientip.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestClientIP(t *testing.T) {
	t.Parallel()
	// Proxies: a load balancer in 10.0.0.0/8 and a CDN edge in
	// 2001:db8:cdn::/48 and 198.51.100.0/24.
	trusted := []string{"10.0.0.0/8", "198.51.100.0/24", "2001:db8:cd00::/40"}
	xff := mustResolver(t, clientip.Config{TrustedProxies: trusted})
	fwd := mustResolver(t, clientip.Config{TrustedProxies: trusted, Headers: []string{"Forwarded"}})
	realIP := mustResolver(t, clientip.Config{TrustedProxies: trusted, Headers: []string{"X-Real-IP"}})
	group64 := mustResolver(t, clientip.Config{TrustedProxies: trusted, IPv6Prefix: 64})
	none := &clientip.Resolver{}
	mapped := mustResolver(t, clientip.Config{TrustedProxies: []string{"::ffff:10.0.0.0/104"}})
	small := mustResolver(t, clientip.Config{TrustedProxies: trusted, MaxHeaderBytes: 64})

	huge := strings.Repeat("6.6.6.6, ", 64<<10/9) // 64 KiB of client-written entries
	hugeNoComma := strings.Repeat("x", 64<<10)

	cases := []struct {
		name    string
		r       *clientip.Resolver
		remote  string
		headers [][2]string
		want    string // "" means the zero Addr
	}{
		{"no header: socket address", xff, "203.0.113.7:5000", nil, "203.0.113.7"},
		{"spoofed XFF, no trusted proxy configured", none, "203.0.113.7:5000",
			[][2]string{{"X-Forwarded-For", "1.2.3.4"}}, "203.0.113.7"},
		{"spoofed XFF from an untrusted peer", xff, "203.0.113.7:5000",
			[][2]string{{"X-Forwarded-For", "1.2.3.4, 10.0.0.1"}}, "203.0.113.7"},
		{"one trusted proxy", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "203.0.113.7"}}, "203.0.113.7"},
		{"one trusted proxy, client prepended a lie", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "1.2.3.4, 203.0.113.7"}}, "203.0.113.7"},
		{"two trusted proxies", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "203.0.113.7, 198.51.100.9"}}, "203.0.113.7"},
		{"two trusted proxies, client prepended lies", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "10.9.9.9, 1.2.3.4, 203.0.113.7, 198.51.100.9"}}, "203.0.113.7"},
		{"client claims to be a trusted proxy, nothing after it", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "10.0.0.5"}}, "10.0.0.1"},
		{"multiple XFF header lines form one list", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "1.2.3.4"}, {"X-Forwarded-For", "203.0.113.7, 198.51.100.9"}}, "203.0.113.7"},
		{"multiple XFF lines, client's is the last untrusted", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "1.2.3.4, 203.0.113.8"}, {"X-Forwarded-For", "198.51.100.9"}}, "203.0.113.8"},
		{"empty XFF", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", ""}}, "10.0.0.1"},
		{"empty members are skipped", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", " , 203.0.113.7,, "}}, "203.0.113.7"},
		{"garbage right of the client falls back to the socket", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "203.0.113.7, not-an-ip"}}, "10.0.0.1"},
		{"garbage left of the client is never read", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "<script>, ::::, 999.1.1.1, 203.0.113.7"}}, "203.0.113.7"},
		{"IPv4 with port in XFF", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "203.0.113.7:51234"}}, "203.0.113.7"},
		{"IPv6 in brackets with port in XFF", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "[2001:DB8:0:0::1]:4711"}}, "2001:db8::1"},
		{"IPv6 in brackets without port", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "[2001:db8::1]"}}, "2001:db8::1"},
		{"IPv6 written long is normalised", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "2001:0db8:0000:0000:0000:0000:0000:0001"}}, "2001:db8::1"},
		{"IPv4-mapped IPv6 socket address is unmapped", xff, "[::ffff:203.0.113.7]:5000", nil, "203.0.113.7"},
		{"IPv4-mapped IPv6 trusted proxy socket", xff, "[::ffff:10.0.0.1]:5000",
			[][2]string{{"X-Forwarded-For", "::ffff:203.0.113.7"}}, "203.0.113.7"},
		{"IPv4-mapped trusted prefix matches IPv4 proxy", mapped, "10.1.2.3:5000",
			[][2]string{{"X-Forwarded-For", "203.0.113.7"}}, "203.0.113.7"},
		{"IPv6 zone is dropped", xff, "[fe80::1%eth0]:5000", nil, "fe80::1"},
		{"IPv6 grouped by /64", group64, "[2001:db8:1:2:a:b:c:d]:5000", nil, "2001:db8:1:2::"},
		{"IPv6 via trusted IPv6 proxy, grouped by /64", group64, "[2001:db8:cd00::5]:443",
			[][2]string{{"X-Forwarded-For", "2001:db8:1:2:a:b:c:d, 2001:db8:cd01::9"}}, "2001:db8:1:2::"},
		{"IPv4 is never grouped", group64, "203.0.113.7:5000", nil, "203.0.113.7"},
		{"64 KiB XFF from an untrusted peer", xff, "203.0.113.7:5000",
			[][2]string{{"X-Forwarded-For", huge}}, "203.0.113.7"},
		{"64 KiB XFF through a trusted proxy: right end still read", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", huge + "203.0.113.7"}}, "203.0.113.7"},
		{"64 KiB XFF of one token: socket", xff, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", hugeNoComma}}, "10.0.0.1"},
		{"trusted hops past the byte cap: socket", small, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "203.0.113.7" + strings.Repeat(", 10.0.0.2", 10)}}, "10.0.0.1"},
		{"XFF ignored when Forwarded is configured", fwd, "10.0.0.1:443",
			[][2]string{{"X-Forwarded-For", "1.2.3.4"}}, "10.0.0.1"},
		{"Forwarded, plain IPv4", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", "for=203.0.113.7;proto=https"}}, "203.0.113.7"},
		{"Forwarded, quoted IPv6 with port, case-insensitive name", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `For="[2001:db8::17]:4711"`}}, "2001:db8::17"},
		{"Forwarded, quoted IPv4 with port after other params", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `proto=https;host="example.com";for="203.0.113.7:80"`}}, "203.0.113.7"},
		{"Forwarded, chain with a spoofed element", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `for=1.2.3.4, for=203.0.113.7;by=10.0.0.1, for="198.51.100.9"`}}, "203.0.113.7"},
		{"Forwarded, comma inside a quoted value", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `for=203.0.113.7;host="a,b\",c"`}}, "203.0.113.7"},
		{"Forwarded, obfuscated identifier: socket", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `for=203.0.113.7, for=_hidden`}}, "10.0.0.1"},
		{"Forwarded, unknown: socket", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `for=unknown`}}, "10.0.0.1"},
		{"Forwarded, unterminated quote: socket", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `for="203.0.113.7`}}, "10.0.0.1"},
		{"Forwarded, element without for: socket", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `proto=https`}}, "10.0.0.1"},
		{"Forwarded, garbage: socket", fwd, "10.0.0.1:443",
			[][2]string{{"Forwarded", `;;==,"\`}}, "10.0.0.1"},
		{"X-Real-IP from a trusted proxy", realIP, "10.0.0.1:443",
			[][2]string{{"X-Real-IP", "203.0.113.7"}}, "203.0.113.7"},
		{"X-Real-IP from an untrusted peer", realIP, "203.0.113.7:5000",
			[][2]string{{"X-Real-IP", "1.2.3.4"}}, "203.0.113.7"},
		{"X-Real-IP garbage: socket", realIP, "10.0.0.1:443",
			[][2]string{{"X-Real-IP", "localhost"}}, "10.0.0.1"},
		{"socket address without port", xff, "203.0.113.7", nil, ""},
		{"Unix socket peer", xff, "@", nil, ""},
		{"empty RemoteAddr", xff, "", nil, ""},
	}
	if len(cases) < 25 {
		t.Fatalf("only %d cases", len(cases))
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := httptest.NewRequest(http.MethodGet, "/", nil)
			req.RemoteAddr = c.remote
			for _, h := range c.headers {
				req.Header.Add(h[0], h[1])
			}
			got := c.r.ClientIP(req)
			var want netip.Addr
			if c.want != "" {
				want = netip.MustParseAddr(c.want)
			}
			if got != want {
				t.Errorf("ClientIP = %v, want %v", got, want)
			}
		})
	}
}

func TestNilResolverUsesSocket(t *testing.T) {
	t.Parallel()
	var r *clientip.Resolver
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.RemoteAddr = "[::ffff:192.0.2.1]:80"
	req.Header.Set("X-Forwarded-For", "1.2.3.4")
	if got := r.ClientIP(req); got != netip.MustParseAddr("192.0.2.1") {
		t.Fatalf("got %v", got)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	cases := []struct {
		cfg  clientip.Config
		want string
	}{
		{clientip.Config{TrustedProxies: []string{"10.0.0.0/33"}}, `trusted proxy "10.0.0.0/33" is not a CIDR`},
		{clientip.Config{TrustedProxies: []string{"proxy.internal"}}, `trusted proxy "proxy.internal" is neither a CIDR`},
		{clientip.Config{TrustedProxies: []string{"fe80::/10%eth0"}}, `trusted proxy "fe80::/10%eth0"`},
		{clientip.Config{Headers: []string{"X-Client-IP"}}, `header "X-Client-IP"; use X-Forwarded-For, Forwarded or X-Real-IP`},
		{clientip.Config{IPv6Prefix: 129}, "IPv6 prefix 129"},
		{clientip.Config{IPv6Prefix: 128}, "IPv6 prefix 128; use 0 (no grouping) or a length from 1 to 127"},
		{clientip.Config{IPv6Prefix: -1}, "IPv6 prefix -1"},
		{clientip.Config{MaxHeaderBytes: -1}, "max header bytes -1"},
	}
	for _, c := range cases {
		_, err := clientip.New(c.cfg)
		if !errors.Is(err, clientip.ErrInvalidConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v) = %v, want an ErrInvalidConfig containing %q", c.cfg, err, c.want)
		}
	}
}

func TestParsePrefixes(t *testing.T) {
	t.Parallel()
	got, err := clientip.ParsePrefixes(" 10.0.0.0/8, 192.0.2.7,,2001:db8::1/32 ")
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"),
		netip.MustParsePrefix("192.0.2.7/32"),
		netip.MustParsePrefix("2001:db8::/32"), // masked
	}
	if len(got) != len(want) {
		t.Fatalf("got %v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("prefix %d = %v, want %v", i, got[i], want[i])
		}
	}
	if _, err := clientip.ParsePrefixes("10.0.0.0/8,bogus"); !errors.Is(err, clientip.ErrInvalidConfig) {
		t.Errorf("bogus entry: %v", err)
	}
}

func FuzzClientIP(f *testing.F) {
	f.Add("10.0.0.1:443", "203.0.113.7, 198.51.100.9", `for="[2001:db8::1]:80"`)
	f.Add("[::1]:1", `"\`, `for="\"`)
	r := mustResolverF(f)
	f.Fuzz(func(t *testing.T, remote, xff, fwd string) {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.RemoteAddr = remote
		req.Header.Set("X-Forwarded-For", xff)
		req.Header.Set("Forwarded", fwd)
		got := r.ClientIP(req)
		if got.IsValid() && (got.Zone() != "" || got.Is4In6()) {
			t.Fatalf("not normalised: %v", got)
		}
	})
}

func mustResolverF(f *testing.F) *clientip.Resolver {
	r, err := clientip.New(clientip.Config{TrustedProxies: []string{"10.0.0.0/8", "::1/128"}, Headers: []string{"Forwarded", "X-Forwarded-For"}})
	if err != nil {
		f.Fatal(err)
	}
	return r
}
