//! `http`: makes one HTTP request described by the job's args.
//!
//! ```json
//! {"method": "POST", "url": "https://hooks.example.com/x", "headers": {"X-Token": "…"},
//!  "body": {"event": "signup"}, "timeout_ms": 10000}
//! ```
//!
//! - `method` defaults to `GET`; `headers`, `body` and `timeout_ms` are optional. A string
//!   `body` is sent as is; any other JSON value is sent as JSON with
//!   `Content-Type: application/json` (unless the headers name a content type).
//! - A job enqueued in a trace passes it on: `traceparent` and `tracestate` headers (the
//!   attempt's span under the `opentelemetry` feature, else the job's stored context),
//!   unless the job's own headers name a `traceparent` or a `tracestate`.
//! - 2xx succeeds. 408, 429, 5xx, timeouts and network errors fail the attempt as
//!   retryable, after the delay in `Retry-After` when the response has one (seconds or an
//!   HTTP date, at most [`RETRY_AFTER_MAX`]). Any other status is permanent: the job goes
//!   `dead`.
//! - The job's `output` records `{"status", "content_type", "body_prefix",
//!   "body_truncated"}`: at most [`BODY_PREFIX_MAX_BYTES`] of the body are read.
//! - A worker may restrict the hosts jobs can reach with [`HttpConfig::allow_hosts`];
//!   redirects are checked against the same list. A job for another host goes `dead`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::job::{Job, JobContext, JobError};
use crate::trace_context::TraceContext;

/// Timeout of a request whose args give none: connect, send and read the body prefix.
pub const HTTP_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

/// Most bytes of a response body read and recorded in the job's output.
pub const BODY_PREFIX_MAX_BYTES: usize = 4096;

/// Longest `Retry-After` delay honoured; longer ones are cut to this.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(24 * 3600);

/// Redirects followed per request (each checked against the allow-list).
const REDIRECTS_MAX: usize = 10;

/// Characters of the response body quoted in an error message.
const ERROR_BODY_CHARS: usize = 200;

/// One HTTP request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http {
    /// Request method, `GET` by default.
    #[serde(default = "method_default")]
    pub method: String,
    /// Absolute `http` or `https` URL.
    pub url: String,
    /// Request headers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Request body: a string is sent as is, other JSON as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Value>,
    /// Timeout in milliseconds ([`HTTP_TIMEOUT_DEFAULT`] when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

fn method_default() -> String {
    "GET".to_owned()
}

/// How a worker runs `http` jobs: its client and the hosts jobs may reach. Give it to the
/// worker with [`WorkerBuilder::data`](crate::WorkerBuilder::data); a worker without one
/// lets jobs reach any host.
///
/// ```no_run
/// # fn example(pool: sqlx::PgPool) -> skiplock::Result<()> {
/// use skiplock::builtin::{Http, HttpConfig};
///
/// let worker = skiplock::Worker::builder(pool)
///     .register::<Http>()
///     .data(HttpConfig::allow_hosts(["hooks.example.com", "*.internal:8443"])?)
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct HttpConfig {
    client: reqwest::Client,
    allowed: Option<Arc<Vec<HostRule>>>,
}

impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("allowed", &self.allowed)
            .finish_non_exhaustive()
    }
}

impl HttpConfig {
    /// Jobs may reach any host.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the HTTP client cannot be built (no usable TLS trust store).
    pub fn any_host() -> Result<Self> {
        Self::build(None)
    }

