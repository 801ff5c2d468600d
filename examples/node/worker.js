#!/usr/bin/env node
// A skiplock worker in Node.js, on the SQL worker protocol (docs/sql.md).
//
//   npm ci
//   node worker.js --queue default
//
// DATABASE_URL defaults to postgres://postgres@127.0.0.1:5432/postgres, as `skiplock` does.
// See README.md beside this file for what it does and how to run it in production.
//
// Three database sessions:
// - the main loop claims batches with skiplock.claim and runs up to --concurrency jobs at
//   once;
// - the completer saves outcomes in batches (skiplock.complete_many, skiplock.fail_many),
//   so a claim and a completion are in flight at once and a batch costs two round trips;
// - the keeper heartbeats the claims held and calls skiplock.maintain now and then, so the
//   claims of crashed workers are taken back even with no skiplock process running. If
//   heartbeats fail for half of stale_after, the worker aborts its jobs and claims nothing
//   until they work again: a job must never run on unseen while its claim may be taken back.
//
// Every session runs READ COMMITTED whatever the database's default (skiplock's functions
// are written for it), uses no named prepared statements (no `name` is ever passed to
// query(), so PgBouncer in transaction mode works), and survives errors of the server
// (serialization failures, deadlocks, timeouts, restarts) by retrying with backoff and
// reconnecting. SIGTERM or SIGINT: the running jobs finish, the claimed jobs not yet started
// are released, the outcomes are saved, exit 0; a second signal also aborts the running jobs.
'use strict';

const os = require('node:os');
const { parseArgs } = require('node:util');
const { setTimeout: sleepMs } = require('node:timers/promises');
const pg = require('pg');

// The database `skiplock` itself uses when DATABASE_URL is unset.
const DATABASE_URL_DEFAULT = 'postgres://postgres@127.0.0.1:5432/postgres';
// A claim whose heartbeat is older than stale_after is taken back by skiplock.maintain and
// the job runs again elsewhere. --stale-after sets it (the same on every worker of the
// database); this worker heartbeats six times and calls maintain twice within it.
const STALE_AFTER_SECS_DEFAULT = 30;
const HEARTBEATS_PER_STALE_AFTER = 6;
const MAINTAINS_PER_STALE_AFTER = 2;
// Heartbeats failing for this share of stale_after: abort the jobs, claim nothing. Half
// leaves the other half for the jobs to stop before their claims can be taken back.
const HEARTBEAT_FAILURE_LIMIT = 0.5;
// A handler still running at this share of stale_after without a heartbeat ignored its abort:
// the process exits rather than run the job beside its retry.
const HANDLER_STOP_LIMIT = 0.8;
// With no job to run, wait this long for a skiplock_runnable notification before claiming
// again (jobs that become due by their scheduled_at announce nothing).
const IDLE_POLL_MS = 1000;
// The most outcomes saved in one statement.
const SAVE_BATCH_MAX = 1000;
// Backoff between attempts at a statement that failed for a passing reason.
const RETRY_DELAY_MIN_MS = 50;
const RETRY_DELAY_MAX_MS = 5000;

// Errors of the server or the session, not of the statement: retried. Serialization
// failure, deadlock, lock_timeout, statement_timeout, shutdowns and restarts, a read-only
// server (a standby, a failover), a prepared statement a pooler lost; classes 08
// (connection) and 53 (insufficient resources). The Rust worker retries the same
// (src/error.rs).
const TRANSIENT_SQLSTATES = new Set(['40001', '40P01', '55P03', '57014', '57P01', '57P02', '57P03',
  '57P05', '25006', '25P03', '26000']);
const TRANSIENT_CLASSES = ['08', '53'];

// Sent in the startup packet of a direct connection: READ COMMITTED for the session whatever
// the database's or role's default, and a marker that says the options arrived (a pooler
// refuses or drops them; then each call runs in a transaction of its own that pins it).
const PINNED_OPTIONS = '-c default_transaction_isolation=read\\ committed -c skiplock.session_pinned=on';

