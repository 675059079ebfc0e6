//go:build !linux

package main

import "os"

// fileIsTerminal reports a character device as a terminal: close enough
// where the terminal driver is not asked (a status line written to
// /dev/null is harmless).
func fileIsTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
