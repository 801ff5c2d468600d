//! `skiplock migrate`.

use anyhow::Context;

pub async fn run(pool: &skiplock::unstable_cli::DbPool) -> anyhow::Result<()> {
    let version = skiplock::migrate(pool.pool())
        .await
        .context("migration failed")?;
    outln!("skiplock schema is at version {version}");
    Ok(())
}