// Handlers: kind -> async (args, job) => output (any JSON) or throw.
// job.signal is aborted when the job must stop (its claim was lost, heartbeats failed, a
// second signal); long handlers pass it on.
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
  // Returns the W3C trace context the job was enqueued with: what a handler passes on, as
  // the traceparent and tracestate headers of an HTTP call it makes, or as the TRACEPARENT
  // and TRACESTATE environment variables of a program it starts (OpenTelemetry's carriers).
  echo_trace: async (args, job) => ({ traceparent: job.traceparent, tracestate: job.tracestate }),
  // The first attempt hangs until it is aborted (its claim was lost, or heartbeats failed);
  // later attempts succeed. For tests of the reaper.
  hang_once: async (args, job) => {
    if (job.attempt === 1) {
      await new Promise((resolve, reject) => {
        if (job.signal.aborted) reject(job.signal.reason);
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
    // Jobs claimed at once (1 to 10000): small for long jobs, large for short ones.
    batch: { type: 'string', default: process.env.SKIPLOCK_BATCH ?? '100' },
    // Jobs run at once.
    concurrency: { type: 'string', default: process.env.SKIPLOCK_CONCURRENCY ?? '10' },
    name: { type: 'string', default: process.env.SKIPLOCK_WORKER ?? `node-${os.hostname()}-${process.pid}` },
    // Seconds without a heartbeat after which maintain takes a claim back.
    'stale-after': { type: 'string', default: process.env.SKIPLOCK_STALE_AFTER ?? String(STALE_AFTER_SECS_DEFAULT) },
    // Exit 0 once a claim finds nothing to take.
    'exit-when-idle': { type: 'boolean', default: !['', '0', 'false'].includes(process.env.SKIPLOCK_EXIT_WHEN_IDLE ?? '') },
    // DEBUG, INFO (a line per job), WARNING or ERROR.
    'log-level': { type: 'string', default: process.env.SKIPLOCK_LOG_LEVEL ?? 'INFO' },
  },
});

const LEVELS = { DEBUG: 10, INFO: 20, WARN: 30, WARNING: 30, ERROR: 40, CRITICAL: 50 };
const minLevel = LEVELS[opts['log-level'].toUpperCase()];
const log = (level, message) => {
  if (LEVELS[level] >= minLevel) process.stderr.write(`${new Date().toISOString()} ${opts.name} ${level} ${message}\n`);
};
const infoEnabled = LEVELS.INFO >= minLevel;
function usage(message) {
  process.stderr.write(`worker.js: ${message}\n`);
  process.exit(2);
}
if (minLevel === undefined) usage(`unknown --log-level ${opts['log-level']}`);
const kinds = opts.kinds.split(',').filter(Boolean);
for (const kind of kinds) if (!handlers[kind]) usage(`no handler for kind ${kind}`);
const batchSize = Number(opts.batch);
if (!(Number.isInteger(batchSize) && batchSize >= 1 && batchSize <= 10000)) usage('--batch must be between 1 and 10000');
const concurrency = Number(opts.concurrency);
if (!(Number.isInteger(concurrency) && concurrency >= 1)) usage('--concurrency must be a positive integer');
const staleAfterSecs = Number(opts['stale-after']);
if (!(staleAfterSecs > 0)) usage(`--stale-after is ${opts['stale-after']}, it must be a positive number of seconds`);
const staleAfterMs = staleAfterSecs * 1000;

function describe(error) {
  const text = String(error?.message ?? error).split('\n')[0];
  return error?.code ? `${text} (${/^[0-9A-Z]{5}$/.test(error.code) ? 'SQLSTATE ' : ''}${error.code})` : text;
}

// The URL without its password, for the log.
function safeUrl(url) {
  try {
    const parsed = new URL(url);
    if (parsed.password) parsed.password = '***';
    return parsed.toString();
  } catch {
    return url;
  }
}

// Resolves after ms, or at once when wake() is called (a signal, a saved batch, a slot).
let wakers = [];
function wake() {
  const current = wakers;
  wakers = [];
  for (const resolve of current) resolve();
}
function napUnlessWoken(ms) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    wakers.push(() => {
      clearTimeout(timer);
      resolve();
    });
  });
}

// A claimed job. bigint ids come back from pg as strings.
class Job {
  constructor(row) {
    this.id = row.id;
    this.kind = row.kind;
    this.args = row.args;
    this.attempt = row.attempt;
    this.claim_token = row.claim_token;
    this.traceparent = row.traceparent;
    this.tracestate = row.tracestate;
    this.started = null;
    this.finished = false;
    this.aborted = null; // why it must stop, once it must
    this.controller = null;
  }

