#!/usr/bin/env node
// A skiplock worker in Node.js, on the SQL worker protocol (docs/sql.md).
//
//   npm install            # installs pg
//   DATABASE_URL=postgres://... node worker.js --queue default --batch 10
//
// The loop: claim a batch with skiplock.claim, run each job in turn, and end each claim
// with skiplock.complete or skiplock.fail. A timer heartbeats the claims held (a job whose
// claim is gone is aborted) and calls skiplock.maintain now and then, so stale claims of
// crashed workers are taken back even with no skiplock process running. SIGTERM or SIGINT:
// the running job finishes, the claimed jobs not yet started are released, exit 0. With
// --exit-when-idle it also exits 0 once a claim finds nothing to take.
'use strict';

const os = require('node:os');
const { parseArgs } = require('node:util');
const { setTimeout: sleepMs } = require('node:timers/promises');
const pg = require('pg');

// A claim whose heartbeat is older than stale_after is taken back by skiplock.maintain and
// the job runs again elsewhere. --stale-after sets it (the same on every worker of the
// database); this worker heartbeats six times and calls maintain twice within it.
const STALE_AFTER_SECS_DEFAULT = 30;
const HEARTBEATS_PER_STALE_AFTER = 6;
const MAINTAINS_PER_STALE_AFTER = 2;
// With no job to run, wait this long for a skiplock_runnable notification before claiming
// again (jobs that become due by their scheduled_at announce nothing).
const IDLE_POLL_MS = 1000;

// Handlers: kind -> async (args, job) => output (any JSON) or throw.
// job.signal is aborted when the claim is lost; long handlers pass it on.
const handlers = {
  noop: async () => null,
  sleep: async (args, job) => {
    await sleepMs(args.ms, null, { signal: job.signal });
    return null;
  },
  fail_once: async (args, job) => {
    if (job.attempt === 1) throw new Error('planned failure on the first attempt');
    return null;
  },
  // The first attempt hangs until its claim is lost (its worker was killed and the job
  // taken back, say); later attempts succeed. For tests of the reaper.
  hang_once: async (args, job) => {
    if (job.attempt === 1) {
      await new Promise((resolve, reject) => {
        job.signal.addEventListener('abort', () => reject(job.signal.reason), { once: true });
      });
    }
    return null;
  },
};

const { values: opts } = parseArgs({
  options: {
    queue: { type: 'string', default: process.env.SKIPLOCK_QUEUE ?? 'default' },
    kinds: { type: 'string', default: process.env.SKIPLOCK_KINDS ?? Object.keys(handlers).join(',') },
    batch: { type: 'string', default: process.env.SKIPLOCK_BATCH ?? '10' },
    name: { type: 'string', default: process.env.SKIPLOCK_WORKER ?? `node-${os.hostname()}-${process.pid}` },
    // Seconds without a heartbeat after which maintain takes a claim back.
    'stale-after': { type: 'string', default: process.env.SKIPLOCK_STALE_AFTER ?? String(STALE_AFTER_SECS_DEFAULT) },
    // Exit 0 once a claim finds nothing to take.
    'exit-when-idle': { type: 'boolean', default: !['', '0', 'false'].includes(process.env.SKIPLOCK_EXIT_WHEN_IDLE ?? '') },
    // DEBUG, INFO (a line per job), WARNING or ERROR.
    'log-level': { type: 'string', default: process.env.SKIPLOCK_LOG_LEVEL ?? 'INFO' },
  },
});
const kinds = opts.kinds.split(',').filter(Boolean);
const batchSize = Number.parseInt(opts.batch, 10);
const staleAfterSecs = Number(opts['stale-after']);
for (const kind of kinds) {
  if (!handlers[kind]) throw new Error(`no handler for kind ${kind}`);
}
if (!(staleAfterSecs > 0)) throw new Error(`--stale-after is ${opts['stale-after']}, it must be a positive number of seconds`);

const LEVELS = { DEBUG: 10, INFO: 20, WARN: 30, WARNING: 30, ERROR: 40 };
const minLevel = LEVELS[opts['log-level'].toUpperCase()];
if (minLevel === undefined) throw new Error(`unknown --log-level ${opts['log-level']}`);
const log = (level, message) => {
  if (LEVELS[level] >= minLevel) console.error(`${new Date().toISOString()} ${opts.name} ${level} ${message}`);
};

// The claims this worker holds: id -> job. bigint ids come back from pg as strings.
const held = new Map();
let stopping = false;
let wake = () => {};

