//! `skiplock migrate`.

use anyhow::Context;

pub async fn run(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let version = skiplock::migrate(pool).await.context("migration failed")?;
    outln!("skiplock schema is at version {version}");
    Ok(())
}