    /// Jobs may reach only these hosts: `example.com` (any port), `example.com:8443`,
    /// `*.example.com` (its subdomains), `127.0.0.1`, `[::1]:8080`. Case does not matter.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if a host is malformed or the client cannot be built.
    pub fn allow_hosts<I, S>(hosts: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let rules = hosts
            .into_iter()
            .map(|host| HostRule::parse(host.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        Self::build(Some(Arc::new(rules)))
    }

    fn build(allowed: Option<Arc<Vec<HostRule>>>) -> Result<Self> {
        let policy_rules = allowed.clone();
        let redirects = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= REDIRECTS_MAX {
                attempt.error(format!("more than {REDIRECTS_MAX} redirects"))
            } else if host_allowed(policy_rules.as_deref(), attempt.url()) {
                attempt.follow()
            } else {
                let to = display_url(attempt.url());
                attempt.error(format!("redirect to {to}, whose host is not allowed"))
            }
        });
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config()?)
            .redirect(redirects)
            .user_agent(concat!("skiplock/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self { client, allowed })
    }

    /// The allowed hosts as given, `None` when any host is allowed.
    pub fn allowed_hosts(&self) -> Option<Vec<String>> {
        self.allowed
            .as_ref()
            .map(|rules| rules.iter().map(ToString::to_string).collect())
    }
}

/// rustls with the ring provider and the system's trust store, without touching the
/// process-wide default provider (the application may have its own).
fn tls_config() -> Result<rustls::ClientConfig> {
    use rustls_platform_verifier::BuilderVerifierExt;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let failed = |e: rustls::Error| Error::Config(format!("cannot set up TLS: {e}"));
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(failed)?
        .with_platform_verifier()
        .map_err(failed)?
        .with_no_client_auth())
}

/// One allow-list entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostRule {
    /// Lowercase host; IPv6 addresses without brackets.
    host: String,
    /// Whether `host` is a suffix (`*.example.com`).
    subdomains: bool,
    port: Option<u16>,
}

impl HostRule {
    fn parse(entry: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Config(format!(
                "http allow-list entry `{entry}` {why}; expected host, host:port, *.domain or [ipv6]:port"
            ))
        };
        let entry_lower = entry.trim().to_ascii_lowercase();
        let (host, port) = if let Some(rest) = entry_lower.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(|| bad("lacks `]`"))?;
            let port = match after.strip_prefix(':') {
                Some(port) => Some(port),
                None if after.is_empty() => None,
                None => return Err(bad("has text after `]`")),
            };
            (host.to_owned(), port)
        } else {
            match entry_lower.rsplit_once(':') {
                Some((host, _)) if host.contains(':') => {
                    return Err(bad("looks like an IPv6 address without brackets"));
                }
                Some((host, port)) => (host.to_owned(), Some(port)),
                None => (entry_lower.clone(), None),
            }
        };
        let port = port
            .map(|p| p.parse::<u16>().map_err(|_| bad("has a bad port")))
            .transpose()?;
        let (host, subdomains) = match host.strip_prefix("*.") {
            Some(domain) => (domain.to_owned(), true),
            None => (host, false),
        };
        if host.is_empty() || host.contains(['/', '*', '@', ' ']) {
            return Err(bad("is not a host name"));
        }
        Ok(Self {
            host,
            subdomains,
            port,
        })
    }

    fn matches(&self, host: &str, port: Option<u16>) -> bool {
        let host_ok = if self.subdomains {
            host.strip_suffix(&self.host)
                .is_some_and(|prefix| prefix.ends_with('.'))
        } else {
            host == self.host
        };
        host_ok && self.port.is_none_or(|p| Some(p) == port)
    }
}

impl fmt::Display for HostRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wildcard = if self.subdomains { "*." } else { "" };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match self.port {
            Some(port) => write!(f, "{wildcard}{host}:{port}"),
            None => write!(f, "{wildcard}{host}"),
        }
    }
}

fn host_allowed(rules: Option<&Vec<HostRule>>, url: &Url) -> bool {
    let Some(rules) = rules else { return true };
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = host.to_ascii_lowercase();
    let port = url.port_or_known_default();
    rules.iter().any(|rule| rule.matches(&host, port))
}

/// The URL without its password, for messages and logs.
fn display_url(url: &Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _ = shown.set_password(Some("***"));
    }
    shown.to_string()
}

