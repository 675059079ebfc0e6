package main

import (
	"bytes"
	"encoding/xml"
	"io"
	"strings"
	"testing"

	"github.com/pgrl/pgrl/internal/golden"
)

const sample = `{"machine":{"num_cpu":2,"postgres_version":"15.20 (Debian)","redis_version":"7.0.15"},
"duration_seconds":5,
"cases":[
 {"callers":8,"keys":100000,"pgrl_ops_per_sec":18000,"redis_rate_ops_per_sec":42000,"ratio":0.43,"pgrl_uncoalesced":{"ops_per_sec":16000}},
 {"callers":64,"keys":1,"pgrl_ops_per_sec":7000,"redis_rate_ops_per_sec":15000,"ratio":0.46}]}`

func TestDrawsValidSVG(t *testing.T) {
	var out, stderr bytes.Buffer
	if code := run(nil, strings.NewReader(sample), &out, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	svg := out.String()
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		if _, err := d.Token(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("invalid SVG: %v", err)
		}
	}
	for _, want := range []string{"0.43×", "64 callers", "1 hot key", "coalescing off", "PostgreSQL 15.20"} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}

func TestRejectsEmptyReport(t *testing.T) {
	var stderr bytes.Buffer
	if code := run(nil, strings.NewReader(`{"cases":[]}`), io.Discard, &stderr); code != 1 {
		t.Fatalf("exit %d", code)
	}
}

func TestChartUnchanged(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(nil, strings.NewReader(sample), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	golden.Check(t, "sample.svg", out.Bytes())
}
