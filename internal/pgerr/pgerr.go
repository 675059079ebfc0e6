// Package pgerr is where every pgrl package reads a database error. Classify
// sorts a *pgconn.PgError by its SQLSTATE (named with pgerrcode) into what it
// means to pgrl: missing objects, a missing privilege, a read-only server, a
// missing partition, bad input, SQL that does not fit the server. A few
// predicates (IsLockTimeout, IsDeadlock, IsAuthFailure, ...) name the codes
// one operation handles on its own. These, in sqlstate.go, are the only code
// in pgrl that compares SQLSTATEs; every other package calls them.
//
// Diagnose asks the catalog which grant the role lacks, since PostgreSQL's
// error alone often cannot say: a schema without USAGE is left off the
// search_path silently, so its tables look missing (42P01) although the fix
// is a grant, not a migration.
//
// ratelimit.ErrPermission, policy.ErrPermission, cleanup.ErrPermission and
// migration.ErrPermission are ErrPermission, so errors.Is matches whichever
// a caller tests against; the *PermissionError that carries it names the
// grants and keeps the *pgconn.PgError for errors.As.
package pgerr

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/notmigrated"
)

// ErrPermission is matched (with errors.Is) by every *PermissionError: the
// database role lacks a privilege on pgrl's schema, tables or functions.
var ErrPermission = errors.New("permission denied on pgrl's objects")

// PermissionError reports the privileges a role lacks on pgrl's objects and
// the statements that grant them. It matches ErrPermission.
type PermissionError struct {
	// Role is the role that lacks them (current_user), "" when unknown.
	Role string
	// Lacks says what it lacks, e.g. "USAGE on schema app".
	Lacks []string
	// Grants are the statements that give it, e.g. `GRANT USAGE ON SCHEMA
	// "app" TO "web"`.
	Grants []string
	// Hint, when set, is another way out (who should run the operation
	// instead).
	Hint string
	// Err is the database's error (a *pgconn.PgError), nil when the
	// catalog alone showed the missing privilege.
	Err error
}

