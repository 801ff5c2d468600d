//! The trace a job belongs to (`skiplock.jobs.traceparent`, `tracestate`): every entry
//! point stores it, a claim (the worker's and `skiplock.claim`) hands it over, the handler
//! reads it, and under the `opentelemetry` feature an enqueue records the current span's
//! context and each attempt's span is a child of the span that enqueued, as an in-memory
//! span exporter behind `tracing-opentelemetry` shows.

mod common;

use std::time::Duration;

use common::fixtures::{Recorder, fast_worker, state_of, wait_for};
use common::test_db;
use serde_json::json;
use skiplock::{EnqueueOptions, JobId, JobState, NewJob, TraceContext};
use sqlx::PgPool;

/// A W3C traceparent as an incoming request might carry it.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE_ID}-{PARENT_ID}-01")
}

/// The job's stored trace context.
async fn stored(pool: &PgPool, id: JobId) -> (Option<String>, Option<String>) {
    sqlx::query_as("SELECT traceparent, tracestate FROM skiplock.jobs WHERE id = $1")
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn until_succeeded(pool: &PgPool, id: JobId) {
    wait_for("the job to succeed", Duration::from_secs(60), || async {
        state_of(pool, id.0).await == JobState::Succeeded
    })
    .await;
}

#[tokio::test]
async fn every_entry_point_stores_the_trace_context_and_a_sql_claim_returns_it() {
    let db = test_db().await;
    let from_sql: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', '{}', traceparent => $1, tracestate => 'congo=t61')",
    )
    .bind(traceparent())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let from_insert: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, traceparent) VALUES ('noop', $1) RETURNING id",
    )
    .bind(traceparent())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let context = TraceContext::from_headers(&traceparent(), Some("congo=t61")).unwrap();
    let from_rust = skiplock::enqueue_raw(
        &db.pool,
        &[
            NewJob::new("noop", json!({}))
                .with_options(EnqueueOptions::new().trace_context(context.clone())),
            // The per-job path (a unique key) stores it too.
            NewJob::new("noop", json!({})).with_options(
                EnqueueOptions::new()
                    .trace_context(context.clone())
                    .unique_key("k", skiplock::UniquePolicy::Skip),
            ),
        ],
    )
    .await
    .unwrap();
    let with_state = (Some(traceparent()), Some("congo=t61".to_owned()));
    assert_eq!(stored(&db.pool, JobId(from_sql)).await, with_state);
    assert_eq!(
        stored(&db.pool, JobId(from_insert)).await,
        (Some(traceparent()), None)
    );
    assert_eq!(stored(&db.pool, from_rust[0].id).await, with_state);
    assert_eq!(stored(&db.pool, from_rust[1].id).await, with_state);

    let claimed: Vec<(i64, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT id, traceparent, tracestate FROM skiplock.claim('default', 10, 'test')
         ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(claimed.len(), 4);
    assert_eq!(
        (claimed[0].0, claimed[0].1.clone(), claimed[0].2.clone()),
        (from_sql, with_state.0.clone(), with_state.1.clone())
    );
    assert_eq!(claimed[1].2, None);
}

#[tokio::test]
async fn a_job_enqueued_outside_any_trace_stores_none() {
    let db = test_db().await;
    let id = skiplock::enqueue_raw(&db.pool, &[NewJob::new("noop", json!({}))])
        .await
        .unwrap()[0]
        .id;
    assert_eq!(stored(&db.pool, id).await, (None, None));
}

#[tokio::test]
async fn an_oversized_trace_context_is_refused_by_the_table_naming_its_limit() {
    let db = test_db().await;
    for (column, limit) in [("traceparent", 512), ("tracestate", 8192)] {
        let error = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO skiplock.jobs (kind, {column}) VALUES ('noop', $1)"
        )))
        .bind("x".repeat(limit + 1))
        .execute(&db.pool)
        .await
        .unwrap_err()
        .to_string();
        assert!(
            error.contains(&format!("jobs_{column}_length")),
            "{column}: {error}"
        );
    }
    assert_eq!(db.job_count().await, 0);
}

/// Records what the handler saw of its trace.
#[derive(serde::Serialize, serde::Deserialize)]
struct SeesTrace {}

type Seen = std::sync::Arc<std::sync::Mutex<Vec<Option<TraceContext>>>>;

impl skiplock::Job for SeesTrace {
    const KIND: &'static str = "sees_trace";
    async fn run(self, ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        let seen = ctx.data::<Seen>().unwrap();
        seen.lock().unwrap().push(ctx.trace_context().cloned());
        Ok(())
    }
}

