package cli

import (
	"encoding/xml"
	"strings"
	"testing"
)

func TestNiceCeil(t *testing.T) {
	for in, want := range map[float64]float64{43151: 50000, 1: 1, 0: 1, -3: 1, 120: 200, 18000: 20000, 0.3: 0.5, 7000: 10000} {
		if got := NiceCeil(in); got != want {
			t.Errorf("NiceCeil(%v) = %v, want %v", in, got, want)
		}
	}
}

func TestFirstWord(t *testing.T) {
	for in, want := range map[string]string{"17.5 (Debian 17.5-1)": "17.5", "16.2": "16.2", "": "", " 15.1 x": "15.1"} {
		if got := FirstWord(in); got != want {
			t.Errorf("FirstWord(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestSVGStart(t *testing.T) {
	var b strings.Builder
	SVGStart(&b, 300, 200)
	b.WriteString("</svg>\n")
	var doc struct {
		Width  string `xml:"width,attr"`
		Height string `xml:"height,attr"`
		Rect   struct {
			Fill string `xml:"fill,attr"`
		} `xml:"rect"`
	}
	if err := xml.Unmarshal([]byte(b.String()), &doc); err != nil {
		t.Fatalf("not well-formed: %v\n%s", err, b.String())
	}
	if doc.Width != "300" || doc.Height != "200" || doc.Rect.Fill != "white" {
		t.Errorf("got %+v", doc)
	}
}
