package main

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// The application mix ("--mix app") loads both sides as the example
// application's traffic would (examples/app/limits.go): nine limits, keys
// drawn from users and client addresses with a Zipf skew, and endpoints
// that run one check each, except the login, which runs three as one
// decision.

// mixApp is the name of the application mix, as --mix takes it.
const mixApp = "app"

// The populations the mix draws its keys from, and its skew: the key of
// rank k is drawn with a probability proportional to (k+1)^-mixZipfS, so a
// few users and addresses make most of the traffic.
const (
	mixUsers = 10_000
	mixIPs   = 2_000
	mixZipfS = 1.1
	// mixSeed seeds the draw of the requests: every run replays the same
	// ones.
	mixSeed = 1
	// mixRequests is how many requests are drawn before the run
	// (--mix-requests). The
	// callers pick among them uniformly (loadtest's key numbers), so the
	// checks follow the draw's skew without a random draw, or a key to
	// format, on the measured path.
	mixRequests = 1 << 16
)

// The limits of the application's policy table, in its order.
const (
	limLoginEmailIP = iota
	limLoginIP
	limLoginEmail
	limContact
	limConfirmation
	limAdminWrites
	limUploads
	limPublicAPI
	limBeacon
	numMixLimits
)

// The policy table's limits (5 a minute, 3 a day...) would deny most checks
// of a hot key within the first second, and a denial costs the two sides
// different work (pgrl may answer it from its deny cache, AllowAll rolls
// the login back), so both sides keep each limit's rate and period and
// raise its burst to mixBurst: every check is admitted, and no key's state
// expires during a run (redis_rate's TTL, the time until the bucket is full
// again, only grows). The nine limiters stay distinct, which is what the
// mix is about: nine limiters with their own rows and their own coalescing
// queues on one pool.
//
// pgrl refuses a bucket that takes more than 1,000 years to refill, which
// 1e9 units at 3 a day would; the confirmation limit's burst is 1e6 (about
// 900 years), which a hot recipient takes hours of measured load to spend.
const (
	mixBurst             = 1_000_000_000
	mixConfirmationBurst = 1_000_000
)

// mixLimit is one limit of the application's policy table.
type mixLimit struct {
	name   string
	rate   int64 // units per period
	period time.Duration
	burst  int64
	// memory: pgrl keeps the limit in each process's memory (the beacon);
	// redis_rate, which has no such store, keeps it in Redis as it keeps
	// everything.
	memory bool
}

// appLimits is the policy table of examples/app/limits.go.
var appLimits = [numMixLimits]mixLimit{
	limLoginEmailIP: {"login-email-ip", 5, time.Minute, mixBurst, false},
	limLoginIP:      {"login-ip", 20, time.Minute, mixBurst, false},
	limLoginEmail:   {"login-email", 50, 15 * time.Minute, mixBurst, false},
	limContact:      {"contact", 5, time.Minute, mixBurst, false},
	limConfirmation: {"confirmation-email", 3, 24 * time.Hour, mixConfirmationBurst, false},
	limAdminWrites:  {"admin-writes", 30, time.Minute, mixBurst, false},
	limUploads:      {"uploads", 10, time.Minute, mixBurst, false},
	limPublicAPI:    {"public-api", 120, time.Minute, mixBurst, false},
	limBeacon:       {"beacon", 60, time.Minute, mixBurst, true},
}

// endpoint is one kind of request of the mix, with its share of the
// requests and the limits it checks.
type endpoint struct {
	name   string
	weight int // share of the requests, in percent
	limits []int
	// key draws the keys of its checks, one per limit, in the order of
	// limits.
	key func(d *drawer) []string
}

// appEndpoints are the application's endpoints and their shares of the
// requests (they add up to 100). The keys are those of the example
// application: a login is keyed by email and address, by address and by
// email; the contact form and the beacon by address; confirmation emails
// by recipient; admin writes and uploads by the signed-in user; the public
// API by the caller's API key.
var appEndpoints = []endpoint{
	{"public-api", 50, []int{limPublicAPI}, func(d *drawer) []string { return []string{"key:" + d.user()} }},
	{"beacon", 20, []int{limBeacon}, func(d *drawer) []string { return []string{d.ip()} }},
	{"login", 10, []int{limLoginEmailIP, limLoginIP, limLoginEmail}, func(d *drawer) []string {
		email, ip := d.email(), d.ip()
		return []string{loginPairKey(email, ip), ip, email}
	}},
	{"contact", 5, []int{limContact}, func(d *drawer) []string { return []string{d.ip()} }},
	{"uploads", 5, []int{limUploads}, func(d *drawer) []string { return []string{"user:" + d.user()} }},
	{"admin-writes", 5, []int{limAdminWrites}, func(d *drawer) []string { return []string{d.user()} }},
	{"confirmation", 5, []int{limConfirmation}, func(d *drawer) []string { return []string{d.email()} }},
}