// Error names the role, what it lacks and the grants.
func (e *PermissionError) Error() string {
	var b strings.Builder
	b.WriteString(ErrPermission.Error())
	b.WriteString(": role ")
	b.WriteString(cmp.Or(e.Role, "<role>"))
	b.WriteString(" lacks ")
	b.WriteString(strings.Join(e.Lacks, ", "))
	if len(e.Grants) > 0 {
		b.WriteString("; run ")
		b.WriteString(strings.Join(e.Grants, "; "))
	}
	if e.Hint != "" {
		b.WriteString("; ")
		b.WriteString(e.Hint)
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

// Is reports whether target is ErrPermission.
func (e *PermissionError) Is(target error) bool { return target == ErrPermission }

// Unwrap returns the database's error.
func (e *PermissionError) Unwrap() error { return e.Err }

// Need is what an operation needs on pgrl's tables.
type Need struct {
	// Tables are the tables it reads or writes, unqualified
	// ("pgrl_policy"): Diagnose looks for the schema that holds them.
	Tables []string
	// Privileges are the table privileges it needs on each of Tables
	// ("SELECT", "INSERT", ...).
	Privileges []string
	// Hint is added to the message: another way out, such as running the
	// operation as the migration role.
	Hint string
}

// PolicyRead is what reading the policies needs: USAGE on their schema
// and SELECT on both tables (package policy, rl-policy).
var PolicyRead = Need{Tables: []string{"pgrl_policy", "pgrl_policy_override"}, Privileges: []string{"SELECT"},
	Hint: "or run `rl-migrate up --grant-to <role>` as the migration role, which grants both to an application role"}

// PolicyWrite is what writing the policies needs as a role other than
// their owner.
var PolicyWrite = Need{Tables: PolicyRead.Tables, Privileges: []string{"SELECT", "INSERT", "UPDATE", "DELETE"},
	Hint: "reading the policies needs only SELECT, which is all rl-migrate up --grant-to gives the application role: " +
		"write them as the migration role, the tables' owner, or grant the writes"}

// Querier is what Diagnose reads the catalog through: a pool, a *pgx.Conn
// or a pgx.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// grantsQuery finds the schema holding need's tables (the first of
// search_path that does, else the first by name) and reports, for the
// current role, whether it has USAGE on it and which privileges of $2 it
// lacks on which tables of $1 there. search_path is split as PostgreSQL
// splits it: quoted names keep their case, spaces and commas ("" is a
// quote), unquoted ones are folded to lower case, $user is current_user.
// The pattern has no backslash, so standard_conforming_strings cannot
// change it.
const grantsQuery = `WITH path AS (
  SELECT CASE WHEN m.g[1] LIKE '"%' THEN replace(substr(m.g[1], 2, length(m.g[1]) - 2), '""', '"')
              ELSE lower(m.g[1]) END AS s,
         m.i
    FROM regexp_matches(pg_catalog.current_setting('search_path'),
                        '[[:space:]]*("(?:[^"]|"")*"|[^,[:space:]"](?:[^,]*[^,[:space:]])?)[[:space:]]*(?:,|$)', 'g') WITH ORDINALITY AS m(g, i)
), tbl AS (
  SELECT c.oid, c.relname::text AS relname, c.relnamespace AS nsp
    FROM pg_catalog.pg_class AS c
   WHERE c.relname = ANY ($1::text[]) AND c.relkind IN ('r', 'p')
), sch AS (
  SELECT n.oid, n.nspname::text AS nspname,
         (SELECT min(p.i) FROM path AS p
           WHERE p.s = n.nspname OR (p.s = '$user' AND n.nspname = current_user)) AS pos
    FROM pg_catalog.pg_namespace AS n
   WHERE n.oid IN (SELECT nsp FROM tbl)
   ORDER BY pos NULLS LAST, n.nspname
   LIMIT 1
)
SELECT s.nspname, s.pos IS NOT NULL, current_user::text, pg_catalog.has_schema_privilege(s.oid, 'USAGE'),
       coalesce((SELECT array_agg(t.relname || ' ' || pr.p
                                  ORDER BY array_position($1::text[], t.relname), array_position($2::text[], pr.p))
                   FROM tbl AS t CROSS JOIN unnest($2::text[]) AS pr(p)
                  WHERE t.nsp = s.oid AND NOT pg_catalog.has_table_privilege(t.oid, pr.p)), '{}')
  FROM sch AS s`

// lookup reads what the current role lacks of need, in the schema it
// returns: pe.Lacks is empty when it lacks nothing. pe is nil when the
// catalog cannot be read (an aborted transaction, say) or no schema holds
// need's tables. noUsage reports a schema of search_path without USAGE
// (one outside search_path hides nothing: a grant would not make its
// tables visible).
func lookup(ctx context.Context, q Querier, need Need) (pe *PermissionError, schema string, noUsage bool) {
	if q == nil || len(need.Tables) == 0 {
		return nil, "", false
	}
	var role string
	var inPath, usage bool
	var lacking []string
	if err := q.QueryRow(ctx, grantsQuery, need.Tables, need.Privileges).Scan(&schema, &inPath, &role, &usage, &lacking); err != nil {
		return nil, "", false
	}
	pe = &PermissionError{Role: role, Hint: need.Hint}
	s := pgx.Identifier{schema}.Sanitize()
	if !usage {
		pe.Lacks = append(pe.Lacks, "USAGE on schema "+schema)
		pe.Grants = append(pe.Grants, "GRANT USAGE ON SCHEMA "+s+" TO "+pe.grantee())
	}
	// Group the tables by the privileges each lacks: one GRANT per group.
	var order []string
	groups := map[string][]string{} // quoted, for the GRANT
	named := map[string][]string{}  // as the role would write them
	privsOf := map[string][]string{}
	var tables []string
	for _, tp := range lacking {
		t, p, _ := strings.Cut(tp, " ")
		if !slices.Contains(tables, t) {
			tables = append(tables, t)
		}
		privsOf[t] = append(privsOf[t], p)
	}
	for _, t := range tables {
		k := strings.Join(privsOf[t], ", ")
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], pgx.Identifier{schema, t}.Sanitize())
		named[k] = append(named[k], schema+"."+t)
	}
	for _, k := range order {
		pe.Lacks = append(pe.Lacks, k+" on "+strings.Join(named[k], ", "))
		pe.Grants = append(pe.Grants, "GRANT "+k+" ON "+strings.Join(groups[k], ", ")+" TO "+pe.grantee())
	}
	return pe, schema, !usage && inPath
}

