//! Configuration of the store: the shared secret, the limits and the timeouts.

use std::time::Duration;

use crate::error::{CollectiveError, Result};

/// The environment variable the launcher sets to the store's shared secret.
pub const SECRET_ENV: &str = "FSDP_STORE_SECRET";

/// The environment variable that allows an open store (no secret) on a non-loopback address
/// (`1`): [`StoreOptions::allow_open_remote`].
pub const ALLOW_OPEN_ENV: &str = "FSDP_STORE_ALLOW_OPEN";

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// Longest key accepted by default ([`StoreLimits::max_key_len`]).
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value accepted by default ([`StoreLimits::max_value_len`]).
pub const MAX_VALUE_LEN: usize = 16 << 20;

/// The shared secret every rank and the host use to authenticate to each other.
///
/// Its `Debug` output is redacted. It is compared only through HMAC tags and never sent.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreSecret(Vec<u8>);

impl std::fmt::Debug for StoreSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreSecret(<{} bytes, redacted>)", self.0.len())
    }
}

impl StoreSecret {
    /// A secret from bytes; at least [`MIN_SECRET_LEN`] of them (use e.g. 32 random hex
    /// characters: `openssl rand -hex 32`).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<StoreSecret> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_LEN {
            return Err(CollectiveError::InvalidEnv {
                var: SECRET_ENV,
                value: "<redacted>".into(),
                reason: format!(
                    "a store secret needs at least {MIN_SECRET_LEN} bytes, this one has {}; use \
                     e.g. `openssl rand -hex 32`",
                    bytes.len()
                ),
            });
        }
        Ok(StoreSecret(bytes))
    }

    /// [`SECRET_ENV`] read through `lookup`: `None` when unset, an error when set but too short.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<StoreSecret>> {
        match lookup(SECRET_ENV) {
            None => Ok(None),
            Some(v) => StoreSecret::new(v.into_bytes()).map(Some),
        }
    }

    /// [`SECRET_ENV`] from the process environment (see [`StoreSecret::from_lookup`]).
    pub fn from_env() -> Result<Option<StoreSecret>> {
        StoreSecret::from_lookup(|k| std::env::var(k).ok())
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Bounds that keep one misbehaving (or hostile) client from exhausting the host.
///
/// Memory held by the store is at most `max_total_bytes` plus `max_inflight_bytes` for the
/// frames being received by all connections together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreLimits {
    /// Open connections at once (one server thread each). When all are taken, the connection
    /// that has waited longest without ever sending a request is closed to make room; when
    /// there is none, the new one is told the store is busy and closed. Default 256.
    pub max_connections: usize,
    /// Longest key in bytes. Default [`MAX_KEY_LEN`].
    pub max_key_len: usize,
    /// Largest value in bytes. Default [`MAX_VALUE_LEN`].
    pub max_value_len: usize,
    /// Sum of the lengths of every stored key and value (and 16 bytes per barrier). Default
    /// 256 MiB.
    pub max_total_bytes: usize,
    /// How long a new connection may take to complete the handshake. Default 10 s.
    pub handshake_timeout: Duration,
    /// How long the rest of a request may take once its first byte has arrived, in total (not
    /// per read). Default 30 s.
    pub frame_timeout: Duration,
    /// Bytes of keys and values being received, all connections together: a request whose
    /// declared key or value does not fit is refused (a `StoreLimit` error; retry later) before
    /// its bytes are read. Default 32 MiB (at least `max_value_len` to let one full value in).
    pub max_inflight_bytes: usize,
    /// Longest time one `get` or `barrier` may block on the server. Default 24 h.
    pub max_wait: Duration,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_connections: 256,
            max_key_len: MAX_KEY_LEN,
            max_value_len: MAX_VALUE_LEN,
            max_total_bytes: 256 << 20,
            handshake_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(30),
            max_inflight_bytes: 32 << 20,
            max_wait: Duration::from_secs(24 * 3600),
        }
    }
}

/// How a [`TcpStore`](super::TcpStore) or [`StoreServer`](super::StoreServer) behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Bound on every blocking client call (connecting included).
    pub timeout: Duration,
    /// The shared secret; `None` runs an open store that anyone who reaches the port can use.
    pub secret: Option<StoreSecret>,
    /// The job's world size, when the host knows it: barriers entered with another world size
    /// are refused. Without it a barrier only checks that its callers agree with each other.
    pub world_size: Option<usize>,
    /// Limits the host enforces (a client also checks its requests against them before
    /// sending).
    pub limits: StoreLimits,
    /// Serve without a secret on a non-loopback address (default `false`: an open store binds
    /// loopback addresses only). [`StoreOptions::from_env`] sets it from [`ALLOW_OPEN_ENV`].
    pub allow_open_remote: bool,
}

impl StoreOptions {
    /// Open store (no secret), default limits, unknown world size.
    pub fn new(timeout: Duration) -> StoreOptions {
        StoreOptions {
            timeout,
            secret: None,
            world_size: None,
            limits: StoreLimits::default(),
            allow_open_remote: false,
        }
    }

    /// Like [`StoreOptions::new`] with the secret from [`SECRET_ENV`] when it is set.
    pub fn from_env(timeout: Duration) -> Result<StoreOptions> {
        Ok(StoreOptions {
            secret: StoreSecret::from_env()?,
            allow_open_remote: std::env::var(ALLOW_OPEN_ENV).is_ok_and(|v| v.trim() == "1"),
            ..StoreOptions::new(timeout)
        })
    }

    /// With this shared secret.
    pub fn with_secret(mut self, secret: StoreSecret) -> StoreOptions {
        self.secret = Some(secret);
        self
    }

    /// With the job's world size (checked by barriers).
    pub fn with_world_size(mut self, world_size: usize) -> StoreOptions {
        self.world_size = Some(world_size);
        self
    }

    /// With these limits.
    pub fn with_limits(mut self, limits: StoreLimits) -> StoreOptions {
        self.limits = limits;
        self
    }
}