#[tokio::test]
async fn the_handler_reads_the_trace_context_its_job_was_enqueued_with() {
    let db = test_db().await;
    let with: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('sees_trace', '{}', traceparent => $1, tracestate => 'a=b')",
    )
    .bind(traceparent())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let without: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('sees_trace', '{}')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let seen = Seen::default();
    let worker = fast_worker(&db.pool, &Recorder::default())
        .data(seen.clone())
        .register::<SeesTrace>()
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let running = tokio::spawn(worker.run());
    until_succeeded(&db.pool, JobId(with)).await;
    until_succeeded(&db.pool, JobId(without)).await;
    stop.shutdown();
    running.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let stored: Vec<_> = seen
        .iter()
        .map(|c| {
            c.as_ref().map(|c| {
                (
                    c.traceparent().to_owned(),
                    c.tracestate().map(str::to_owned),
                )
            })
        })
        .collect();
    assert!(stored.contains(&Some((traceparent(), Some("a=b".to_owned())))));
    assert!(stored.contains(&None));
}

/// Spans exported through `tracing-opentelemetry` into memory: the whole test binary
/// shares one global subscriber, so each test finds its own spans by job id or trace id.
#[cfg(feature = "opentelemetry")]
mod opentelemetry_feature {
    use std::sync::OnceLock;

