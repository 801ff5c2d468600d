//! Timestamps read back from rows a person may have written by hand.
//!
//! The table accepts any `timestamptz`, `'infinity'` and `'-infinity'` included (a job
//! scheduled at `'infinity'` never comes due; one at `'-infinity'` runs first), and years
//! up to 294276, past what `chrono` represents (262143). sqlx's own decoding panics on
//! those (an overflow in `chrono`), which took down every command that listed such a row.
//! These decode them saturated instead: `'infinity'` and anything later than
//! [`DateTime::<Utc>::MAX_UTC`] as `MAX_UTC`, `'-infinity'` and anything earlier as
//! `MIN_UTC`. Row types use them through `#[sqlx(try_from = ...)]`.

use chrono::{DateTime, Utc};
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgTypeInfo, PgValueFormat, PgValueRef};
use sqlx::{Decode, Postgres, Type, ValueRef};

/// Microseconds from the Unix epoch to Postgres' own, 2000-01-01 00:00 UTC.
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A `timestamptz` column, decoded without panicking (see the module doc).
pub struct Timestamp(DateTime<Utc>);

/// A nullable `timestamptz` column, decoded like [`Timestamp`].
pub struct MaybeTimestamp(Option<DateTime<Utc>>);

/// The instant `micros` after Postgres' epoch, saturated to what `chrono` represents
/// (`'infinity'` is `i64::MAX`, `'-infinity'` is `i64::MIN`).
fn saturated(micros: i64) -> DateTime<Utc> {
    micros
        .checked_add(POSTGRES_EPOCH_MICROS)
        .and_then(DateTime::from_timestamp_micros)
        .unwrap_or(if micros < 0 {
            DateTime::<Utc>::MIN_UTC
        } else {
            DateTime::<Utc>::MAX_UTC
        })
}

/// The instant `micros` after the Unix epoch, saturated like [`saturated`]: for times a
/// statement returns as integers (a statement in the simple query protocol, whose text
/// form of a `timestamptz` follows the session's `DateStyle`).
pub(crate) fn from_unix_micros_saturated(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).unwrap_or(if micros < 0 {
        DateTime::<Utc>::MIN_UTC
    } else {
        DateTime::<Utc>::MAX_UTC
    })
}

impl Type<Postgres> for Timestamp {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for Timestamp {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        match value.format() {
            PgValueFormat::Binary => {
                let micros = <i64 as Decode<Postgres>>::decode(value)?;
                Ok(Self(saturated(micros)))
            }
            PgValueFormat::Text => match value.as_str()? {
                "infinity" => Ok(Self(DateTime::<Utc>::MAX_UTC)),
                "-infinity" => Ok(Self(DateTime::<Utc>::MIN_UTC)),
                _ => <DateTime<Utc> as Decode<Postgres>>::decode(value).map(Self),
            },
        }
    }
}

impl From<Timestamp> for DateTime<Utc> {
    fn from(value: Timestamp) -> Self {
        value.0
    }
}

impl Type<Postgres> for MaybeTimestamp {
    fn type_info() -> PgTypeInfo {
        Timestamp::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        Timestamp::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for MaybeTimestamp {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        if value.is_null() {
            return Ok(Self(None));
        }
        Timestamp::decode(value).map(|at| Self(Some(at.0)))
    }
}

impl From<MaybeTimestamp> for Option<DateTime<Utc>> {
    fn from(value: MaybeTimestamp) -> Self {
        value.0
    }
}

/// Reads a timestamp as `to_jsonb` writes it, saturated like [`Timestamp`]: for rows
/// that come back as JSON (`#[serde(deserialize_with = "...")]`).
#[cfg(any(feature = "cli", feature = "internals"))]
pub(crate) fn deserialize_saturated<'de, D>(deserializer: D) -> Result<DateTime<Utc>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let text = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(deserializer)?;
    parse_saturated(&text).ok_or_else(|| {
        serde::de::Error::custom(format!("`{text}` is not a timestamp Postgres writes"))
    })
}

/// [`deserialize_saturated`] for a nullable column.
#[cfg(any(feature = "cli", feature = "internals"))]
pub(crate) fn deserialize_saturated_option<'de, D>(
    deserializer: D,
) -> Result<Option<DateTime<Utc>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let text =
        <Option<std::borrow::Cow<'de, str>> as serde::Deserialize>::deserialize(deserializer)?;
    text.map(|text| {
        parse_saturated(&text).ok_or_else(|| {
            serde::de::Error::custom(format!("`{text}` is not a timestamp Postgres writes"))
        })
    })
    .transpose()
}

/// An RFC 3339 timestamp, `infinity` or `-infinity`; a year too large for `chrono` (more
/// than four digits) saturates, before Christ (`... BC`) to the earliest instant.
#[cfg(any(feature = "cli", feature = "internals"))]
fn parse_saturated(text: &str) -> Option<DateTime<Utc>> {
    use chrono::Datelike;
    match text {
        "infinity" => return Some(DateTime::<Utc>::MAX_UTC),
        "-infinity" => return Some(DateTime::<Utc>::MIN_UTC),
        _ => {}
    }
    let (date, before_christ) = match text.strip_suffix(" BC") {
        Some(date) => (date, true),
        None => (text, false),
    };
    if let Ok(at) = DateTime::parse_from_rfc3339(date) {
        let at = at.to_utc();
        if !before_christ {
            return Some(at);
        }
        // 1 BC is year 0 in chrono's (astronomical) numbering.
        return Some(
            at.with_year(1 - at.year())
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        );
    }
    let year_digits = date.chars().take_while(char::is_ascii_digit).count();
    if year_digits > 4 {
        return Some(if before_christ {
            DateTime::<Utc>::MIN_UTC
        } else {
            DateTime::<Utc>::MAX_UTC
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Datelike;

    #[test]
    fn infinities_and_out_of_range_years_saturate() {
        assert_eq!(saturated(i64::MAX), DateTime::<Utc>::MAX_UTC);
        assert_eq!(saturated(i64::MIN), DateTime::<Utc>::MIN_UTC);
        // 294276 AD, the latest finite timestamptz, is past chrono's range.
        assert_eq!(
            saturated(9_214_646_400_000_000_000),
            DateTime::<Utc>::MAX_UTC
        );
        assert_eq!(
            saturated(0),
            DateTime::parse_from_rfc3339("2000-01-01T00:00:00Z").unwrap()
        );
    }

    #[test]
    fn json_timestamps_saturate_like_columns() {
        assert_eq!(parse_saturated("infinity"), Some(DateTime::<Utc>::MAX_UTC));
        assert_eq!(parse_saturated("-infinity"), Some(DateTime::<Utc>::MIN_UTC));
        assert_eq!(
            parse_saturated("290000-01-01T00:00:00+00:00"),
            Some(DateTime::<Utc>::MAX_UTC)
        );
        assert_eq!(
            parse_saturated("2026-11-24T21:50:24.600173+00:00").map(|at| at.timestamp()),
            Some(1_795_557_024)
        );
        assert_eq!(
            parse_saturated("0044-03-15T00:00:00+00:00 BC").map(|at| at.year()),
            Some(-43)
        );
        assert_eq!(parse_saturated("soon"), None);
    }
}
