// Package clientip finds the address of the client that sent an HTTP
// request, in a way the client cannot forge.
//
// By default the answer is the socket's peer address (http.Request's
// RemoteAddr): the only address the client cannot choose. Behind a reverse
// proxy or a load balancer that address is the proxy's, and the client's is
// in a header the proxy adds (X-Forwarded-For, Forwarded or X-Real-IP). Such
// a header is read only when the request arrived from a trusted proxy, and
// then from the right: every proxy appends the address it received the
// request from, so the right-most address that is not a trusted proxy is the
// first one written by a machine you trust about a machine you do not. Every
// address to its left was written by the client, or by proxies you do not
// know, and may be anything.
//
// Malformed headers (garbage, a header of megabytes, an address that does
// not parse where one is needed) never panic: the answer falls back to the
// socket address.
//
// See docs/HTTP.md for why both "take the left-most address" and "take the
// right-most address" are wrong without a list of trusted proxies.
package clientip

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// Header names a Resolver understands.
const (
	// XForwardedFor is the de facto standard list of addresses, one appended
	// by each proxy: "client, proxy1, proxy2". Entries may carry a port.
	XForwardedFor = "X-Forwarded-For"
	// Forwarded is RFC 7239's header: elements separated by commas, each a
	// list of name=value pairs, of which "for" names the node the proxy
	// received the request from: for=192.0.2.60, for="[2001:db8::1]:4711".
	Forwarded = "Forwarded"
	// XRealIP is a single address set by a proxy (nginx's convention).
	XRealIP = "X-Real-IP"
)

// DefaultMaxHeaderBytes is the most bytes of a header a Resolver reads when
// Resolver.MaxHeaderBytes is zero.
const DefaultMaxHeaderBytes = 8 << 10

// Resolver finds a request's client address. The zero value trusts no proxy
// and answers the socket address. A Resolver is safe for concurrent use; do
// not change its fields while it is in use.
type Resolver struct {
	// TrustedProxies are the networks of the proxies in front of the
	// application (load balancers, reverse proxies, a CDN's ranges).
	// Headers are read only for requests whose socket address is in one of
	// them, and proxies in them are skipped when reading a header from the
	// right. IPv4-mapped IPv6 prefixes (::ffff:10.0.0.0/104) are treated as
	// the IPv4 prefix they map. Defaults to none: headers are ignored.
	TrustedProxies []netip.Prefix

	// Headers names the header the trusted proxies set, such as
	// X-Forwarded-For, Forwarded or X-Real-IP. When several are listed, the
	// first one present in the request is read, so list only headers that
	// every trusted proxy sets or strips: a header your proxy passes through
	// untouched is written by the client. Defaults to X-Forwarded-For.
	Headers []string

	// IPv6Prefix, when between 1 and 127, masks IPv6 client addresses to
	// that many leading bits (64 groups a host's /64, the smallest block an
	// ISP usually assigns, so that one host cannot rotate through its
	// addresses to escape a limit). IPv4 addresses are never masked.
	// Defaults to 0: IPv6 addresses are used whole.
	IPv6Prefix int

	// MaxHeaderBytes caps how many bytes of the header are read, counted
	// from its right end (the trusted end). When the trusted proxies'
	// entries are not found within it, the socket address is the answer.
	// Defaults to DefaultMaxHeaderBytes (8 KiB).
	MaxHeaderBytes int
}

// Config is the textual form of a Resolver's settings, as read from flags
// or a configuration file; New parses and validates it.
type Config struct {
	// TrustedProxies lists trusted proxies as CIDRs ("10.0.0.0/8",
	// "2001:db8::/32") or single addresses ("192.0.2.7"). Defaults to none.
	TrustedProxies []string

	// Headers is Resolver.Headers: the header(s) the trusted proxies set.
	// Defaults to X-Forwarded-For.
	Headers []string

	// IPv6Prefix is Resolver.IPv6Prefix: 0 (no masking) or 1 to 127; New
	// refuses any other value, 128 included (a /128 masks nothing: use 0).
	// Defaults to 0.
	IPv6Prefix int

	// MaxHeaderBytes is Resolver.MaxHeaderBytes. Defaults to 8 KiB.
	MaxHeaderBytes int
}

// ErrInvalidConfig is wrapped by every error New returns.
var ErrInvalidConfig = errors.New("clientip: invalid configuration")

