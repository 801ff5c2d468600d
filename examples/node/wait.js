#!/usr/bin/env node
// Enqueue a job and wait for its outcome, from Node.js (docs/sql.md, "Wait for a job's
// outcome").
//
//   node wait.js --kind sleep --args '{"ms": 200}' --timeout 30
//
// Prints the outcome as one line of JSON and exits 0 when the job succeeded, 1 when it ended
// dead or cancelled, 2 when it did not finish in time (it is left as it is) or is not there.
// Any worker runs the job: `skiplock work`, worker.js beside this file, a Rust worker.
//
// How it waits: LISTEN skiplock_finished first, then skiplock.watch_job(id), which marks the
// job awaited and says where it stands; a job that finishes afterwards notifies its id, at
// the commit that finished it, and watch_job is asked again. No polling, but a look every
// 10 s in case a notification was lost (a job deleted while live notifies nothing).
// DATABASE_URL defaults to postgres://postgres@127.0.0.1:5432/postgres, as `skiplock` does;
// LISTEN needs a direct connection (not PgBouncer in transaction mode).
//
// The job continues the caller's trace: TRACEPARENT and TRACESTATE from the environment
// (OpenTelemetry's carriers for a process; an HTTP service passes its request's headers
// instead) go to skiplock.enqueue, and every attempt gets them.
'use strict';

const { parseArgs } = require('node:util');
const { setTimeout: sleepMs } = require('node:timers/promises');
const pg = require('pg');

const DATABASE_URL_DEFAULT = 'postgres://postgres@127.0.0.1:5432/postgres';
// A look at the job this often even without a notification: only a lost one makes it matter.
const FALLBACK_LOOK_MS = 10_000;

// skiplock.watch_job: the job's row, or undefined when it does not exist. Run again on a
// serialization failure: under a database whose default isolation is not READ COMMITTED, a
// job finishing at that instant fails the statement instead of being read finished.
async function watch(client, jobId) {
  for (let attempt = 1; ; attempt++) {
    try {
      // The time as text: a row written by hand may say '-infinity'.
      const { rows } = await client.query(
        'SELECT state::text, attempt, output, last_error, finished_at::text' +
          ' FROM skiplock.watch_job($1)',
        [jobId],
      );
      return rows[0];
    } catch (error) {
      if (error.code !== '40001' || attempt >= 10) throw error;
      await sleepMs(10 * attempt);
    }
  }
}

// Waits until the job finished: its row, undefined (not there), or 'timeout'.
async function waitFor(client, jobId, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  let wake = () => {};
  client.on('notification', (message) => {
    if (message.channel === 'skiplock_finished' && message.payload === String(jobId)) wake();
  });
  await client.query('LISTEN skiplock_finished'); // before the first look: nothing is missed
  for (;;) {
    // Armed before the look, so a notification that arrives during it is kept.
    const woken = new Promise((resolve) => {
      wake = resolve;
    });
    const row = await watch(client, jobId);
    if (row === undefined || row.finished_at !== null) return row;
    const left = deadline - Date.now();
    if (left <= 0) return 'timeout';
    let timer;
    await Promise.race([
      woken,
      new Promise((resolve) => {
        timer = setTimeout(resolve, Math.min(left, FALLBACK_LOOK_MS));
      }),
    ]);
    clearTimeout(timer);
  }
}

async function main() {
  const { values: options } = parseArgs({
    options: {
      kind: { type: 'string', default: 'noop' },
      args: { type: 'string', default: '{}' },
      queue: { type: 'string', default: 'default' },
      timeout: { type: 'string', default: '30' },
    },
  });
  const timeoutSecs = Number(options.timeout);
  const client = new pg.Client({
    connectionString: process.env.DATABASE_URL || DATABASE_URL_DEFAULT,
  });
  await client.connect();
  try {
    // Each statement commits at once: the enqueue must commit before a worker sees the job.
    const { rows } = await client.query(
      'SELECT skiplock.enqueue($1, $2::jsonb, queue => $3, traceparent => $4,'
        + ' tracestate => $5) AS id',
      [options.kind, JSON.parse(options.args), options.queue,
        process.env.TRACEPARENT || null, process.env.TRACESTATE || null],
    );
    const jobId = Number(rows[0].id);
    console.error(`job ${jobId} enqueued; waiting up to ${timeoutSecs} s`);
    const row = await waitFor(client, jobId, timeoutSecs * 1000);
    if (row === undefined) {
      console.error(`job ${jobId} is not there: deleted or pruned`);
      return 2;
    }
    if (row === 'timeout') {
      console.error(`job ${jobId} had not finished after ${timeoutSecs} s; left as it is`);
      return 2;
    }
    console.log(JSON.stringify({ id: jobId, ...row }));
    return row.state === 'succeeded' ? 0 : 1;
  } finally {
    await client.end();
  }
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(`error: ${error.message}`);
    process.exit(1);
  },
);
