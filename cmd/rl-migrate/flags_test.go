package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRedactConnString(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://u:secret@h:5432/db?sslmode=disable": "postgres://u:xxxxx@h:5432/db?sslmode=disable",
		"postgres://u@h/db?password=secret":             "postgres://u@h/db?password=xxxxx",
		"postgres://u@h/db":                             "postgres://u@h/db",
		"host=h user=u password=secret dbname=d":        "host=h user=u password=xxxxx dbname=d",
		"host=h password = 'se cret' dbname=d":          "host=h password = xxxxx dbname=d",
	} {
		require.Equal(t, want, redactConnString(in), in)
	}
	require.Equal(t, `'a b'`, shellQuote("a b"))
	require.Equal(t, `'it'\''s'`, shellQuote("it's"))
	require.Equal(t, "--schema=x", shellQuote("--schema=x"))
}