// loginPairKey is the key of the per email and address limit, framed as
// httplimit.Combine frames its parts.
func loginPairKey(email, ip string) string {
	return strconv.Itoa(len(email)) + ":" + email + strconv.Itoa(len(ip)) + ":" + ip
}

// drawer draws the endpoints and keys of the requests, deterministically
// from its seed.
type drawer struct {
	rng         *rand.Rand
	users, ips  *rand.Zipf
	totalWeight int
}

func newDrawer(seed uint64) *drawer {
	rng := rand.New(rand.NewPCG(seed, 0x6d6978)) // "mix"
	d := &drawer{
		rng:   rng,
		users: rand.NewZipf(rng, mixZipfS, 1, mixUsers-1),
		ips:   rand.NewZipf(rng, mixZipfS, 1, mixIPs-1),
	}
	for _, e := range appEndpoints {
		d.totalWeight += e.weight
	}
	return d
}

// endpoint draws an endpoint with the weights of appEndpoints.
func (d *drawer) endpoint() int {
	return pickWeighted(d.rng.IntN(d.totalWeight))
}

// pickWeighted maps u, 0 <= u < the sum of the weights, to the endpoint
// whose share of that range it falls in.
func pickWeighted(u int) int {
	for i, e := range appEndpoints {
		if u < e.weight {
			return i
		}
		u -= e.weight
	}
	panic(fmt.Sprintf("pickWeighted: %d is past the sum of the weights", u))
}

// userRank and ipRank draw the rank (0 is the busiest) of a user and an
// address.
func (d *drawer) userRank() int { return int(d.users.Uint64()) }
func (d *drawer) ipRank() int   { return int(d.ips.Uint64()) }

func (d *drawer) user() string  { return userName(d.userRank()) }
func (d *drawer) email() string { return userEmail(d.userRank()) }
func (d *drawer) ip() string    { return ipAddr(d.ipRank()) }

func userName(u int) string  { return "u" + strconv.Itoa(u) }
func userEmail(u int) string { return "user" + strconv.Itoa(u) + "@example.com" }

// ipAddr is address number i in 10.0.0.0/8.
func ipAddr(i int) string {
	return fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
}

// mixCheck is one check of a request: a limit and a key, with the key
// redis_rate sees (prefixed with the limit's name, so that the nine limits
// keep apart in Redis as pgrl's limiter names keep them apart in its
// tables).
type mixCheck struct {
	limit    int
	key      string
	redisKey string
}

// request is one request of the mix: an endpoint and its checks.
type request struct {
	endpoint int
	checks   []mixCheck
}

// appMix is the drawn requests of an application mix.
type appMix struct {
	requests []request
	// touch holds every distinct limit and key of the requests once, in
	// the order first drawn: populate touches them before the cases.
	touch []mixCheck
}

// newAppMix draws n requests from seed.
func newAppMix(seed uint64, n int) *appMix {
	d := newDrawer(seed)
	m := &appMix{requests: make([]request, n)}
	seen := map[[2]string]bool{}
	for i := range m.requests {
		e := d.endpoint()
		ep := appEndpoints[e]
		keys := ep.key(d)
		r := request{endpoint: e, checks: make([]mixCheck, len(ep.limits))}
		for j, lim := range ep.limits {
			c := mixCheck{limit: lim, key: keys[j], redisKey: appLimits[lim].name + ":" + keys[j]}
			r.checks[j] = c
			if id := [2]string{appLimits[lim].name, c.key}; !seen[id] {
				seen[id] = true
				m.touch = append(m.touch, c)
			}
		}
		m.requests[i] = r
	}
	return m
}

// endpointCounts counts the requests of each endpoint.
func (m *appMix) endpointCounts() []int {
	n := make([]int, len(appEndpoints))
	for _, r := range m.requests {
		n[r.endpoint]++
	}
	return n
}

// mixDescription describes the application mix in the report.
func mixDescription(requests int) *MixInfo {
	info := &MixInfo{
		Name: mixApp, Users: mixUsers, IPs: mixIPs, ZipfS: mixZipfS, Seed: mixSeed, Requests: requests,
		Beacon: "pgrl in process memory (as the example application), redis_rate in Redis",
	}
	for _, l := range appLimits {
		info.Limits = append(info.Limits, MixLimit{Name: l.name, Rate: l.rate, Period: l.period.String(), Burst: l.burst, Memory: l.memory})
	}
	for _, e := range appEndpoints {
		var names []string
		for _, l := range e.limits {
			names = append(names, appLimits[l].name)
		}
		info.Endpoints = append(info.Endpoints, MixEndpoint{Name: e.name, WeightPct: e.weight, Limits: names})
	}
	return info
}

// endpointSummary is "public-api 50%, beacon 20%, ..." for the text report.
func (m *MixInfo) endpointSummary() string {
	var parts []string
	for _, e := range m.Endpoints {
		parts = append(parts, fmt.Sprintf("%s %d%%", e.Name, e.WeightPct))
	}
	return strings.Join(parts, ", ")
}