// New validates cfg and returns the Resolver it describes.
func New(cfg Config) (*Resolver, error) {
	r := &Resolver{IPv6Prefix: cfg.IPv6Prefix, MaxHeaderBytes: cfg.MaxHeaderBytes}
	for _, s := range cfg.TrustedProxies {
		p, err := ParsePrefix(s)
		if err != nil {
			return nil, err
		}
		r.TrustedProxies = append(r.TrustedProxies, p)
	}
	for _, h := range cfg.Headers {
		switch http.CanonicalHeaderKey(strings.TrimSpace(h)) {
		case XForwardedFor, Forwarded, http.CanonicalHeaderKey(XRealIP):
			r.Headers = append(r.Headers, strings.TrimSpace(h))
		default:
			return nil, fmt.Errorf("%w: header %q; use %s, %s or %s", ErrInvalidConfig, h, XForwardedFor, Forwarded, XRealIP)
		}
	}
	if cfg.IPv6Prefix < 0 || cfg.IPv6Prefix > 127 {
		// 128 would mask nothing: it is what 0 already means.
		return nil, fmt.Errorf("%w: IPv6 prefix %d; use 0 (no grouping) or a length from 1 to 127, such as 64", ErrInvalidConfig, cfg.IPv6Prefix)
	}
	if cfg.MaxHeaderBytes < 0 {
		return nil, fmt.Errorf("%w: max header bytes %d; use a positive size, or 0 for %d", ErrInvalidConfig, cfg.MaxHeaderBytes, DefaultMaxHeaderBytes)
	}
	return r, nil
}