  // The AbortSignal handlers pass on, made when first asked for: most short jobs never do,
  // and an AbortController per job was a tenth of the worker's CPU in a no-op drain.
  get signal() {
    if (this.controller === null) {
      this.controller = new AbortController();
      if (this.aborted) this.controller.abort(this.aborted);
    }
    return this.controller.signal;
  }

  abort(reason) {
    if (this.aborted) return;
    this.aborted = reason;
    this.controller?.abort(reason);
  }
}

// One database session of the worker: connects (and reconnects), pins READ COMMITTED, runs
// each skiplock call unnamed, and retries the errors that pass (TRANSIENT_SQLSTATES, a lost
// connection) with backoff.
class Session {
  constructor(url, name, { listen = false, onNotification = null } = {}) {
    this.url = url;
    this.name = name;
    this.listen = listen;
    this.onNotification = onNotification;
    this.client = null;
    this.pooled = null;
    // Whether the last call lost its connection: a retry that finds a claim gone may be
    // that write's own doing.
    this.replyLost = false;
  }

  async open(withOptions) {
    const client = new pg.Client({
      connectionString: this.url,
      application_name: this.name,
      options: withOptions ? PINNED_OPTIONS : undefined,
      keepAlive: true,
      keepAliveInitialDelayMillis: 10000,
      connectionTimeoutMillis: 10000,
    });
    // A lost connection is reported here as well as to the query in flight: without a
    // listener Node would end the process.
    client.on('error', () => {
      client.broken = true;
    });
    client.on('end', () => {
      client.broken = true;
    });
    try {
      await client.connect();
    } catch (error) {
      client.end().catch(() => {});
      throw error;
    }
    return client;
  }

  async connect() {
    let client;
    let pooled;
    try {
      client = await this.open(true);
      const { rows } = await client.query("SELECT current_setting('skiplock.session_pinned', true) AS pinned");
      pooled = rows[0].pinned !== 'on';
    } catch (error) {
      if (!/unsupported startup parameter/.test(String(error?.message))) throw error;
      client = await this.open(false);
      pooled = true;
    }
    if (pooled !== this.pooled) {
      log('INFO', `${this.name}: ${pooled
        ? 'a pooler in front (startup options refused or dropped): each call in a transaction of its own at READ COMMITTED, no LISTEN'
        : 'direct connection, session pinned to READ COMMITTED'}`);
    }
    this.pooled = pooled;
    if (this.listen && !pooled) {
      client.on('notification', this.onNotification);
      await client.query('LISTEN skiplock_runnable');
    }
    this.client = client;
    this.everConnected = true;
  }

  close() {
    const client = this.client;
    this.client = null;
    if (client) client.end().catch(() => {});
  }

  async run(sql, params) {
    const client = this.client;
    if (!this.pooled) return (await client.query(sql, params)).rows;
    // Behind a pooler the session is not ours from one transaction to the next: pin the
    // isolation in each transaction.
    await client.query('BEGIN ISOLATION LEVEL READ COMMITTED');
    try {
      const { rows } = await client.query(sql, params);
      await client.query('COMMIT');
      return rows;
    } catch (error) {
      if (!client.broken) await client.query('ROLLBACK').catch(() => {});
      throw error;
    }
  }

  transient(error) {
    if (this.client === null || this.client.broken) return true;
    if (error instanceof pg.DatabaseError) {
      const code = error.code ?? '';
      return TRANSIENT_SQLSTATES.has(code) || TRANSIENT_CLASSES.some((c) => code.startsWith(c));
    }
    // Not from the server: the connection (refused, reset, timed out, ended).
    return /^E[A-Z]+$/.test(error?.code ?? '') || /connect|terminat|timeout|not queryable/i.test(String(error?.message));
  }

  // The rows of one statement. A transient error is retried with backoff until it passes
  // (retry) or thrown at once; giveUp() true ends the retries.
  async call(what, sql, params, { retry = true, retryTimeouts = true, giveUp = () => false } = {}) {
    let delay = RETRY_DELAY_MIN_MS;
    this.replyLost = false;
    for (;;) {
      try {
        if (this.client === null || this.client.broken) {
          const again = this.client !== null || this.everConnected;
          this.close();
          await this.connect();
          if (again) log('WARN', `${this.name}: connected again`);
        }
        return await this.run(sql, params);
      } catch (error) {
        if (!this.transient(error)) throw error;
        if (error.code === '57014' && !retryTimeouts) throw error;
        if (this.client === null || this.client.broken) {
          this.replyLost = true;
          this.close();
        }
        if (!retry || giveUp()) throw error;
        log('WARN', `${what}: ${describe(error)}; again in ${(delay / 1000).toFixed(2)} s`);
        await napUnlessWoken(delay);
        if (giveUp()) throw error;
        delay = Math.min(delay * 2, RETRY_DELAY_MAX_MS) * (0.8 + Math.random() * 0.4);
      }
    }
  }
}

