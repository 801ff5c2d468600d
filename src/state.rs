//! The words a job row is written in: its id, its state and its unique key's policy. A
//! leaf module: the SQL layer (`db`) and the job API (`job`) both use it, and it uses
//! neither, so that neither imports the other's types in a circle.

use std::fmt;

use serde::Serialize;

/// A job's id: `skiplock.jobs.id`, a `bigint`.
///
/// In sqlx it is an `i64` under another name: it binds as `bigint`, decodes from one, and a
/// `Vec<JobId>` or `&[JobId]` binds as `bigint[]`. It converts to and from `i64` with
/// `From`, and `.0` is the number itself. It serializes as a bare number.
///
/// # Examples
///
/// ```no_run
/// use skiplock::JobId;
///
/// # async fn example(pool: sqlx::PgPool, id: JobId, ids: Vec<JobId>) -> sqlx::Result<()> {
/// let queue: String = sqlx::query_scalar("SELECT queue FROM skiplock.jobs WHERE id = $1")
///     .bind(id)
///     .fetch_one(&pool)
///     .await?;
/// let dead: Vec<JobId> = sqlx::query_scalar(
///     "SELECT id FROM skiplock.jobs WHERE id = ANY($1) AND state = 'dead' ORDER BY id",
/// )
/// .bind(&ids)
/// .fetch_all(&pool)
/// .await?;
/// assert_eq!(i64::from(id), id.0);
/// assert_eq!(JobId::from(7), JobId(7));
/// # Ok(()) }
/// ```
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    serde::Deserialize,
    sqlx::Type,
)]
#[serde(transparent)]
// `Type` (with `PgHasArrayType`), `Encode` and `Decode` all delegate to `i64`'s.
#[sqlx(transparent)]
pub struct JobId(pub i64);

/// A job id compares with the `i64` a row or a plain query gives.
impl PartialEq<i64> for JobId {
    fn eq(&self, other: &i64) -> bool {
        self.0 == *other
    }
}

impl PartialEq<JobId> for i64 {
    fn eq(&self, other: &JobId) -> bool {
        *self == other.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<i64> for JobId {
    fn from(id: i64) -> Self {
        JobId(id)
    }
}

impl From<JobId> for i64 {
    fn from(id: JobId) -> Self {
        id.0
    }
}

/// The state of a job, mirrored by the Postgres enum `skiplock.job_state`.
///
/// ```text
///  waiting ──parents succeeded──▶ queued ◀──────── retry (backoff) / reaper / manual retry
///                                   │  claim (SKIP LOCKED, new claim_token, attempt+1)
///                                   ▼
///                                running ──ok──▶ succeeded
///                                   │
///                                   ├─error, attempts left──▶ queued (scheduled_at = now + backoff)
///                                   ├─error, none left / non-retryable──▶ dead
///                                   └─cancel──▶ cancelled
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type, Serialize, serde::Deserialize)]
#[sqlx(type_name = "skiplock.job_state", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Waits for parent jobs to succeed.
    Waiting,
    /// Runnable once `scheduled_at` has passed.
    Queued,
    /// Claimed by a worker; `claim_token` names the claim.
    Running,
    /// Finished successfully.
    Succeeded,
    /// Failed permanently or ran out of attempts; an operator may retry it.
    Dead,
    /// Cancelled before it could finish.
    Cancelled,
}

impl JobState {
    /// Every state, in lifecycle order.
    pub const ALL: [JobState; 6] = [
        JobState::Waiting,
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Dead,
        JobState::Cancelled,
    ];

    /// The name used in SQL and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Waiting => "waiting",
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for JobState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown job state `{s}`; expected one of: waiting, queued, running, succeeded, dead, cancelled"
                )
            })
    }
}

impl TryFrom<String> for JobState {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// What a second enqueue does while a job with the same unique key is pending.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UniquePolicy {
    /// Keep the pending job as it is and return its id.
    #[default]
    Skip,
    /// Give the pending job the new args.
    Replace,
    /// Append the new args to the pending job's: its args are a JSON array of every
    /// payload enqueued under the key (a payload that is not an array is wrapped in one),
    /// and the handler receives them all at once.
    Merge,
}

impl UniquePolicy {
    /// The name used in SQL and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            UniquePolicy::Skip => "skip",
            UniquePolicy::Replace => "replace",
            UniquePolicy::Merge => "merge",
        }
    }
}

/// Read from and written to Postgres as its name (`skiplock.jobs.unique_policy` is text).
impl sqlx::Type<sqlx::Postgres> for UniquePolicy {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <&str as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for UniquePolicy {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let name = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Ok(name.parse()?)
    }
}

impl sqlx::Encode<'_, sqlx::Postgres> for UniquePolicy {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
    }
}

impl std::str::FromStr for UniquePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "skip" => Ok(UniquePolicy::Skip),
            "replace" => Ok(UniquePolicy::Replace),
            "merge" => Ok(UniquePolicy::Merge),
            _ => Err(format!(
                "unknown conflict policy `{s}`; expected skip, replace or merge"
            )),
        }
    }
}
