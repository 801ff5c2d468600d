//! Cron schedules: named (expression, time zone, kind, args) that produce exactly one job
//! per slot however many workers run.
//!
//! Expressions have five fields (`minute hour day-of-month month day-of-week`) or six with
//! seconds first, in the usual cron syntax (`*`, lists, ranges, steps, month and weekday
//! names). Slots are computed in the schedule's IANA time zone from the database clock.
//!
//! **Missed slots.** When no worker ran for a while, [`MissedSlots::Latest`] (the default)
//! runs the most recent missed slot once and drops the earlier ones; [`MissedSlots::Skip`]
//! runs none of them: a slot more than [`CRON_LATE_TOLERANCE`] late is recorded as done
//! without a job.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde_json::Value;
use sqlx::PgExecutor;

use crate::db::cron as sql;
use crate::error::{Error, Result};
use crate::job::{MAX_ATTEMPTS_DEFAULT, QUEUE_DEFAULT};

pub use crate::db::cron::CronRow;

/// With [`MissedSlots::Skip`], a slot later than this is skipped rather than run.
pub const CRON_LATE_TOLERANCE: Duration = Duration::from_secs(60);

/// What to do with slots that passed while no worker ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MissedSlots {
    /// Run the most recent missed slot once.
    #[default]
    Latest,
    /// Run none of them.
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

    /// Checks the expression, time zone and fields.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCron`] naming what is wrong and where.
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
        CronExpression::parse(&self.expression, &self.timezone).map(|_| ())
    }
}

/// A parsed expression in its time zone.
#[derive(Debug, Clone)]
pub struct CronExpression {
    cron: Cron,
    timezone: Tz,
}

/// Field names, for 5- and 6-field expressions.
const FIELDS_5: [&str; 5] = ["minute", "hour", "day-of-month", "month", "day-of-week"];
const FIELDS_6: [&str; 6] = [
    "second",
    "minute",
    "hour",
    "day-of-month",
    "month",
    "day-of-week",
];

/// What a field of a cron expression accepts, for error messages (the parser's own words,
/// such as "Component error: Number out of bounds.", say neither which values nor how).
fn field_rule(field: &str) -> &'static str {
    match field {
        "second" | "minute" => "use 0-59, a list (0,30), a range (10-20), a step (*/15) or *",
        "hour" => "use 0-23, a list (9,17), a range (9-17), a step (*/2) or *",
        "day-of-month" => "use 1-31, L, a list (1,15), a range (1-7), a step (*/2) or *",
        "month" => "use 1-12 or JAN-DEC, a list, a range, a step or *",
        _ => "use 0-7 (0 and 7 are Sunday) or SUN-SAT, a list, a range, a step or *",
    }
}

impl CronExpression {
    /// Parses `expression` (5 fields, or 6 with seconds first) in the IANA `timezone`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCron`] with a one-line message naming the wrong field, its text and
    /// its character position, e.g. ``invalid cron expression `0 25 * * *`: hour field
    /// `25` (characters 3-4) is wrong: …``.
    pub fn parse(expression: &str, timezone: &str) -> Result<Self> {
        let timezone: Tz = timezone.parse().map_err(|_| {
            Error::InvalidCron(format!(
                "unknown time zone `{timezone}`; use an IANA name such as UTC or Europe/Paris"
            ))
        })?;
        let fields: Vec<(usize, &str)> = field_spans(expression);
        let names: &[&str] = match fields.len() {
            5 => &FIELDS_5,
            6 => &FIELDS_6,
            n => {
                return Err(Error::InvalidCron(format!(
                    "invalid cron expression `{expression}`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found {n}"
                )));
            }
        };
        let field_error = |index: usize| {
            let (start, text) = fields[index];
            Error::InvalidCron(format!(
                "invalid cron expression `{expression}`: {} field `{text}` (characters {}-{}) is wrong: {}",
                names[index],
                start + 1,
                start + text.chars().count(),
                field_rule(names[index])
            ))
        };
        // The parser takes a list with an empty item (`1,,5`, `1,`) as if it were not
        // there: refused here, as a typo whose meaning nobody can know.
        if let Some(index) = fields
            .iter()
            .position(|(_, text)| text.split(',').any(str::is_empty))
        {
            return Err(field_error(index));
        }
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        match parser.parse(expression) {
            Ok(cron) => Ok(Self { cron, timezone }),
            Err(whole) => {
                // Find the first field that fails on its own, everything else a wildcard.
                for (index, (_, text)) in fields.iter().enumerate() {
                    let probe: Vec<&str> = (0..fields.len())
                        .map(|i| if i == index { *text } else { "*" })
                        .collect();
                    if parser.parse(&probe.join(" ")).is_err() {
                        return Err(field_error(index));
                    }
                }
                Err(Error::InvalidCron(format!(
                    "invalid cron expression `{expression}`: {whole}"
                )))
            }
        }
    }