class Worker {
  constructor(url) {
    this.url = url;
    this.stopping = false; // first signal: stop claiming
    this.hardStop = false; // second signal: abort the running jobs too
    this.done = false; // the main loop is over: the keeper ends
    this.heartbeatsFailing = false;
    this.held = new Map(); // id -> job: claimed, outcome not yet saved
    this.running = new Set(); // jobs whose handler runs now
    this.buffer = []; // claimed, not started
    this.outcomes = []; // { job, ok, value }
    this.completerEnd = false;
    this.lastHeartbeat = Date.now(); // when the claims held were last confirmed
    this.claimSize = batchSize;
    this.counts = { succeeded: 0, failed: 0, released: 0, lost: 0 };
    this.main = new Session(url, opts.name, { listen: true, onNotification: wake });
  }

  // ---- the main loop: claim, run ------------------------------------------------------

  async run() {
    await this.main.connect();
    const completer = this.completeOutcomes();
    const keeper = this.keepClaims();
    const watchdog = setInterval(() => this.watchHeartbeats(), Math.min(250, staleAfterMs / 20));
    const started = Date.now();
    log('INFO', `worker started: queue ${opts.queue}, kinds ${kinds}, batch ${batchSize}, concurrency ${concurrency}, stale after ${staleAfterSecs} s, database ${safeUrl(this.url)}`);
    try {
      while (!this.stopping) {
        if (this.heartbeatsFailing || this.held.size >= 2 * batchSize + concurrency
            || this.running.size >= concurrency) {
          await napUnlessWoken(100);
          continue;
        }
        if (this.buffer.length === 0) {
          const jobs = await this.claim();
          if (jobs.length === 0) {
            if (this.held.size > 0) {
              // Running jobs, or outcomes not yet saved, may let more jobs run (the next of
              // a lane).
              await napUnlessWoken(100);
            } else if (opts['exit-when-idle'] && await this.hasWork()) {
              // Another worker's running jobs may let more jobs go (a lane's next job, a
              // child), or jobs wait for their key's room: not idle yet.
              await napUnlessWoken(100);
            } else if (opts['exit-when-idle']) {
              const left = await this.leftBehind();
              log('INFO', `nothing to claim: exiting (--exit-when-idle)${left ? ` (${left})` : ''}`);
              this.stopping = true;
            } else {
              await napUnlessWoken(IDLE_POLL_MS);
            }
            continue;
          }
          this.buffer.push(...jobs);
        }
        while (this.buffer.length > 0 && this.running.size < concurrency && !this.stopping
               && !this.heartbeatsFailing) {
          const job = this.buffer.shift();
          if (job.aborted) {
            this.forget(job, 'claim lost before it started');
          } else {
            this.start(job);
          }
        }
        if (this.buffer.length > 0 && (this.stopping || this.heartbeatsFailing)) {
          await this.giveBack(this.buffer.splice(0));
        }
        // Let the jobs just started run their synchronous part before claiming again.
        await new Promise(setImmediate);
      }
      await this.giveBack(this.buffer.splice(0));
      while (this.running.size > 0) await napUnlessWoken(100);
    } finally {
      this.completerEnd = true;
      wake();
      await completer;
      this.done = true;
      clearInterval(watchdog);
      wake();
      await keeper;
      this.main.close();
    }
    const c = this.counts;
    const seconds = (Date.now() - started) / 1000;
    const ended = c.succeeded + c.failed + c.released;
    log('INFO', `worker stopped: ${c.succeeded} succeeded, ${c.failed} failed, ${c.released} released, ${c.lost} claims lost; ${ended} jobs in ${seconds.toFixed(1)} s (${seconds > 0 ? Math.round(ended / seconds) : 0} jobs/s)`);
  }

