//! The claims a worker holds: every job it claimed whose outcome is not yet saved, whether
//! it waits in the local buffer, runs, or waits for the completer. The heartbeat extends
//! exactly these.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct HeldClaim {
    token: Uuid,
    /// Stops the job's handler (lost claim, hard shutdown).
    stop: CancellationToken,
    /// The handler has returned; only the completer's write remains.
    finished: bool,
}

/// Held claims by job id.
#[derive(Default)]
pub(crate) struct HeldClaims {
    inner: Mutex<HashMap<i64, HeldClaim>>,
}

impl HeldClaims {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, HeldClaim>> {
        // A panic while holding this lock cannot leave the map half-updated: every
        // critical section is a single map operation.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records a new claim and returns the token that stops its handler.
    pub(crate) fn insert(&self, id: i64, token: Uuid) -> CancellationToken {
        let stop = CancellationToken::new();
        self.lock().insert(
            id,
            HeldClaim {
                token,
                stop: stop.clone(),
                finished: false,
            },
        );
        stop
    }

    /// The token that stops a held job's handler.
    pub(crate) fn stop_token(&self, id: i64) -> Option<CancellationToken> {
        self.lock().get(&id).map(|claim| claim.stop.clone())
    }

    /// Notes that a job's handler returned.
    pub(crate) fn mark_finished(&self, id: i64) {
        if let Some(claim) = self.lock().get_mut(&id) {
            claim.finished = true;
        }
    }

    /// Ids and tokens of every held claim, column-wise for the heartbeat statement.
    pub(crate) fn snapshot(&self) -> (Vec<i64>, Vec<Uuid>) {
        self.lock()
            .iter()
            .map(|(id, claim)| (*id, claim.token))
            .unzip()
    }

    /// Forgets claims whose outcome was saved or found stale.
    pub(crate) fn remove_many(&self, ids: &[i64]) {
        let mut map = self.lock();
        for id in ids {
            map.remove(id);
        }
    }

    /// Stops the handlers of claims the database no longer honours; returns the ids whose
    /// handler was still running (the others only awaited their completion write).
    pub(crate) fn stop_lost(&self, ids: &[i64]) -> Vec<i64> {
        let map = self.lock();
        ids.iter()
            .filter_map(|id| {
                let claim = map.get(id)?;
                claim.stop.cancel();
                (!claim.finished).then_some(*id)
            })
            .collect()
    }

    /// Stops every handler (hard shutdown).
    pub(crate) fn stop_all(&self) {
        for claim in self.lock().values() {
            claim.stop.cancel();
        }
    }

    /// Number of held claims.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}
