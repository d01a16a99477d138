//! [`Clock`], the checked mode's vector clock (see the `checked` module).

use std::collections::HashMap;

use crate::stream_id::StreamId;

/// A vector clock: for each stream, the last position known to have happened before.
#[derive(Debug, Clone, Default)]
pub(crate) struct Clock(pub(crate) HashMap<StreamId, u64>);

impl Clock {
    pub(crate) fn get(&self, s: StreamId) -> u64 {
        self.0.get(&s).copied().unwrap_or(0)
    }

    pub(crate) fn advance(&mut self, s: StreamId, pos: u64) {
        let e = self.0.entry(s).or_insert(0);
        *e = (*e).max(pos);
    }

    pub(crate) fn merge(&mut self, other: &Clock) {
        for (&s, &p) in &other.0 {
            self.advance(s, p);
        }
    }

    pub(crate) fn covers(&self, other: &Clock) -> bool {
        other.0.iter().all(|(&s, &p)| self.get(s) >= p)
    }

    /// This clock with the entry of `s` set to exactly `pos` (removed when 0).
    pub(crate) fn with_entry(&self, s: StreamId, pos: u64) -> Clock {
        let mut c = self.clone();
        if pos == 0 {
            c.0.remove(&s);
        } else {
            c.0.insert(s, pos);
        }
        c
    }
}