  async claim() {
    let rows;
    try {
      rows = await this.main.call(
        'claim',
        'SELECT id, kind, args, attempt, claim_token, traceparent, tracestate'
          + ' FROM skiplock.claim($1, $2, $3, $4)',
        [opts.queue, this.claimSize, opts.name, kinds],
        { retryTimeouts: this.claimSize === 1, giveUp: () => this.stopping },
      );
    } catch (error) {
      if (error.code === '57014') {
        this.claimSize = Math.max(1, Math.floor(this.claimSize / 2));
        log('WARN', `claim: statement_timeout stopped a claim; claiming ${this.claimSize} at once from now on`);
        return [];
      }
      if (this.stopping && this.main.transient(error)) return [];
      throw error;
    }
    return rows.map((row) => {
      const job = new Job(row);
      this.held.set(job.id, job);
      return job;
    });
  }

  // Whether the queue still has work for this worker's kinds, now or once what runs
  // anywhere ends (skiplock.has_work): asked before exiting when idle.
  async hasWork() {
    const rows = await this.main.call(
      'has_work',
      'SELECT skiplock.has_work($1, $2) AS busy',
      [[opts.queue], kinds],
      { giveUp: () => this.stopping },
    );
    return rows[0].busy;
  }

  // What exiting when idle leaves behind (a paused queue's jobs, retries in their backoff,
  // jobs scheduled later), as the line to log, or null: skiplock.left_behind, which
  // `skiplock work` and the Python example print too.
  async leftBehind() {
    const rows = await this.main.call(
      'left_behind',
      'SELECT skiplock.left_behind($1, $2) AS left',
      [[opts.queue], kinds],
      { giveUp: () => this.stopping },
    );
    return rows[0].left;
  }

  start(job) {
    this.running.add(job);
    this.runJob(job).finally(() => {
      this.running.delete(job);
      wake();
    });
  }

  async runJob(job) {
    job.started = Date.now();
    // The enqueuer's trace (its traceparent), so that a log line finds the request.
    if (infoEnabled) {
      const trace = job.traceparent ? ` in trace ${job.traceparent}` : '';
      log('INFO', `job ${job.id} (${job.kind}) attempt ${job.attempt} started${trace}`);
    }
    let output;
    try {
      output = await handlers[job.kind](job.args, job);
    } catch (error) {
      job.finished = true;
      if (job.aborted) {
        this.forget(job, 'stopped; its outcome is not saved');
        return;
      }
      // last_error gets the message; the stack goes to this worker's log.
      const message = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
      log('WARN', `job ${job.id} (${job.kind}) attempt ${job.attempt} failed: ${message}\n${error?.stack ?? ''}`);
      this.outcomes.push({ job, ok: false, value: message });
      wake();
      return;
    }
    job.finished = true;
    this.outcomes.push({ job, ok: true, value: output });
    wake();
  }

  forget(job, why) {
    this.held.delete(job.id);
    this.counts.lost += 1;
    log('WARN', `job ${job.id} (${job.kind}) attempt ${job.attempt}: ${why}`);
  }

  // Releases claimed jobs not started: queued again at once, attempt not counted. With
  // heartbeats failing, one attempt: the database is likely out of reach, and maintain takes
  // the claims back anyway.
  async giveBack(jobs) {
    const retry = !this.heartbeatsFailing;
    for (let i = 0; i < jobs.length; i += 1) {
      const job = jobs[i];
      if (!this.held.delete(job.id)) continue;
      try {
        await this.main.call('release', 'SELECT skiplock.release($1, $2)', [job.id, job.claim_token],
          { retry, giveUp: () => this.hardStop });
        this.counts.released += 1;
      } catch (error) {
        for (const other of jobs.slice(i + 1)) this.held.delete(other.id);
        log('WARN', `${jobs.length - i} claimed jobs not released (${describe(error)}): maintain takes them back after ${staleAfterSecs} s`);
        return;
      }
    }
  }

  // ---- the completer: save outcomes in batches ----------------------------------------

  async completeOutcomes() {
    const session = new Session(this.url, `${opts.name} (completer)`);
    for (;;) {
      if (this.outcomes.length === 0) {
        if (this.completerEnd) break;
        await napUnlessWoken(100);
        continue;
      }
      const batch = this.outcomes.splice(0, SAVE_BATCH_MAX);
      try {
        await this.save(session, batch.filter((o) => o.ok), true);
        await this.save(session, batch.filter((o) => !o.ok), false);
      } catch (error) {
        // Refused for good (or given up on a hard stop): the claims stay running until
        // maintain takes them back.
        log('ERROR', `saving ${batch.length} outcomes failed: ${describe(error)}; maintain takes their jobs back after ${staleAfterSecs} s`);
        for (const { job } of batch) this.held.delete(job.id);
      }
      wake();
    }
    session.close();
  }

