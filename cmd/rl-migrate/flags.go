package main

import (
	"flag"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"
)

// flagExamples are example values for the flags, for error messages.
var flagExamples = map[string]string{
	"database-url":     "postgres://user:pass@host:5432/db",
	"schema":           "ratelimit",
	"migrations-table": "pgrl_schema_migrations",
	"lock-timeout":     "5s",
	"lock-wait":        "1m",
	"output":           "json",
	"grant-to":         "app",
	"partition-width":  "1h",
	"lookahead":        "24h",
}

// flagError rewrites an error of the flag package, which names flags with a
// single dash and says "parse error" for a bad duration, into one line that
// names the flag as the help does and shows a value that works.
func flagError(fs *flag.FlagSet, err error) error {
	msg := err.Error()
	example := func(name string) string {
		if v, ok := flagExamples[name]; ok {
			return fmt.Sprintf(", such as --%s %s", name, v)
		}
		return ""
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: -"); ok {
		return usagef("flag --%s needs an argument%s", name, example(name))
	}
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		return usagef("unknown flag --%s", name)
	}
	if m := invalidValue.FindStringSubmatch(msg); m != nil {
		value, name, cause := m[1], m[2], m[3]
		if fl := fs.Lookup(name); fl != nil {
			if g, ok := fl.Value.(flag.Getter); ok {
				switch g.Get().(type) {
				case time.Duration:
					return usagef("flag --%s: %s is not a duration; use a number with a unit, such as --%s %s (or 500ms, 30s, 5m, 24h)",
						name, value, name, flagExamples[name])
				case bool:
					return usagef("flag --%s: %s is not true or false; write --%s alone to turn it on", name, value, name)
				}
			}
		}
		return usagef("flag --%s: invalid value %s (%s)%s", name, value, cause, example(name))
	}
	return usagef("%s", strings.Replace(msg, " -", " --", 1))
}

// invalidValue matches the flag package's "invalid value" and "invalid
// boolean value" errors: the quoted value, the flag's name, the cause.
var invalidValue = regexp.MustCompile(`^invalid (?:boolean )?value ("(?:[^"\\]|\\.)*") for (?:flag )?-([^:]+): (.*)$`)

// commandLine is the command line as given, ready to paste into a shell,
// with any password in a connection string replaced by xxxxx.
func (a *app) commandLine() string {
	parts := []string{"rl-migrate"}
	redactNext := false
	for _, arg := range a.args {
		switch {
		case redactNext:
			arg, redactNext = redactConnString(arg), false
		case arg == "--database-url" || arg == "-database-url":
			redactNext = true
		case strings.HasPrefix(arg, "--database-url=") || strings.HasPrefix(arg, "-database-url="):
			k, v, _ := strings.Cut(arg, "=")
			arg = k + "=" + redactConnString(v)
		}
		parts = append(parts, shellQuote(arg))
	}
	return strings.Join(parts, " ")
}

// keywordPassword matches a password in a key=value connection string.
var keywordPassword = regexp.MustCompile(`(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// redactConnString hides the password of a URL or key=value connection
// string.
func redactConnString(s string) string {
	if u, err := url.Parse(s); err == nil && u.Scheme != "" {
		if _, ok := u.User.Password(); ok {
			return u.Redacted()
		}
		if q := u.Query(); q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return keywordPassword.ReplaceAllString(s, "${1}xxxxx")
}

// shellSafe matches words a POSIX shell reads as themselves.
var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_@%+=:,./-]+$`)

func shellQuote(s string) string {
	if shellSafe.MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
