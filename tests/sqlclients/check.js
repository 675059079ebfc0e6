// One process of TestSQLCheckMultiprocess: pgrl_check from Node (pg).
//
// Usage: node check.js CONNINFO SCHEMA POLICY KEY CALLS GATE
//
// It connects with pgrl's schema first in its search_path, waits at the
// advisory lock GATE (held by the test until every process waits), calls
// pgrl_check(POLICY, KEY) CALLS times and prints t or f for each.
'use strict';

const { Client } = require('pg');

async function main() {
  const [conninfo, schema, policy, key, calls, gate] = process.argv.slice(2, 8);
  const client = new Client({ connectionString: conninfo, options: `-c search_path=${schema}` });
  await client.connect();
  try {
    await client.query('SELECT pg_advisory_lock_shared($1), pg_advisory_unlock_shared($1)', [gate]);
    const out = [];
    for (let i = 0; i < Number(calls); i++) {
      const r = await client.query('SELECT allowed FROM pgrl_check($1, $2)', [policy, key]);
      out.push(r.rows[0].allowed ? 't' : 'f');
    }
    process.stdout.write(out.join('\n') + '\n');
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