    /// The latest slot at or before `now`, if there is one after `done_until`.
    pub fn due_slot(&self, done_until: DateTime<Utc>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local_now = now.with_timezone(&self.timezone);
        let slot = self
            .cron
            .find_previous_occurrence(&local_now, true)
            .ok()?
            .with_timezone(&Utc);
        (slot > done_until).then_some(slot)
    }
}

/// The (character offset, text) of each whitespace-separated field.
fn field_spans(expression: &str) -> Vec<(usize, &str)> {
    let mut spans = Vec::new();
    let mut start = None;
    for (char_index, (byte, ch)) in expression.char_indices().enumerate() {
        match (ch.is_whitespace(), start) {
            (false, None) => start = Some((byte, char_index)),
            (true, Some((begin, chars))) => {
                spans.push((chars, &expression[begin..byte]));
                start = None;
            }
            _ => {}
        }
    }
    if let Some((begin, chars)) = start {
        spans.push((chars, &expression[begin..]));
    }
    spans
}

/// Creates or updates a schedule (after validating it). Updating keeps its progress,
/// unless the expression or time zone changed: then slots count from now.
///
/// # Errors
///
/// [`Error::InvalidCron`] for a bad schedule, [`Error::Database`] if the write fails.
pub async fn upsert<'e>(db: impl PgExecutor<'e>, schedule: &CronSchedule) -> Result<()> {
    schedule.validate()?;
    sql::cron_schedules_upsert(db, &schedule.columns()).await?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn error_of(expression: &str) -> String {
        CronExpression::parse(expression, "UTC")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn five_and_six_fields_parse() {
        CronExpression::parse("*/5 * * * *", "UTC").unwrap();
        CronExpression::parse("30 */5 * * * MON-FRI", "Europe/Paris").unwrap();
    }

    #[test]
    fn errors_name_the_field_and_where_it_is() {
        let e = error_of("0 25 * * *");
        assert!(
            e.starts_with(
                "invalid cron expression `0 25 * * *`: hour field `25` (characters 3-4) is wrong"
            ),
            "{e}"
        );
        let e = error_of("*/5 * 32 * *");
        assert!(
            e.contains("day-of-month field `32` (characters 7-8)"),
            "{e}"
        );
        let e = error_of("* * * *");
        assert!(e.contains("expected 5 fields"), "{e}");
        assert!(e.contains("found 4"), "{e}");
        let e = error_of("* * * * * * * *");
        assert!(e.contains("found 8"), "{e}");
        let e = CronExpression::parse("* * * * *", "Mars/Olympus")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("unknown time zone `Mars/Olympus`"), "{e}");
    }

    /// A list with an empty item is a typo, not a list: the parser alone took `1,,` as `1`.
    #[test]
    fn a_list_with_an_empty_item_is_refused() {
        let e = error_of("0 0 1,, * *");
        assert!(
            e.starts_with(
                "invalid cron expression `0 0 1,, * *`: day-of-month field `1,,` (characters 5-7) is wrong"
            ),
            "{e}"
        );
        let e = error_of(",5 * * * *");
        assert!(e.contains("minute field `,5`"), "{e}");
        CronExpression::parse("0 0 1,15 * *", "UTC").unwrap();
    }

    #[test]
    fn due_slot_is_the_latest_slot_after_the_last_done() {
        let every_5_min = CronExpression::parse("*/5 * * * *", "UTC").unwrap();
        let now = Utc.with_ymd_and_hms(2026, 3, 1, 10, 17, 30).unwrap();
        let slot = Utc.with_ymd_and_hms(2026, 3, 1, 10, 15, 0).unwrap();
        // After a long outage, only the latest slot is due.
        let long_ago = Utc.with_ymd_and_hms(2026, 2, 1, 0, 0, 0).unwrap();
        assert_eq!(every_5_min.due_slot(long_ago, now), Some(slot));
        // Already done: nothing due.
        assert_eq!(every_5_min.due_slot(slot, now), None);
    }

    #[test]
    fn slots_follow_the_time_zone() {
        let nine_in_new_york = CronExpression::parse("0 9 * * *", "America/New_York").unwrap();
        let now = Utc.with_ymd_and_hms(2026, 1, 15, 20, 0, 0).unwrap();
        let long_ago = Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap();
        // 09:00 EST is 14:00 UTC in January.
        assert_eq!(
            nine_in_new_york.due_slot(long_ago, now),
            Some(Utc.with_ymd_and_hms(2026, 1, 15, 14, 0, 0).unwrap())
        );
    }
}
