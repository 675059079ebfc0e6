// Package optview lets the packages of this module that wrap a
// ratelimit.Limiter (package lease) read what a ratelimit.Option asks for,
// which the public API keeps opaque. Package ratelimit sets Decode when it
// is initialised.
package optview

// Kind is what one option gives.
type Kind uint8

// The kinds of option; Invalid is the zero Option.
const (
	Invalid Kind = iota
	Cost
	UpTo
	AtRate
)

// View is one option's content: its kind, and the units of Cost and UpTo.
type View struct {
	Kind Kind
	N    int64
}

// Decode reads a ratelimit.Option (passed as any, since this package cannot
// import ratelimit). Set by package ratelimit at init.
var Decode func(o any) View
