package cli

import (
	"fmt"
	"math"
	"strings"
)

// SVGStart writes the opening of a chart's SVG document to b: the root
// element of the given size in user units, and a white background. The
// chart closes it with "</svg>\n".
func SVGStart(b *strings.Builder, width, height int) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n", width, height, width, height)
	fmt.Fprintf(b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
}

// NiceCeil rounds v up to 1, 2 or 5 times a power of ten, for the top of a
// chart's axis; 1 when v is not positive.
func NiceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// FirstWord returns the first space-separated word of s, such as "17.5" of
// the server_version "17.5 (Debian 17.5-1)".
func FirstWord(s string) string {
	if f := strings.Fields(s); len(f) > 0 {
		return f[0]
	}
	return s
}
