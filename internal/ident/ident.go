// Package ident checks names of PostgreSQL objects (schemas, tables, roles)
// before they reach the server, which would silently cut a long name to
// MaxLen bytes and so could make two different names one.
package ident

import (
	"fmt"
	"strings"
)

// MaxLen is the longest identifier PostgreSQL keeps whole, in bytes
// (NAMEDATALEN - 1 in a standard build).
const MaxLen = 63

// Check returns an error naming what is wrong with name, or nil. what says
// which setting the name came from, e.g. "--schema" or "Config.Schema".
func Check(what, name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%s is empty; give a name", what)
	case len(name) > MaxLen:
		return fmt.Errorf("%s %q is %d bytes long; PostgreSQL keeps only the first %d bytes of a name, so it would name another object: use a name of at most %d bytes",
			what, name, len(name), MaxLen, MaxLen)
	case strings.ContainsRune(name, 0):
		return fmt.Errorf("%s %q contains a NUL byte, which no PostgreSQL name can hold", what, name)
	}
	return nil
}
