// Drains preloaded no-op jobs with graphile-worker on the same server and machine as
// skiplock's benches/drain.rs, for a side-by-side number.
//
//   cd benches/peers/graphile-worker && npm install && node bench.mjs [jobs] [concurrency]
//
// Each configuration gets a fresh database: graphile-worker's migrations, `jobs` rows added
// with graphile_worker.add_jobs in batches of 10,000, VACUUM ANALYZE, then one worker
// process (this one) drains them. graphile-worker deletes a job when it completes, so the
// rate is jobs divided by the time from starting the runner to an empty jobs table (polled
// every 20 ms); skiplock's drain counts from the first claim to the last completion in the
// database, which is at most a few milliseconds shorter.
import { run, runMigrations } from "graphile-worker";
import pg from "pg";

const base = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/postgres";
const jobs = Number(process.argv[2] ?? 200000);
const concurrency = Number(process.argv[3] ?? 32);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const configurations = [
  ["defaults", {}],
  [
    "local queue of 500, batched completions (worker.graphile.org/docs/performance)",
    { localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 },
  ],
];

async function drain(name, workerPreset) {
  const admin = new pg.Client({ connectionString: base });
  await admin.connect();
  const db = `skiplock_peer_gw_${process.pid}`;
  await admin.query(`DROP DATABASE IF EXISTS ${db}`);
  await admin.query(`CREATE DATABASE ${db}`);
  const url = new URL(base);
  url.pathname = `/${db}`;
  const connectionString = url.toString();
  try {
    await runMigrations({ connectionString });
    const client = new pg.Client({ connectionString });
    await client.connect();
    for (let added = 0; added < jobs; added += 10000) {
      const n = Math.min(10000, jobs - added);
      await client.query(
        `SELECT graphile_worker.add_jobs(array(
             SELECT ('noop', '{}'::json, null, null, null, null, null, null)::graphile_worker.job_spec
             FROM generate_series(1, $1)))`,
        [n],
      );
    }
    await client.query("VACUUM ANALYZE graphile_worker._private_jobs");
    const started = performance.now();
    const runner = await run({
      connectionString,
      concurrency,
      noHandleSignals: true,
      pollInterval: 1000,
      logger: undefined,
      taskList: { noop: async () => {} },
      preset: { worker: { maxPoolSize: Math.max(10, concurrency + 2), ...workerPreset } },
    });
    for (;;) {
      const { rows } = await client.query(
        "SELECT count(*)::int AS left FROM graphile_worker._private_jobs",
      );
      if (rows[0].left === 0) break;
      await sleep(20);
    }
    const secs = (performance.now() - started) / 1000;
    await runner.stop();
    await client.end();
    console.log(
      `| graphile-worker 0.18.0, ${name} | ${concurrency} | ${jobs} | ${secs.toFixed(2)} | ${Math.round(jobs / secs)}/s |`,
    );
  } finally {
    await admin.query(`DROP DATABASE IF EXISTS ${db} WITH (FORCE)`);
    await admin.end();
  }
}

console.log("| worker | conc. | jobs | secs | jobs/s |");
console.log("|---|---|---|---|---|");
// PEER_TUNED_ONLY=1 skips the defaults (minutes on a preloaded queue) for side-by-side runs.
for (const [name, preset] of configurations) {
  if (process.env.PEER_TUNED_ONLY && name === "defaults") continue;
  await drain(name, preset);
}
