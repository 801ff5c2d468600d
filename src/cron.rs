//! Cron schedules: named (expression, time zone, kind, args) that produce exactly one job
//! per slot however many workers run.
//!
//! Expressions have five fields (`minute hour day-of-month month day-of-week`) or six with
//! seconds first, in the usual cron syntax: `*`, values, ranges (`9-17`), steps (`*/15`,
//! `9-17/2`, `5/10`), comma lists, month names `JAN`-`DEC`, weekday names `SUN`-`SAT` (0
//! and 7 are Sunday), `L` for the month's last day, and `?` as `*` in the two day fields.
//! When both day fields are restricted, a day matches either of them (as in Vixie cron).
//!
//! Expressions are read and evaluated in one place, the database (`skiplock.internal_cron_*`
//! in `migrations/functions/09_cron.sql`), for every way of running schedules: the worker's cron
//! pass and `skiplock.maintain` for deployments with no skiplock process enqueue due
//! slots with the same function, and a schedule is checked as it is written, whoever
//! writes it (this module, the CLI, a plain SQL `INSERT`). Slots are computed from the
//! database clock in the schedule's IANA time zone. Across a clock change, a local time
//! the change skips runs moved forward by the gap (02:30 runs at 03:30), and a local time
//! that happens twice runs once, at its first instant, unless the seconds, minute or hour
//! field starts with `*` (an interval, such as `*/15 * * * *`): those run through both
//! passes of the repeated hour.
//!
//! **Missed slots.** When no worker ran for a while, [`MissedSlots::Latest`] (the default)
//! runs the most recent missed slot once and drops the earlier ones; [`MissedSlots::Skip`]
//! runs none of them: a slot more than 60 seconds late is recorded as done without a job.

use std::str::FromStr;

use serde_json::Value;
use sqlx::PgExecutor;

use crate::db::cron as sql;
use crate::error::{Error, Result};
use crate::job::{MAX_ATTEMPTS_DEFAULT, QUEUE_DEFAULT};

pub use crate::db::cron::CronRow;

/// What to do with slots that passed while no worker ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MissedSlots {
    /// Run the most recent missed slot once.
    #[default]
    Latest,
    /// Run none of them: a slot more than 60 seconds late is marked done without a job.
    Skip,
}

impl MissedSlots {
    /// The name stored in `skiplock.cron_schedules.missed`.
    pub fn as_str(self) -> &'static str {
        match self {
            MissedSlots::Latest => "latest",
            MissedSlots::Skip => "skip",
        }
    }
}

impl FromStr for MissedSlots {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "latest" => Ok(MissedSlots::Latest),
            "skip" => Ok(MissedSlots::Skip),
            _ => Err(format!(
                "unknown missed-slot policy `{s}`; expected latest or skip"
            )),
        }
    }
}

/// A named schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct CronSchedule {
    /// Unique name.
    pub name: String,
    /// Cron expression, 5 fields or 6 with seconds.
    pub expression: String,
    /// IANA time zone the expression is read in. Default `UTC`.
    pub timezone: String,
    /// Kind of the jobs it produces.
    pub kind: String,
    /// Args of the jobs it produces.
    pub args: Value,
    /// Queue of the jobs it produces.
    pub queue: String,
    /// Priority of the jobs it produces.
    pub priority: i16,
    /// Attempt budget of the jobs it produces.
    pub max_attempts: i32,
    /// Policy for slots missed while no worker ran.
    pub missed: MissedSlots,
}

impl CronSchedule {
    /// The columns the schedule is written with.
    pub(crate) fn columns(&self) -> sql::ScheduleColumns<'_> {
        sql::ScheduleColumns {
            name: &self.name,
            expression: &self.expression,
            timezone: &self.timezone,
            kind: &self.kind,
            args: &self.args,
            queue: &self.queue,
            priority: self.priority,
            max_attempts: self.max_attempts,
            missed: self.missed.as_str(),
        }
    }

    /// A schedule with UTC, empty args, the default queue and policy.
    pub fn new(
        name: impl Into<String>,
        expression: impl Into<String>,
        kind: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            expression: expression.into(),
            timezone: "UTC".to_owned(),
            kind: kind.into(),
            args: Value::Object(Default::default()),
            queue: QUEUE_DEFAULT.to_owned(),
            priority: 0,
            max_attempts: MAX_ATTEMPTS_DEFAULT,
            missed: MissedSlots::default(),
        }
    }

    /// Sets the time zone.
    pub fn timezone(mut self, timezone: impl Into<String>) -> Self {
        self.timezone = timezone.into();
        self
    }

    /// Sets the args.
    pub fn args(mut self, args: Value) -> Self {
        self.args = args;
        self
    }

    /// Sets the queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }

    /// Sets the missed-slot policy.
    pub fn missed(mut self, missed: MissedSlots) -> Self {
        self.missed = missed;
        self
    }

    /// Checks the fields that need no database: names, queue and attempts. The
    /// expression and time zone are checked where they are evaluated, by the database,
    /// when the schedule is written ([`upsert`], or [`Worker::run`](crate::Worker::run)
    /// for schedules defined on the worker).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCron`] naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() || self.kind.is_empty() || self.queue.is_empty() {
            return Err(Error::InvalidCron(format!(
                "schedule `{}`: name, kind and queue must not be empty",
                self.name
            )));
        }
        if let Some(why) = crate::enqueue::queue_name_over_limit(&self.queue) {
            return Err(Error::InvalidCron(format!(
                "schedule `{}`: the queue name {why}",
                self.name
            )));
        }
        if self.max_attempts < 1 {
            return Err(Error::InvalidCron(format!(
                "schedule `{}`: max_attempts must be at least 1",
                self.name
            )));
        }
        Ok(())
    }
}

/// Creates or updates a schedule (after validating it). Updating keeps its progress,
/// unless the expression or time zone changed: then slots count from now.
///
/// # Errors
///
/// [`Error::InvalidCron`] for a bad schedule, with a one-line message naming the wrong
/// field, its text and its character positions (``invalid cron expression `0 25 * * *`:
/// hour field `25` (characters 3-4) is wrong: …``) or the unknown time zone;
/// [`Error::Database`] if the write fails.
pub async fn upsert<'e>(db: impl PgExecutor<'e>, schedule: &CronSchedule) -> Result<()> {
    schedule.validate()?;
    sql::cron_schedules_upsert(db, &schedule.columns())
        .await
        .map_err(refused_schedule)
}

/// The database's refusal of a malformed expression or an unknown time zone (SQLSTATE
/// 22023, raised by the check on `skiplock.cron_schedules`) as [`Error::InvalidCron`].
pub(crate) fn refused_schedule(error: sqlx::Error) -> Error {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("22023") => {
            Error::InvalidCron(db.message().to_owned())
        }
        _ => error.into(),
    }
}

/// Deletes a schedule; returns whether it existed. Jobs it produced stay.
///
/// # Errors
///
/// [`Error::Database`] if the delete fails.
pub async fn remove<'e>(db: impl PgExecutor<'e>, name: &str) -> Result<bool> {
    Ok(sql::cron_schedules_delete(db, name).await?)
}

/// Every schedule, by name.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<CronRow>> {
    Ok(sql::cron_schedules_list(db).await?)
}