/// The config a worker uses when it was given no [`HttpConfig`]: any host.
fn config_default() -> std::result::Result<&'static HttpConfig, String> {
    static DEFAULT: OnceLock<std::result::Result<HttpConfig, String>> = OnceLock::new();
    DEFAULT
        .get_or_init(|| HttpConfig::any_host().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

impl Job for Http {
    const KIND: &'static str = "http";

    async fn run(self, ctx: JobContext) -> std::result::Result<(), JobError> {
        let config = match ctx.data::<HttpConfig>() {
            Some(config) => config,
            None => config_default().map_err(JobError::retry)?,
        };
        let trace = crate::trace_context::to_pass_on(&ctx);
        let request = self.request(config, trace.as_ref())?;
        let shown = display_url(request.url());
        let response = match config.client.execute(request).await {
            Ok(response) => response,
            Err(e) => return Err(request_failed(&self.method, &shown, e)),
        };
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, Utc::now()));
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let (body, truncated) = body_prefix(response).await;
        let output = json!({
            "status": status.as_u16(),
            "content_type": content_type,
            "body_prefix": body,
            "body_truncated": truncated,
        });
        if let Err(e) = ctx.set_output(output).await {
            tracing::warn!(job = %ctx.id(), error = %e, "could not record the http response");
        }
        if status.is_success() {
            return Ok(());
        }
        let message = format!(
            "{} {shown} answered {status}{}",
            self.method.to_ascii_uppercase(),
            quote_body(&body)
        );
        Err(if is_retryable(status) {
            match retry_after {
                Some(delay) => JobError::retry_after(delay, message),
                None => JobError::retry(message),
            }
        } else {
            JobError::permanent(message)
        })
    }
}

impl Http {
    /// Checks the args against the config and builds the request; every problem here is
    /// permanent, since retrying the same args cannot fix it.
    fn request(
        &self,
        config: &HttpConfig,
        trace: Option<&TraceContext>,
    ) -> std::result::Result<reqwest::Request, JobError> {
        let method = Method::from_bytes(self.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| JobError::permanent(format!("`{}` is not an HTTP method", self.method)))?;
        let url = Url::parse(&self.url)
            .map_err(|e| JobError::permanent(format!("`{}` is not a URL: {e}", self.url)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(JobError::permanent(format!(
                "`{}` is not an http or https URL",
                display_url(&url)
            )));
        }
        if !host_allowed(config.allowed.as_deref(), &url) {
            let host = url.host_str().unwrap_or_default();
            let allowed = config.allowed_hosts().unwrap_or_default().join(", ");
            return Err(JobError::permanent(format!(
                "host `{host}` is not on this worker's http allow-list ({allowed}); \
                 start a worker with --allow-http-host {host} to run this job, then retry it"
            )));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &self.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| JobError::permanent(format!("`{name}` is not a header name")))?;
            let value = HeaderValue::from_str(value).map_err(|_| {
                JobError::permanent(format!("the value of header `{name}` is not valid"))
            })?;
            headers.append(name, value);
        }
        // The job's trace goes on to the service it calls, unless its own headers name a
        // trace (either header); a tracestate only beside its traceparent.
        if let Some(trace) = trace
            && !headers.contains_key("traceparent")
            && !headers.contains_key("tracestate")
            && let Ok(parent) = HeaderValue::from_str(trace.traceparent())
        {
            headers.insert("traceparent", parent);
            if let Some(state) = trace
                .tracestate()
                .and_then(|state| HeaderValue::from_str(state).ok())
            {
                headers.insert("tracestate", state);
            }
        }
        let body = match &self.body {
            None => None,
            Some(Value::String(text)) => Some(text.clone().into_bytes()),
            Some(other) => {
                if !headers.contains_key(CONTENT_TYPE) {
                    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                }
                Some(other.to_string().into_bytes())
            }
        };
        let timeout = self
            .timeout_ms
            .map_or(HTTP_TIMEOUT_DEFAULT, Duration::from_millis);
        let mut builder = config
            .client
            .request(method, url)
            .headers(headers)
            .timeout(timeout);
        if let Some(body) = body {
            builder = builder.body(body);
        }
        builder
            .build()
            .map_err(|e| JobError::permanent(format!("cannot build the request: {e}")))
    }
}

