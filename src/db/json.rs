//! JSON read back from rows a person may have written by hand.
//!
//! A `jsonb` column accepts JSON that serde_json cannot hold: a number beyond `f64`
//! (`1e400`) or nesting deeper than serde_json's 128 levels. Decoded as `Json<Value>`, such
//! a value failed its whole row, and with it every statement that returned the row: one job
//! with `args = '1e400'` (a plain `INSERT` accepts it) failed every claim of its queue, so
//! the queue stopped, and `skiplock jobs` and `show` failed. [`json_lossy`] gives such a
//! value as its text, in a JSON string, and the rest of the row as it is: the job's handler
//! then fails to decode its args (the job fails, not the queue), and a listing shows it.

use serde_json::Value;
use sqlx::postgres::{PgRow, PgValueFormat};
use sqlx::types::Json;
use sqlx::{ColumnIndex, Row, ValueRef};

/// A `jsonb` (or `json`) column; `None` for SQL NULL. What serde_json cannot hold comes back
/// as its text in a [`Value::String`] (see the module doc).
pub fn json_lossy<I>(row: &PgRow, index: I) -> sqlx::Result<Option<Value>>
where
    I: ColumnIndex<PgRow> + Copy,
{
    match row.try_get::<Option<Json<Value>>, _>(index) {
        Ok(value) => Ok(value.map(|json| json.0)),
        Err(sqlx::Error::ColumnDecode { .. }) => {
            let raw = row.try_get_raw(index)?;
            if raw.is_null() {
                return Ok(None);
            }
            let format = raw.format();
            let bytes = raw.as_bytes().map_err(|source| sqlx::Error::ColumnDecode {
                index: "json".into(),
                source,
            })?;
            // jsonb's binary form: a version byte (1), then the JSON text.
            let text = match (format, bytes.split_first()) {
                (PgValueFormat::Binary, Some((1, rest))) => rest,
                _ => bytes,
            };
            Ok(Some(Value::String(
                String::from_utf8_lossy(text).into_owned(),
            )))
        }
        Err(other) => Err(other),
    }
}