async function keepClaims(db) {
  if (held.size > 0) {
    const jobs = [...held.values()];
    const { rows } = await db.query(
      'SELECT id, held FROM skiplock.heartbeat($1::bigint[], $2::uuid[])',
      [jobs.map((j) => j.id), jobs.map((j) => j.claim_token)],
    );
    for (const { id, held: stillHeld } of rows) {
      const job = held.get(id);
      if (!stillHeld && job) {
        held.delete(id);
        log('WARN', `job ${id}: claim lost (reaped or cancelled); stopping it`);
        job.abort.abort();
      }
    }
  }
}

async function runJob(db, job) {
  log('INFO', `job ${job.id} (${job.kind}) attempt ${job.attempt} started`);
  const started = Date.now();
  let output;
  try {
    output = await handlers[job.kind](job.args, job);
  } catch (error) {
    if (job.signal.aborted) return; // The claim is gone: another worker owns the job now.
    held.delete(job.id);
    const { rows } = await db.query('SELECT skiplock.fail($1, $2, $3) AS state', [
      job.id, job.claim_token, String(error?.stack ?? error),
    ]);
    log('WARN', `job ${job.id} (${job.kind}) attempt ${job.attempt} failed: ${error}; now ${rows[0].state ?? 'not ours'}`);
    return;
  }
  held.delete(job.id);
  const { rows } = await db.query('SELECT skiplock.complete($1, $2, $3) AS saved', [
    job.id, job.claim_token, output == null ? null : JSON.stringify(output),
  ]);
  if (rows[0].saved) {
    log('INFO', `job ${job.id} (${job.kind}) succeeded in ${Date.now() - started} ms`);
  } else {
    log('WARN', `job ${job.id} (${job.kind}): claim lost before complete; result dropped`);
  }
}

async function main() {
  // One connection for the loop (and LISTEN), one for the heartbeat: a heartbeat must not
  // queue behind a slow query of the loop.
  const db = new pg.Client({ connectionString: process.env.DATABASE_URL, application_name: opts.name });
  const keeper = new pg.Client({ connectionString: process.env.DATABASE_URL, application_name: `${opts.name} (heartbeat)` });
  await db.connect();
  await keeper.connect();

  for (const signal of ['SIGTERM', 'SIGINT']) {
    process.on(signal, () => {
      stopping = true;
      wake();
    });
  }
  const fatal = (error) => {
    log('ERROR', `heartbeat: ${error}`);
    process.exit(1);
  };
  const staleAfterMs = staleAfterSecs * 1000;
  const heartbeat = setInterval(() => keepClaims(keeper).catch(fatal), staleAfterMs / HEARTBEATS_PER_STALE_AFTER);
  const maintain = setInterval(async () => {
    const { rows } = await keeper
      .query(
        'SELECT reaped, moved_on, cron_enqueued FROM skiplock.maintain(make_interval(secs => $1))',
        [staleAfterSecs],
      )
      .catch(fatal);
    if (rows[0].reaped !== '0') {
      log('INFO', `maintain: took back ${rows[0].reaped} stale claims, moved on ${rows[0].moved_on} jobs`);
    }
    if (rows[0].cron_enqueued !== '0') {
      log('INFO', `maintain: enqueued ${rows[0].cron_enqueued} cron jobs`);
    }
  }, staleAfterMs / MAINTAINS_PER_STALE_AFTER);
  db.on('notification', () => wake());
  await db.query('LISTEN skiplock_runnable');
  log('INFO', `worker started: queue ${opts.queue}, kinds ${kinds}, batch ${batchSize}, stale after ${staleAfterSecs} s`);

  while (!stopping) {
    const { rows } = await db.query(
      'SELECT id, kind, args, attempt, claim_token FROM skiplock.claim($1, $2, $3, $4)',
      [opts.queue, batchSize, opts.name, kinds],
    );
    const jobs = rows.map((row) => {
      const abort = new AbortController();
      return { ...row, abort, signal: abort.signal };
    });
    for (const job of jobs) held.set(job.id, job);
    for (const job of jobs) {
      if (stopping) {
        // Not started: give it back at once, its attempt not counted.
        if (held.delete(job.id)) {
          await db.query('SELECT skiplock.release($1, $2)', [job.id, job.claim_token]);
        }
      } else if (!job.signal.aborted) {
        await runJob(db, job);
      }
    }
    if (jobs.length === 0 && opts['exit-when-idle']) {
      stopping = true;
    } else if (jobs.length === 0 && !stopping) {
      // Wait for a job to become runnable (or the next poll, or a signal).
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, IDLE_POLL_MS);
        wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      wake = () => {};
    }
  }

  clearInterval(heartbeat);
  clearInterval(maintain);
  await db.end();
  await keeper.end();
  log('INFO', 'worker stopped');
}

main().catch((error) => {
  log('ERROR', error.stack ?? error);
  process.exit(1);
});
