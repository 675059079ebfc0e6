// Package schema carries pgrl's golang-migrate migrations, embedded so that
// the library and both binaries ship them. The same files are sqlc's schema.
//
// Files are named NNNNNN_name.up.sql and NNNNNN_name.down.sql; the version is
// the zero-padded number, and sqlc reads the up files in lexical order.
package schema

import "embed"

// FS holds every migration file at its root.
//
//go:embed *.sql
var FS embed.FS
