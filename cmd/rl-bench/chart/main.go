// Command chart draws rl-bench's JSON report as an SVG bar chart: ops/s of
// the raw statement and of the library call for every case, and the
// library/raw ratios of throughput and p50 latency against their targets.
//
//	rl-bench --output json > bench.json
//	go run ./cmd/rl-bench/chart -o docs/benchmarks.svg bench.json
//
// It reads the report from the file named as its argument, or from stdin.
package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"strings"

	"github.com/pgrl/pgrl/internal/cli"
)

// report is the part of rl-bench's JSON output the chart draws.
type report struct {
	Machine struct {
		GOOS          string `json:"goos"`
		GOARCH        string `json:"goarch"`
		NumCPU        int    `json:"num_cpu"`
		ServerVersion string `json:"server_version"`
	} `json:"machine"`
	DurationSeconds float64 `json:"duration_seconds"`
	Cases           []struct {
		Algorithm        string  `json:"algorithm"`
		Callers          int     `json:"callers"`
		Keys             int     `json:"keys"`
		LibraryOpsPerSec float64 `json:"library_ops_per_sec"`
		RawOpsPerSec     float64 `json:"raw_ops_per_sec"`
		ThroughputRatio  float64 `json:"throughput_ratio"`
		P50Ratio         float64 `json:"p50_ratio"`
	} `json:"cases"`
	Targets struct {
		MinThroughputRatio float64 `json:"min_throughput_ratio"`
		MaxP50Ratio        float64 `json:"max_p50_ratio"`
	} `json:"targets"`
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return cli.RunChart("chart", args, stdin, stdout, stderr, func(r report) int { return len(r.Cases) }, render)
}

// Layout, in SVG user units.
const (
	marginLeft = 70
	marginTop  = 50
	panelH     = 220
	panelGap   = 110
	groupW     = 64
	colorRaw   = "#9aa5b1"
	colorLib   = "#2f6fb2"
	colorTp    = "#2f6fb2"
	colorP50   = "#d98c1f"
	colorLine  = "#c0392b"
)

var abbrev = map[string]string{"fixed_window": "fixed", "token_bucket": "token", "sliding_window": "sliding"}

func render(r report) string {
	n := len(r.Cases)
	width := marginLeft + n*groupW + 30
	height := marginTop + 2*panelH + panelGap + 70
	var b strings.Builder
	cli.SVGStart(&b, width, height)
	title := fmt.Sprintf("rl-bench: raw statement vs library, PostgreSQL %s, %s/%s, %d CPUs, %gs per path per case",
		cli.FirstWord(r.Machine.ServerVersion), r.Machine.GOOS, r.Machine.GOARCH, r.Machine.NumCPU, r.DurationSeconds)
	fmt.Fprintf(&b, `<text x="%d" y="20" font-size="13" font-weight="bold">%s</text>`+"\n", marginLeft-50, html.EscapeString(title))

	// Panel 1: ops/s.
	top := marginTop
	maxOps := 0.0
	for _, c := range r.Cases {
		maxOps = math.Max(maxOps, math.Max(c.RawOpsPerSec, c.LibraryOpsPerSec))
	}
	maxOps = cli.NiceCeil(maxOps)
	axis(&b, top, marginLeft+n*groupW, maxOps, "checks/s", func(v float64) string { return fmt.Sprintf("%.0fk", v/1000) })
	for i, c := range r.Cases {
		x := marginLeft + i*groupW + 10
		bar(&b, x, top, 20, c.RawOpsPerSec/maxOps, colorRaw, fmt.Sprintf("raw %.0f/s", c.RawOpsPerSec))
		bar(&b, x+22, top, 20, c.LibraryOpsPerSec/maxOps, colorLib, fmt.Sprintf("library %.0f/s", c.LibraryOpsPerSec))
	}
	legend(&b, marginLeft+10, top-12, [][2]string{{colorRaw, "raw statement (pgx + gen)"}, {colorLib, "library (Limiter.Allow)"}})
	caseLabels(&b, r, top+panelH)

	// Panel 2: ratios, library / raw.
	top = marginTop + panelH + panelGap
	maxRatio := 1.4
	for _, c := range r.Cases {
		maxRatio = math.Max(maxRatio, math.Max(c.ThroughputRatio, c.P50Ratio))
	}
	maxRatio = math.Ceil(maxRatio*5) / 5
	axis(&b, top, marginLeft+n*groupW, maxRatio, "library / raw", func(v float64) string { return fmt.Sprintf("%.1f", v) })
	for i, c := range r.Cases {
		x := marginLeft + i*groupW + 10
		bar(&b, x, top, 20, c.ThroughputRatio/maxRatio, colorTp, fmt.Sprintf("throughput ratio %.3f", c.ThroughputRatio))
		bar(&b, x+22, top, 20, c.P50Ratio/maxRatio, colorP50, fmt.Sprintf("p50 ratio %.3f", c.P50Ratio))
	}
	for _, t := range []struct {
		v     float64
		label string
	}{{r.Targets.MinThroughputRatio, fmt.Sprintf("throughput ≥ %.2f", r.Targets.MinThroughputRatio)}, {r.Targets.MaxP50Ratio, fmt.Sprintf("p50 ≤ %.2f", r.Targets.MaxP50Ratio)}} {
		if t.v <= 0 {
			continue
		}
		y := float64(top) + float64(panelH)*(1-t.v/maxRatio)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-dasharray="5,3"/>`+"\n", marginLeft, y, marginLeft+n*groupW, y, colorLine)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" fill="%s" text-anchor="end">%s</text>`+"\n", marginLeft+n*groupW, y-3, colorLine, html.EscapeString(t.label))
	}
	legend(&b, marginLeft+10, top-12, [][2]string{{colorTp, "throughput ratio (higher is better)"}, {colorP50, "p50 latency ratio (lower is better)"}})
	caseLabels(&b, r, top+panelH)
	b.WriteString("</svg>\n")
	return b.String()
}

