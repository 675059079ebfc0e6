"""One process of TestSQLCheckMultiprocess: pgrl_check from Python (psycopg).

Usage: check.py CONNINFO SCHEMA POLICY KEY CALLS GATE

It connects with pgrl's schema first in its search_path, waits at the
advisory lock GATE (held by the test until every process waits), calls
pgrl_check(POLICY, KEY) CALLS times and prints t or f for each.
"""
import sys

import psycopg


def main() -> None:
    conninfo, schema, policy, key, calls, gate = sys.argv[1:7]
    with psycopg.connect(conninfo, options=f"-c search_path={schema}", autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock_shared(%s), pg_advisory_unlock_shared(%s)", (int(gate), int(gate)))
        for _ in range(int(calls)):
            (allowed,) = conn.execute("SELECT allowed FROM pgrl_check(%s, %s)", (policy, key)).fetchone()
            print("t" if allowed else "f")


if __name__ == "__main__":
    main()