// Diagnose explains err, the failure of an operation that needs need on
// q's database, as a *PermissionError when a missing privilege caused it:
// a 42501, or objects that look missing (Kind Undefined, or
// notmigrated.Err) because a schema holding need's tables lacks USAGE. It
// returns nil when err is neither, or when the tables are truly missing.
// It reads the catalog through q (one query); when that fails, a 42501 is
// still explained from PostgreSQL's message, with placeholders for what it
// cannot name.
func Diagnose(ctx context.Context, q Querier, need Need, err error) *PermissionError {
	kind, pgErr := Classify(err)
	switch {
	case kind == Permission:
	case kind == Undefined, pgErr == nil && errors.Is(err, notmigrated.Err):
		if pe, _, noUsage := lookup(ctx, q, need); noUsage && len(pe.Lacks) > 0 {
			if pgErr != nil {
				pe.Err = pgErr
			}
			return pe
		}
		return nil
	default:
		return nil
	}
	if strings.HasPrefix(pgErr.Message, "must be owner of ") {
		return Denied(pgErr, need)
	}
	if _, t, ok := strings.Cut(pgErr.Message, "for table "); ok && !slices.Contains(need.Tables, t) {
		// The statement touched a table besides need's (a decision over
		// limits of several algorithms): look at it too.
		need.Tables = append(slices.Clone(need.Tables), strings.TrimSpace(t))
	}
	pe, schema, _ := lookup(ctx, q, need)
	if pe == nil || (len(pe.Lacks) == 0 && deniedFunction(pgErr.Message) == "") {
		// The catalog shows nothing missing of need: the message says
		// what is, with the role and schema filled in when known.
		d := denied(pgErr, need, "", schema)
		if pe != nil {
			d = denied(pgErr, need, pe.Role, schema)
		}
		return d
	}
	if function := deniedFunction(pgErr.Message); function != "" {
		pe.Lacks = append(pe.Lacks, "EXECUTE on "+function)
		pe.Grants = append(pe.Grants, "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "+quoteOr(schema, "<schema>")+" TO "+pe.grantee())
	}
	pe.Err = pgErr
	return pe
}

// Denied explains a 42501 from PostgreSQL's message alone ("permission
// denied for table|schema|function X"), for callers that cannot query the
// database: the role and, for functions, the schema are placeholders.
func Denied(pgErr *pgconn.PgError, need Need) *PermissionError {
	return denied(pgErr, need, "", "")
}

// denied is Denied with the role and the schema of need's tables, "" when
// unknown.
func denied(pgErr *pgconn.PgError, need Need, role, schema string) *PermissionError {
	pe := &PermissionError{Role: role, Hint: need.Hint, Err: pgErr}
	r := pe.grantee()
	msg := pgErr.Message
	object := func(kind string) string {
		_, o, _ := strings.Cut(msg, "for "+kind+" ")
		return strings.TrimSpace(o)
	}
	switch {
	case strings.HasPrefix(msg, "must be owner of "):
		pe.Lacks = []string{"ownership of " + strings.TrimPrefix(msg, "must be owner of ")}
		pe.Hint = cmp.Or(need.Hint, "run it as the owner of pgrl's tables (the migration role), or GRANT <owner> TO "+r)
	case object("schema") != "":
		s := object("schema")
		pe.Lacks = []string{"USAGE on schema " + s}
		pe.Grants = []string{"GRANT USAGE ON SCHEMA " + pgx.Identifier{s}.Sanitize() + " TO " + r}
	case deniedFunction(msg) != "":
		pe.Lacks = []string{"EXECUTE on " + deniedFunction(msg)}
		pe.Grants = []string{"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA " + quoteOr(schema, "<schema>") + " TO " + r}
	default:
		tables, quoted := object("table"), ""
		if tables != "" && schema != "" {
			quoted = pgx.Identifier{schema, tables}.Sanitize()
		} else if tables != "" {
			quoted = pgx.Identifier{tables}.Sanitize()
		} else {
			tables = strings.Join(need.Tables, ", ")
			quoted = tables
		}
		// The role may hold some of need's privileges already: granting
		// them again does no harm.
		pe.Lacks = []string{"a privilege on " + cmp.Or(tables, "pgrl's tables")}
		if len(need.Privileges) > 0 && quoted != "" {
			pe.Grants = []string{"GRANT " + strings.Join(need.Privileges, ", ") + " ON " + quoted + " TO " + r}
		}
	}
	return pe
}

// deniedFunction returns "function X" (or "procedure X") from a 42501
// message about one, "" otherwise.
func deniedFunction(msg string) string {
	for _, kind := range []string{"function", "procedure"} {
		if _, o, ok := strings.Cut(msg, "for "+kind+" "); ok {
			return kind + " " + strings.TrimSpace(o)
		}
	}
	return ""
}

// quoteOr quotes the identifier s, or returns placeholder when s is "".
func quoteOr(s, placeholder string) string {
	if s == "" {
		return placeholder
	}
	return pgx.Identifier{s}.Sanitize()
}

// grantee is the role as a GRANT names it, or a placeholder.
func (e *PermissionError) grantee() string {
	if e.Role == "" {
		return "<role>"
	}
	return pgx.Identifier{e.Role}.Sanitize()
}