  async save(session, items, ok) {
    if (items.length === 0) return;
    const ids = items.map((o) => o.job.id);
    const tokens = items.map((o) => o.job.claim_token);
    let sql;
    let params;
    if (ok) {
      const outputs = items.map((o) => (o.value == null ? null : JSON.stringify(o.value)));
      sql = 'SELECT id, state::text AS state FROM skiplock.complete_many($1::bigint[], $2::uuid[], $3::jsonb[])';
      params = [ids, tokens, outputs.some((o) => o !== null) ? outputs : null];
    } else {
      sql = 'SELECT id, state::text AS state FROM skiplock.fail_many($1::bigint[], $2::uuid[], $3::text[])';
      params = [ids, tokens, items.map((o) => o.value)];
    }
    let rows;
    try {
      rows = await session.call(ok ? 'complete_many' : 'fail_many', sql, params,
        { retryTimeouts: items.length === 1, giveUp: () => this.hardStop });
    } catch (error) {
      if (error.code !== '57014') throw error;
      // statement_timeout: save the halves, each faster.
      log('WARN', `saving ${items.length} outcomes took longer than statement_timeout; in halves`);
      const half = Math.floor(items.length / 2);
      await this.save(session, items.slice(0, half), ok);
      await this.save(session, items.slice(half), ok);
      return;
    }
    for (const { job } of items) this.held.delete(job.id);
    items.forEach(({ job }, i) => {
      const { state } = rows[i];
      if (ok && state === 'succeeded') {
        this.counts.succeeded += 1;
        if (infoEnabled) log('INFO', `job ${job.id} (${job.kind}) succeeded in ${Date.now() - job.started} ms`);
      } else if (!ok && ['queued', 'dead', 'cancelled'].includes(state)) {
        this.counts.failed += 1;
        log('WARN', `job ${job.id} (${job.kind}) attempt ${job.attempt} failed: now ${state === 'queued' ? 'queued to run again' : state}`);
      } else if (state === null && session.replyLost) {
        log('WARN', `job ${job.id} (${job.kind}): the connection dropped as its outcome was saved: saved then, or its claim was lost`);
      } else if (state === null) {
        this.counts.lost += 1;
        log('WARN', `job ${job.id} (${job.kind}): claim lost before its outcome was saved (reaped or cancelled); outcome dropped`);
      } else {
        log('ERROR', `job ${job.id} (${job.kind}): its outcome could not be saved; now ${state} (see its last_error)`);
      }
    });
  }

  // ---- the keeper: heartbeats and maintain --------------------------------------------

  async keepClaims() {
    const session = new Session(this.url, `${opts.name} (heartbeat)`);
    const interval = staleAfterMs / HEARTBEATS_PER_STALE_AFTER;
    let nextMaintain = Date.now();
    let wait = interval;
    for (;;) {
      const until = Date.now() + wait;
      while (!this.done && Date.now() < until) await napUnlessWoken(until - Date.now());
      if (this.done) break;
      wait = interval;
      const held = [...this.held.values()];
      try {
        // Called with no claim too: then it says whether the database answers, which
        // decides whether to claim again after heartbeats failed.
        const rows = await session.call(
          'heartbeat',
          'SELECT id, held FROM skiplock.heartbeat($1::bigint[], $2::uuid[])',
          [held.map((j) => j.id), held.map((j) => j.claim_token)],
          { retry: false },
        );
        held.forEach((job, i) => {
          if (!rows[i].held) this.lose(job);
        });
        this.lastHeartbeat = Date.now();
        if (this.heartbeatsFailing) {
          this.heartbeatsFailing = false;
          log('WARN', 'heartbeats work again: claiming again');
          wake();
        }
        if (Date.now() >= nextMaintain) {
          await this.maintain(session);
          nextMaintain = Date.now() + staleAfterMs / MAINTAINS_PER_STALE_AFTER;
        }
      } catch (error) {
        log('WARN', `heartbeat: ${describe(error)} (the last one ${((Date.now() - this.lastHeartbeat) / 1000).toFixed(1)} s ago)`);
        wait = Math.min(interval, 500);
      }
    }
    session.close();
  }