/// What a failed `send` means: timeouts and network errors retry, a refused redirect or a
/// request reqwest cannot build does not.
fn request_failed(method: &str, url: &str, error: reqwest::Error) -> JobError {
    let method = method.to_ascii_uppercase();
    // The message names the URL already (without its password).
    let error = error.without_url();
    if error.is_timeout() {
        return JobError::retry(format!("{method} {url} timed out"));
    }
    let mut message = format!("{method} {url} failed: {error}");
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    if error.is_redirect() || error.is_builder() {
        JobError::permanent(message)
    } else {
        JobError::retry(message)
    }
}

fn is_retryable(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
}

/// Reads at most [`BODY_PREFIX_MAX_BYTES`] of the body, as text (invalid UTF-8 replaced).
/// A body that fails midway keeps what arrived: the status already decided the outcome.
async fn body_prefix(mut response: reqwest::Response) -> (String, bool) {
    let mut bytes = Vec::new();
    let mut truncated = false;
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = BODY_PREFIX_MAX_BYTES - bytes.len();
        if chunk.len() > room {
            bytes.extend_from_slice(&chunk[..room]);
            truncated = true;
            break;
        }
        bytes.extend_from_slice(&chunk);
    }
    (String::from_utf8_lossy(&bytes).into_owned(), truncated)
}

fn quote_body(body: &str) -> String {
    super::excerpt(body, ERROR_BODY_CHARS).map_or_else(String::new, |text| format!(": {text}"))
}

/// A `Retry-After` value: delay seconds or an HTTP date, capped at [`RETRY_AFTER_MAX`]. A
/// date in the past means "now".
fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    let delay = if let Ok(seconds) = value.parse::<u64>() {
        Duration::from_secs(seconds)
    } else {
        let at = DateTime::parse_from_rfc2822(value).ok()?;
        (at.with_timezone(&Utc) - now)
            .to_std()
            .unwrap_or(Duration::ZERO)
    };
    Some(delay.min(RETRY_AFTER_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_or_dates_and_is_capped() {
        let now = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 2026 00:01:30 GMT", now),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            parse_retry_after("Wed, 31 Dec 2025 23:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("999999999", now), Some(RETRY_AFTER_MAX));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn host_rules_match_hosts_ports_and_subdomains() {
        let rules: Vec<HostRule> = ["Example.com", "api.test:8443", "*.internal", "[::1]:80"]
            .into_iter()
            .map(|r| HostRule::parse(r).unwrap())
            .collect();
        let allowed = |url: &str| host_allowed(Some(&rules), &Url::parse(url).unwrap());
        assert!(allowed("https://example.com/x"));
        assert!(allowed("http://EXAMPLE.com:9000/"));
        assert!(allowed("https://api.test:8443/"));
        assert!(!allowed("https://api.test/"));
        assert!(allowed("http://a.b.internal/"));
        assert!(!allowed("http://internal/"));
        assert!(!allowed("http://evilinternal/"));
        assert!(allowed("http://[::1]/"));
        assert!(!allowed("http://[::1]:81/"));
        assert!(!allowed("https://example.org/"));
        assert_eq!(rules[3].to_string(), "[::1]:80");
        assert!(HostRule::parse("http://x").is_err());
        assert!(HostRule::parse("x:99999").is_err());
    }

    #[test]
    fn args_decode_with_defaults() {
        let http: Http = serde_json::from_value(json!({"url": "http://x/"})).unwrap();
        assert_eq!(http.method, "GET");
        assert!(http.headers.is_empty() && http.body.is_none() && http.timeout_ms.is_none());
        assert!(
            serde_json::from_value::<Http>(json!({"url": "http://x/", "verb": "GET"})).is_err()
        );
    }
}