    use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider};
    use opentelemetry::{KeyValue, Value};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use common::fixtures::{Flaky, Record};

    fn exporter() -> InMemorySpanExporter {
        static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
        EXPORTER
            .get_or_init(|| {
                let exporter = InMemorySpanExporter::default();
                let provider = SdkTracerProvider::builder()
                    .with_simple_exporter(exporter.clone())
                    .build();
                let subscriber = tracing_subscriber::registry().with(
                    tracing_opentelemetry::layer().with_tracer(provider.tracer("skiplock-tests")),
                );
                tracing::subscriber::set_global_default(subscriber).unwrap();
                exporter
            })
            .clone()
    }

    /// The exported `job` spans of job `id` of this test, once there are `count`. Each
    /// test has a database of its own, so ids repeat across tests; its worker runs on the
    /// test's own thread (a current-thread runtime), which the layer records by name.
    async fn job_spans(id: JobId, count: usize) -> Vec<SpanData> {
        let exporter = exporter();
        let thread = std::thread::current().name().unwrap().to_owned();
        common::fixtures::wait_until(
            "the job's spans to be exported",
            Duration::from_secs(60),
            || {
                let spans: Vec<SpanData> = exporter
                    .get_finished_spans()
                    .unwrap()
                    .into_iter()
                    .filter(|span| {
                        span.name == "job"
                            && span
                                .attributes
                                .contains(&KeyValue::new("job_id", Value::I64(id.0)))
                            && span
                                .attributes
                                .contains(&KeyValue::new("thread.name", thread.clone()))
                    })
                    .collect();
                async move { (spans.len() >= count).then_some(spans) }
            },
        )
        .await
    }

    async fn run_until_succeeded(pool: &PgPool, ids: &[JobId]) {
        let worker = fast_worker(pool, &Recorder::default()).build().unwrap();
        let stop = worker.shutdown_handle();
        let running = tokio::spawn(worker.run());
        for id in ids {
            until_succeeded(pool, *id).await;
        }
        stop.shutdown();
        running.await.unwrap().unwrap();
    }

    /// Enqueues a `Record` job inside a span of its own; returns the job and the span's
    /// trace and span ids.
    async fn enqueue_in_a_request(
        pool: &PgPool,
        options: EnqueueOptions,
    ) -> (JobId, TraceId, SpanId) {
        exporter();
        let request = tracing::info_span!("request");
        let ids = {
            let context = request.context();
            let span = context.span();
            (
                span.span_context().trace_id(),
                span.span_context().span_id(),
            )
        };
        let id = async {
            skiplock::enqueue(pool, &Record { n: 1 }, options)
                .await
                .unwrap()
                .id
        }
        .instrument(request)
        .await;
        (id, ids.0, ids.1)
    }

    #[tokio::test]
    async fn an_attempt_continues_the_trace_of_the_span_that_enqueued_it() {
        let db = test_db().await;
        let (id, trace, parent) = enqueue_in_a_request(&db.pool, EnqueueOptions::new()).await;
        assert_ne!(trace, TraceId::INVALID);
        assert_eq!(
            stored(&db.pool, id).await.0,
            Some(format!("00-{trace}-{parent}-01"))
        );
        run_until_succeeded(&db.pool, &[id]).await;
        let spans = job_spans(id, 1).await;
        assert_eq!(spans[0].span_context.trace_id(), trace);
        assert_eq!(spans[0].parent_span_id, parent);
    }

    #[tokio::test]
    async fn each_retry_is_a_child_of_the_enqueuer_as_the_first_attempt_is() {
        let db = test_db().await;
        exporter();
        let request = tracing::info_span!("request");
        let (trace, parent) = {
            let context = request.context();
            let span = context.span();
            (
                span.span_context().trace_id(),
                span.span_context().span_id(),
            )
        };
        let id = async {
            skiplock::enqueue(&db.pool, &Flaky { fail_until: 1 }, EnqueueOptions::new())
                .await
                .unwrap()
                .id
        }
        .instrument(request)
        .await;
        run_until_succeeded(&db.pool, &[id]).await;
        let spans = job_spans(id, 2).await;
        for span in &spans {
            assert_eq!(span.span_context.trace_id(), trace);
            assert_eq!(span.parent_span_id, parent);
        }
        assert_ne!(
            spans[0].span_context.span_id(),
            spans[1].span_context.span_id()
        );
    }

    #[tokio::test]
    async fn a_trace_context_given_in_sql_is_continued_with_its_tracestate() {
        let db = test_db().await;
        exporter();
        let id: i64 = sqlx::query_scalar(
            "SELECT skiplock.enqueue('record', '{\"n\": 1}', traceparent => $1,
                                     tracestate => 'congo=t61rcWkgMzE')",
        )
        .bind(traceparent())
        .fetch_one(&db.pool)
        .await
        .unwrap();
        run_until_succeeded(&db.pool, &[JobId(id)]).await;
        let spans = job_spans(JobId(id), 1).await;
        assert_eq!(
            spans[0].span_context.trace_id(),
            TraceId::from_hex(TRACE_ID).unwrap()
        );
        assert_eq!(
            spans[0].parent_span_id,
            SpanId::from_hex(PARENT_ID).unwrap()
        );
        assert!(spans[0].parent_span_is_remote);
        assert_eq!(
            spans[0].span_context.trace_state().header(),
            "congo=t61rcWkgMzE"
        );
    }

    #[tokio::test]
    async fn options_that_name_a_context_win_over_the_current_span() {
        let db = test_db().await;
        let named = TraceContext::from_headers(&traceparent(), None).unwrap();
        let (id, trace, parent) =
            enqueue_in_a_request(&db.pool, EnqueueOptions::new().trace_context(named)).await;
        assert_ne!(trace, TraceId::INVALID, "the request's span is recorded");
        let stored = stored(&db.pool, id).await.0;
        assert_eq!(stored, Some(traceparent()));
        assert_ne!(stored, Some(format!("00-{trace}-{parent}-01")));
    }

    #[tokio::test]
    async fn a_traceparent_that_does_not_parse_starts_a_new_trace_and_the_job_runs() {
        let db = test_db().await;
        exporter();
        // Garbage; ids too short (OpenTelemetry's own parser reads them as numbers and
        // would continue trace ...0001); a character that is not ASCII across a field.
        let mut ids = Vec::new();
        for bad in [
            "not a traceparent",
            "00-1-2-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
        ] {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO skiplock.jobs (kind, args, traceparent, tracestate)
                 VALUES ('record', '{\"n\": 1}', $1, 'a=b') RETURNING id",
            )
            .bind(bad)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            ids.push(JobId(id));
        }
        run_until_succeeded(&db.pool, &ids).await;
        for id in ids {
            let spans = job_spans(id, 1).await;
            assert_eq!(spans[0].parent_span_id, SpanId::INVALID, "job {id}");
            assert!(spans[0].span_context.is_valid());
        }
    }

    #[tokio::test]
    async fn a_job_folded_by_its_unique_key_keeps_the_pending_jobs_trace() {
        let db = test_db().await;
        let options = || EnqueueOptions::new().unique_key("once", skiplock::UniquePolicy::Replace);
        let (first, trace, parent) = enqueue_in_a_request(&db.pool, options()).await;
        let (again, other, _) = enqueue_in_a_request(&db.pool, options()).await;
        assert_eq!(again, first);
        assert_ne!(other, trace);
        assert_eq!(
            stored(&db.pool, first).await.0,
            Some(format!("00-{trace}-{parent}-01"))
        );
    }
}