  // The claim is gone (reaped, cancelled): the job is aborted and saves nothing (a job that
  // already finished has its outcome refused by the claim's token).
  lose(job) {
    if (this.held.get(job.id) !== job || job.aborted) return;
    job.abort(new Error('claim lost'));
    if (!job.finished) log('WARN', `job ${job.id}: claim lost (reaped or cancelled); stopping it`);
  }

  async maintain(session) {
    const [row] = await session.call(
      'maintain',
      'SELECT reaped, moved_on, cron_enqueued FROM skiplock.maintain(make_interval(secs => $1))',
      [staleAfterSecs],
      { retry: false },
    );
    if (row.reaped !== '0') log('INFO', `maintain: took back ${row.reaped} stale claims, moved on ${row.moved_on} jobs`);
    if (row.cron_enqueued !== '0') log('INFO', `maintain: enqueued ${row.cron_enqueued} cron jobs`);
  }

  // ---- the watchdog: the heartbeat rule -----------------------------------------------

  // Heartbeats failing for HEARTBEAT_FAILURE_LIMIT of stale_after: claim nothing, abort the
  // running jobs, give back the others. A handler that ignores its abort until
  // HANDLER_STOP_LIMIT ends the process: its claim may be taken back any moment and the job
  // run elsewhere. On a timer of its own, so that a heartbeat stuck on a dead network does
  // not hold it.
  watchHeartbeats() {
    const silent = Date.now() - this.lastHeartbeat;
    if (silent > staleAfterMs * HEARTBEAT_FAILURE_LIMIT && !this.heartbeatsFailing) {
      this.heartbeatsFailing = true;
      const running = [...this.running];
      log('ERROR', `HEARTBEATS FAILING for ${(silent / 1000).toFixed(1)} s (claims are taken back after ${staleAfterSecs} s without one): aborting ${running.length} running jobs${running.length ? ` (${running.map((j) => j.id)})` : ''}, claiming nothing until they work again`);
      for (const job of [...running, ...this.buffer]) job.abort(new Error('heartbeats failing'));
      wake();
    }
    if (this.heartbeatsFailing && silent > staleAfterMs * HANDLER_STOP_LIMIT) {
      const stuck = [...this.running].filter((job) => job.aborted);
      if (stuck.length > 0) {
        log('CRITICAL', `jobs ${stuck.map((j) => `${j.id} (${j.kind})`)} ignored their abort for ${((silent - staleAfterMs * HEARTBEAT_FAILURE_LIMIT) / 1000).toFixed(1)} s without a heartbeat; exiting so that they cannot run beside their retry`);
        process.exit(3);
      }
    }
  }

  signal(name) {
    if (!this.stopping) {
      log('INFO', `${name}: stopping (the running jobs finish; again to abort them too)`);
      this.stopping = true;
    } else {
      log('WARN', `${name} again: aborting the running jobs`);
      this.hardStop = true;
      for (const job of this.running) job.abort(new Error('stopped'));
    }
    wake();
  }
}

async function main() {
  const url = process.env.DATABASE_URL || DATABASE_URL_DEFAULT;
  if (!process.env.DATABASE_URL) log('INFO', `DATABASE_URL is not set: using ${DATABASE_URL_DEFAULT}`);
  const worker = new Worker(url);
  for (const name of ['SIGTERM', 'SIGINT']) process.on(name, () => worker.signal(name));
  try {
    await worker.run();
  } catch (error) {
    if (error instanceof pg.DatabaseError && ['42883', '3F000', '42P01'].includes(error.code)) {
      log('ERROR', `stopped by an error no retry mends: ${describe(error)} (is the schema migrated? \`skiplock migrate\`)`);
    } else if (error instanceof pg.DatabaseError) {
      log('ERROR', `stopped by an error no retry mends: ${describe(error)}`);
    } else if (/^E[A-Z]+$/.test(error?.code ?? '') || /connect|terminat|timeout/i.test(String(error?.message))) {
      log('ERROR', `cannot reach the database at ${safeUrl(url)}: ${describe(error)} (set DATABASE_URL)`);
    } else {
      log('ERROR', error?.stack ?? String(error));
    }
    process.exit(1);
  }
  process.exit(0);
}

main();
