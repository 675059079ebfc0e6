package main

import (
	"bytes"
	"encoding/xml"
	"io"
	"strings"
	"testing"

	"github.com/pgrl/pgrl/internal/golden"
)

const sampleReport = `{"machine":{"goos":"linux","goarch":"amd64","num_cpu":2,"server_version":"15.20 (Debian)"},
"duration_seconds":5,
"cases":[
 {"algorithm":"fixed_window","callers":1,"keys":100000,"library_ops_per_sec":7000,"raw_ops_per_sec":7100,"throughput_ratio":0.986,"p50_ratio":1.01},
 {"algorithm":"token_bucket","callers":8,"keys":1,"library_ops_per_sec":6000,"raw_ops_per_sec":13000,"throughput_ratio":0.462,"p50_ratio":4.7}],
"targets":{"min_throughput_ratio":0.85,"max_p50_ratio":1.2}}`

func TestChartIsWellFormedSVG(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(nil, strings.NewReader(sampleReport), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	svg := out.String()
	dec := xml.NewDecoder(strings.NewReader(svg))
	rects := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "rect" {
			rects++
		}
	}
	// Background, 2 legends × 2 swatches, 2 cases × 2 panels × 2 bars.
	if rects != 1+4+8 {
		t.Errorf("%d rects, want 13", rects)
	}
	for _, want := range []string{"raw 13000/s", "library 6000/s", "throughput ratio 0.462", "p50 ratio 4.700", "100k keys", "8 callers", "15.20"} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}

func TestChartRejectsBadInput(t *testing.T) {
	for _, in := range []string{"", "{}", "not json"} {
		var out, errb bytes.Buffer
		if code := run(nil, strings.NewReader(in), &out, &errb); code != 1 {
			t.Errorf("%q: exit %d, want 1", in, code)
		}
	}
}

func TestChartUnchanged(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(nil, strings.NewReader(sampleReport), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	golden.Check(t, "sample.svg", out.Bytes())
}
