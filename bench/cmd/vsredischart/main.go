// Command vsredischart draws vsredis's JSON report as an SVG bar chart: for
// every case (callers × keys), the ops/s of pgrl, of redis_rate and, when the
// report has it, of pgrl with coalescing disabled, with pgrl/redis_rate's
// ratio above each group.
//
//	vsredis --output json > vsredis.json
//	vsredischart -o docs/redis.svg vsredis.json
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

// report is the part of vsredis's JSON output the chart draws.
type report struct {
	Machine struct {
		NumCPU          int    `json:"num_cpu"`
		PostgresVersion string `json:"postgres_version"`
		RedisVersion    string `json:"redis_version"`
	} `json:"machine"`
	DurationSeconds float64 `json:"duration_seconds"`
	Cases           []struct {
		Callers            int     `json:"callers"`
		Keys               int     `json:"keys"`
		PgrlOpsPerSec      float64 `json:"pgrl_ops_per_sec"`
		RedisRateOpsPerSec float64 `json:"redis_rate_ops_per_sec"`
		Ratio              float64 `json:"ratio"`
		Uncoalesced        *struct {
			OpsPerSec float64 `json:"ops_per_sec"`
		} `json:"pgrl_uncoalesced"`
	} `json:"cases"`
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return cli.RunChart("vsredischart", args, stdin, stdout, stderr, func(r report) int { return len(r.Cases) }, draw)
}

// Layout, in SVG user units.
const (
	barWidth  = 22
	groupGap  = 26
	plotTop   = 70
	plotH     = 300
	leftAxis  = 70
	rightPad  = 20
	bottomPad = 90
)

var colors = []string{"#336791", "#d82c20", "#8fb3d9"}
var seriesNames = []string{"pgrl (coalescing on)", "redis_rate", "pgrl (coalescing off)"}

func draw(rep report) string {
	series := 2
	for _, c := range rep.Cases {
		if c.Uncoalesced != nil {
			series = 3
		}
	}
	maxOps := 0.0
	for _, c := range rep.Cases {
		maxOps = math.Max(maxOps, math.Max(c.PgrlOpsPerSec, c.RedisRateOpsPerSec))
		if c.Uncoalesced != nil {
			maxOps = math.Max(maxOps, c.Uncoalesced.OpsPerSec)
		}
	}
	top := cli.NiceCeil(maxOps)
	groupW := series*barWidth + groupGap
	width := max(leftAxis+len(rep.Cases)*groupW+rightPad, 720)
	height := plotTop + plotH + bottomPad
	y := func(v float64) float64 { return plotTop + plotH - v/top*plotH }

	var b strings.Builder
	cli.SVGStart(&b, width, height)
	title := fmt.Sprintf("Checks per second: pgrl (PostgreSQL %s) vs redis_rate (Redis %s), %d CPUs, %gs per path",
		cli.FirstWord(rep.Machine.PostgresVersion), rep.Machine.RedisVersion, rep.Machine.NumCPU, rep.DurationSeconds)
	fmt.Fprintf(&b, `<text x="%d" y="18" font-size="13" font-weight="bold">%s</text>`+"\n", leftAxis, html.EscapeString(title))
	for i := range series {
		x := leftAxis + i*170
		fmt.Fprintf(&b, `<rect x="%d" y="30" width="12" height="12" fill="%s"/><text x="%d" y="40">%s</text>`+"\n", x, colors[i], x+16, seriesNames[i])
	}
	fmt.Fprintf(&b, `<text x="%d" y="58" fill="#555">number above each group: pgrl / redis_rate ops/s</text>`+"\n", leftAxis)

	// Grid and axis.
	for i := 0; i <= 5; i++ {
		v := top * float64(i) / 5
		fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", leftAxis, width-rightPad, y(v), y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", leftAxis-6, y(v)+4, human(v))
	}
	fmt.Fprintf(&b, `<text x="14" y="%d" transform="rotate(-90 14 %d)" text-anchor="middle">ops/s</text>`+"\n", plotTop+plotH/2, plotTop+plotH/2)

	for gi, c := range rep.Cases {
		x0 := leftAxis + gi*groupW + groupGap/2
		vals := []float64{c.PgrlOpsPerSec, c.RedisRateOpsPerSec}
		if series == 3 {
			u := 0.0
			if c.Uncoalesced != nil {
				u = c.Uncoalesced.OpsPerSec
			}
			vals = append(vals, u)
		}
		hi := 0.0
		for i, v := range vals {
			hi = math.Max(hi, v)
			fmt.Fprintf(&b, `<rect x="%d" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s: %.0f ops/s</title></rect>`+"\n",
				x0+i*barWidth, y(v), barWidth-2, plotTop+plotH-y(v), colors[i], seriesNames[i], v)
		}
		mid := x0 + series*barWidth/2
		color := "#1a7f37"
		if c.Ratio < 1 {
			color = "#b35900"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="middle" font-weight="bold" fill="%s">%.2f×</text>`+"\n", mid, y(hi)-5, color, c.Ratio)
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">%d callers</text>`+"\n", mid, plotTop+plotH+16, c.Callers)
		keys := fmt.Sprintf("%d keys", c.Keys)
		if c.Keys == 1 {
			keys = "1 hot key"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle" fill="#555">%s</text>`+"\n", mid, plotTop+plotH+30, keys)
	}
	fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#333"/>`+"\n", leftAxis, width-rightPad, plotTop+plotH, plotTop+plotH)
	b.WriteString("</svg>\n")
	return b.String()
}

func human(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%gM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%gk", v/1e3)
	}
	return fmt.Sprintf("%g", v)
}