func axis(b *strings.Builder, top, right int, max float64, label string, format func(float64) string) {
	for i := 0; i <= 4; i++ {
		v := max * float64(i) / 4
		y := float64(top) + float64(panelH)*(1-float64(i)/4)
		fmt.Fprintf(b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e3e3e3"/>`+"\n", marginLeft, y, right, y)
		fmt.Fprintf(b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", marginLeft-6, y+4, format(v))
	}
	fmt.Fprintf(b, `<text transform="translate(14,%d) rotate(-90)" text-anchor="middle">%s</text>`+"\n", top+panelH/2, html.EscapeString(label))
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#444"/>`+"\n", marginLeft, top, marginLeft, top+panelH)
}

func bar(b *strings.Builder, x, top, w int, frac float64, color, title string) {
	frac = math.Max(0, math.Min(frac, 1))
	h := float64(panelH) * frac
	fmt.Fprintf(b, `<rect x="%d" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s</title></rect>`+"\n",
		x, float64(top+panelH)-h, w, h, color, html.EscapeString(title))
}

func legend(b *strings.Builder, x, y int, items [][2]string) {
	for _, it := range items {
		fmt.Fprintf(b, `<rect x="%d" y="%d" width="10" height="10" fill="%s"/>`+"\n", x, y-9, it[0])
		fmt.Fprintf(b, `<text x="%d" y="%d">%s</text>`+"\n", x+14, y, html.EscapeString(it[1]))
		x += 14 + 7*len(it[1]) + 20
	}
}

func caseLabels(b *strings.Builder, r report, y int) {
	for i, c := range r.Cases {
		x := marginLeft + i*groupW + 31
		name := abbrev[c.Algorithm]
		if name == "" {
			name = c.Algorithm
		}
		fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle">%s</text>`+"\n", x, y+14, html.EscapeString(name))
		fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle">%d caller%s</text>`+"\n", x, y+27, c.Callers, plural(c.Callers))
		fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle">%s key%s</text>`+"\n", x, y+40, humanInt(c.Keys), plural(c.Keys))
	}
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func humanInt(n int) string {
	if n >= 1000 && n%1000 == 0 {
		return fmt.Sprintf("%dk", n/1000)
	}
	return fmt.Sprint(n)
}