// ParsePrefix parses a trusted proxy given as a CIDR or a single address
// (which becomes a /32 or /128), with an error that names the fix.
func ParsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%w: trusted proxy %q is not a CIDR such as 10.0.0.0/8 or 2001:db8::/32 (%v)", ErrInvalidConfig, s, err)
		}
		if p.Addr().Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("%w: trusted proxy %q has a zone; leave it out", ErrInvalidConfig, s)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%w: trusted proxy %q is neither a CIDR (10.0.0.0/8) nor an address (192.0.2.7)", ErrInvalidConfig, s)
	}
	a = a.WithZone("")
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// ParsePrefixes parses a comma-separated list of trusted proxies, as a flag
// would hold it ("10.0.0.0/8, 192.168.0.0/16"). Empty entries are ignored.
func ParsePrefixes(list string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range strings.Split(list, ",") {
		if strings.TrimSpace(s) == "" {
			continue
		}
		p, err := ParsePrefix(s)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// ClientIP returns the client's address: the socket address unless the
// request came from a trusted proxy, else the right-most address of the
// configured header that is not a trusted proxy. IPv4-mapped IPv6 addresses
// are unmapped, zones are dropped and IPv6 addresses are masked to
// IPv6Prefix. It returns the zero netip.Addr only when the socket address
// itself is not an IP address (a Unix socket, a hand-built request).
func (r *Resolver) ClientIP(req *http.Request) netip.Addr {
	socket, ok := parseHost(req.RemoteAddr)
	if !ok {
		return netip.Addr{}
	}
	socket = normalize(socket)
	if r == nil || !r.trusted(socket) {
		return r.mask(socket)
	}
	if a, ok := r.fromHeader(req.Header); ok {
		return r.mask(a)
	}
	return r.mask(socket)
}

// trusted reports whether a (normalised) address is a trusted proxy.
func (r *Resolver) trusted(a netip.Addr) bool {
	for _, p := range r.TrustedProxies {
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		if p.Contains(a) {
			return true
		}
	}
	return false
}

func (r *Resolver) mask(a netip.Addr) netip.Addr {
	if r == nil || !a.Is6() || r.IPv6Prefix <= 0 || r.IPv6Prefix >= 128 {
		return a
	}
	p, err := a.Prefix(r.IPv6Prefix)
	if err != nil {
		return a
	}
	return p.Addr()
}

// fromHeader reads the first configured header present in h from the right
// and returns the right-most address that is not a trusted proxy. It
// reports false when there is none, or when it meets an entry it cannot
// read before finding it.
func (r *Resolver) fromHeader(h http.Header) (netip.Addr, bool) {
	names := r.Headers
	if len(names) == 0 {
		names = []string{XForwardedFor}
	}
	for _, name := range names {
		values := h.Values(name)
		if len(values) == 0 {
			continue
		}
		forwarded := http.CanonicalHeaderKey(name) == Forwarded
		budget := r.MaxHeaderBytes
		if budget <= 0 {
			budget = DefaultMaxHeaderBytes
		}
		// Several header lines form one list, in order (RFC 9110, 5.3):
		// walk them from the last.
		for i := len(values) - 1; i >= 0; i-- {
			v := values[i]
			for len(v) > 0 {
				var elem string
				if forwarded {
					elem, v = lastForwardedElement(v)
				} else {
					elem, v = lastListElement(v)
				}
				budget -= len(elem) + 1
				if budget < 0 {
					return netip.Addr{}, false
				}
				elem = strings.TrimSpace(elem)
				if elem == "" {
					// Empty list members are allowed and carry nothing.
					continue
				}
				if forwarded {
					var ok bool
					if elem, ok = forwardedFor(elem); !ok {
						return netip.Addr{}, false
					}
				}
				a, ok := parseNode(elem)
				if !ok {
					return netip.Addr{}, false
				}
				a = normalize(a)
				if !r.trusted(a) {
					return a, true
				}
			}
		}
		// Only trusted proxies in the chosen header: the socket answers.
		return netip.Addr{}, false
	}
	return netip.Addr{}, false
}

// lastListElement splits s at its last comma.
func lastListElement(s string) (elem, rest string) {
	i := strings.LastIndexByte(s, ',')
	if i < 0 {
		return s, ""
	}
	return s[i+1:], s[:i]
}

// lastForwardedElement splits a Forwarded header value at its last comma
// that is outside a quoted string.
func lastForwardedElement(s string) (elem, rest string) {
	inQuote := false
	for i := len(s) - 1; i >= 0; i-- {
		switch s[i] {
		case '"':
			// A quote preceded by an odd number of backslashes is escaped.
			n := 0
			for j := i - 1; j >= 0 && s[j] == '\\'; j-- {
				n++
			}
			if n%2 == 0 {
				inQuote = !inQuote
			}
		case ',':
			if !inQuote {
				return s[i+1:], s[:i]
			}
		}
	}
	return s, ""
}

// forwardedFor returns the value of the "for" parameter of one Forwarded
// element (such as `for="[2001:db8::1]:4711";proto=https`), unquoted. It
// reports false when the element has none or is malformed.
func forwardedFor(elem string) (string, bool) {
	for len(elem) > 0 {
		// One pair: token "=" ( token / quoted-string ).
		eq := strings.IndexByte(elem, '=')
		if eq < 0 {
			return "", false
		}
		name := strings.TrimSpace(elem[:eq])
		elem = strings.TrimLeft(elem[eq+1:], " \t")
		var value string
		if strings.HasPrefix(elem, `"`) {
			var b strings.Builder
			i, closed := 1, false
			for ; i < len(elem); i++ {
				c := elem[i]
				if c == '\\' && i+1 < len(elem) {
					i++
					b.WriteByte(elem[i])
					continue
				}
				if c == '"' {
					closed = true
					i++
					break
				}
				b.WriteByte(c)
			}
			if !closed {
				return "", false
			}
			value, elem = b.String(), elem[i:]
			elem = strings.TrimLeft(elem, " \t")
			if elem != "" && elem[0] != ';' {
				return "", false
			}
		} else {
			end := strings.IndexByte(elem, ';')
			if end < 0 {
				end = len(elem)
			}
			value, elem = strings.TrimSpace(elem[:end]), elem[end:]
			if strings.ContainsAny(value, "\" \t") {
				return "", false
			}
		}
		elem = strings.TrimPrefix(elem, ";")
		if strings.EqualFold(name, "for") {
			return value, true
		}
	}
	return "", false
}

// parseNode parses one hop: an IPv4 or IPv6 address, optionally with a
// port ("192.0.2.1:80", "[2001:db8::1]:443") or in brackets ("[::1]").
// Obfuscated identifiers ("_hidden") and "unknown" are not addresses.
func parseNode(s string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(s); err == nil {
		return a, true
	}
	if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") {
		a, err := netip.ParseAddr(s[1 : len(s)-1])
		return a, err == nil && a.Is6()
	}
	return parseHost(s)
}

// parseHost parses "host:port" where host is an IP address.
func parseHost(s string) (netip.Addr, bool) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr(), true
	}
	host, _, err := net.SplitHostPort(s)
	if err != nil {
		return netip.Addr{}, false
	}
	a, err := netip.ParseAddr(host)
	return a, err == nil
}

// normalize unmaps IPv4-mapped IPv6 addresses and drops zones.
func normalize(a netip.Addr) netip.Addr {
	return a.Unmap().WithZone("")
}
