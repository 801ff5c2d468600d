//! The trace a job belongs to: the W3C Trace Context (`traceparent`, `tracestate`) of the
//! span that enqueued it, stored with the job (`skiplock.jobs.traceparent`, `tracestate`)
//! and handed to each attempt, so that an operator follows a slow request into the work it
//! caused.
//!
//! Any entry point records it: [`EnqueueOptions::trace_context`](crate::EnqueueOptions::trace_context),
//! `skiplock.enqueue(…, traceparent => …)`, a plain `INSERT`. Under the `opentelemetry`
//! feature an enqueue records the current span's context by itself, and the worker's span
//! of each attempt (`job`) is made a child of the span that enqueued: the same trace, the
//! enqueuer's span as parent, each retry a sibling of the others. Without the feature
//! nothing is captured and nothing is parsed: the stored values reach the handler
//! ([`JobContext::trace_context`](crate::JobContext::trace_context)) as they are.

/// Longest `traceparent` stored, in bytes (the table's `jobs_traceparent_length`): a
/// version-00 value is 55; later versions may append fields.
pub const TRACEPARENT_MAX_BYTES: usize = 512;

/// Longest `tracestate` stored, in bytes (`jobs_tracestate_length`). W3C Trace Context lets
/// a carrier drop members past 512 bytes; a longer value is dropped whole when captured.
pub const TRACESTATE_MAX_BYTES: usize = 8192;

/// A W3C trace context as a job carries it: the `traceparent` and `tracestate` headers'
/// values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// A context from the values of the `traceparent` and `tracestate` headers (of an
    /// incoming request, say). `None` when `traceparent` is not a W3C traceparent
    /// (`00-<32 hex>-<16 hex>-<2 hex>`, lowercase, ids not all zero, or a later version
    /// with at least those fields): a receiver ignores such a header and starts a new
    /// trace. An empty `tracestate`, or one over [`TRACESTATE_MAX_BYTES`], is left out.
    ///
    /// ```
    /// use skiplock::TraceContext;
    /// let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let context = TraceContext::from_headers(incoming, Some("congo=t61rcWkgMzE")).unwrap();
    /// assert_eq!(context.traceparent(), incoming);
    /// assert!(TraceContext::from_headers("not a traceparent", None).is_none());
    /// ```
    pub fn from_headers(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim();
        if !is_traceparent(traceparent) {
            return None;
        }
        Some(Self {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate
                .map(str::trim)
                .filter(|state| !state.is_empty() && state.len() <= TRACESTATE_MAX_BYTES)
                .map(str::to_owned),
        })
    }

    /// The stored pair as it is, checked by whoever parses it: what a claim hands over.
    pub(crate) fn stored(traceparent: Option<String>, tracestate: Option<String>) -> Option<Self> {
        traceparent.map(|traceparent| Self {
            traceparent,
            tracestate,
        })
    }

    /// The `traceparent` value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The context of the current `tracing` span as its OpenTelemetry layer knows it
    /// (`tracing-opentelemetry`), its sampled flag included (`-00` for a span the sampler
    /// dropped); `None` outside a span the layer knows, or without the layer. What an
    /// enqueue records when its options name no context.
    #[cfg(feature = "opentelemetry")]
    pub fn current() -> Option<Self> {
        use opentelemetry::propagation::TextMapPropagator;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        let context = tracing::Span::current().context();
        let mut headers = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new()
            .inject_context(&context, &mut headers);
        let traceparent = headers.remove("traceparent")?;
        Self::from_headers(&traceparent, headers.get("tracestate").map(String::as_str))
    }

    /// Makes `span` (not yet entered) a child of this context; a context that does not
    /// parse leaves it a root, as W3C asks of a receiver.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn continue_in(&self, span: &tracing::Span) {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        // The propagator reads ids of any length as numbers: the shape is checked first,
        // so that what starts a new trace is what `from_headers` refuses.
        if !is_traceparent(&self.traceparent) {
            tracing::debug!(
                traceparent = %self.traceparent,
                "the job's traceparent is not a W3C traceparent; its span starts a new trace"
            );
            return;
        }
        let mut headers = std::collections::HashMap::new();
        headers.insert("traceparent".to_owned(), self.traceparent.clone());
        if let Some(state) = &self.tracestate {
            headers.insert("tracestate".to_owned(), state.clone());
        }
        let parent =
            opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&headers);
        if !parent.span().span_context().is_valid() {
            tracing::debug!(
                traceparent = %self.traceparent,
                "the job's traceparent does not parse; its span starts a new trace"
            );
            return;
        }
        // Without an OpenTelemetry layer there is nothing to continue: not an error.
        let _ = span.set_parent(parent);
    }
}

/// The context a handler passes on to what it calls (the built-in kinds: an HTTP request's
/// headers, a program's `TRACEPARENT` and `TRACESTATE`, OpenTelemetry's carriers): the
/// attempt's own span under the `opentelemetry` feature when a layer records it, else the
/// context the job was enqueued with.
#[cfg(any(feature = "http-kind", feature = "command-kind"))]
pub(crate) fn to_pass_on(ctx: &crate::JobContext) -> Option<TraceContext> {
    #[cfg(feature = "opentelemetry")]
    if let Some(current) = TraceContext::current() {
        return Some(current);
    }
    ctx.trace_context().cloned()
}

/// Whether `value` has the shape of a W3C traceparent: `version-traceid-parentid-flags`,
/// lowercase hex, version not `ff`, ids not all zero; version `00` has exactly those four
/// fields, a later one may append more after a `-`.
fn is_traceparent(value: &str) -> bool {
    fn hex(field: &str, len: usize) -> bool {
        field.len() == len
            && field
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }
    if value.len() > TRACEPARENT_MAX_BYTES {
        return false;
    }
    // By bytes: a header is ASCII, and a character that is not must not split a field.
    let (Some(head), Some(rest)) = (value.get(..55), value.get(55..)) else {
        return false;
    };
    let mut fields = head.split('-');
    let (Some(version), Some(trace_id), Some(parent_id), Some(flags), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return false;
    };
    hex(version, 2)
        && version != "ff"
        && hex(trace_id, 32)
        && trace_id.bytes().any(|b| b != b'0')
        && hex(parent_id, 16)
        && parent_id.bytes().any(|b| b != b'0')
        && hex(flags, 2)
        && (rest.is_empty() || (version != "00" && rest.starts_with('-')))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_w3c_traceparent_is_taken_and_anything_else_is_not() {
        assert!(TraceContext::from_headers(VALID, None).is_some());
        assert!(TraceContext::from_headers(&format!(" {VALID} "), None).is_some());
        let later = format!("01{}-what-comes-later", &VALID[2..]);
        assert!(TraceContext::from_headers(&later, None).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-1-2-01",
            // A character that is not ASCII across the 55th byte.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
            "é0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-é",
        ] {
            assert!(TraceContext::from_headers(bad, None).is_none(), "{bad:?}");
        }
        let long = format!("01{}-{}", &VALID[2..], "x".repeat(TRACEPARENT_MAX_BYTES));
        assert!(TraceContext::from_headers(&long, None).is_none());
    }

    #[test]
    fn an_empty_or_oversized_tracestate_is_left_out() {
        let with = |state: &str| {
            TraceContext::from_headers(VALID, Some(state))
                .unwrap()
                .tracestate
        };
        assert_eq!(
            with("congo=t61rcWkgMzE").as_deref(),
            Some("congo=t61rcWkgMzE")
        );
        assert_eq!(with("  "), None);
        assert_eq!(with(&"a".repeat(TRACESTATE_MAX_BYTES + 1)), None);
    }
}
