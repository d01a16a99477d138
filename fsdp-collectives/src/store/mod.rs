//! A small TCP key-value store for rendezvous (plain `std`), after torch's `TCPStore`.
//!
//! Rank 0 hosts the server (and talks to it through an ordinary client connection); the other
//! ranks connect to `MASTER_ADDR:MASTER_PORT`. Keys map to byte strings; `get`, `wait` and
//! `barrier` block *on the server* until the key is set (or every rank has arrived) or the
//! timeout passes, so waiting costs no polling. Every blocking call is bounded by the store's
//! timeout. [`RendezvousEnv`] / [`LaunchEnv`] read rank, world size and local rank from
//! torchrun, `mpirun` (Open MPI, MPICH/PMI) or `srun`.
//!
//! # Security: what exposing the port means
//!
//! The store binds exactly `MASTER_ADDR` (resolved the way clients resolve it), never a
//! wildcard address unless `MASTER_ADDR` is one. Every host that can reach that address and
//! port can open a connection. Without a secret, such a host can read every key (the NCCL
//! unique id among them), overwrite keys, and pass or break barriers: so an open store binds
//! loopback addresses only, unless told that the network is trusted
//! ([`StoreOptions::allow_open_remote`], or `FSDP_STORE_ALLOW_OPEN=1` with
//! [`StoreOptions::from_env`]).
//!
//! With a shared secret ([`SECRET_ENV`] = `FSDP_STORE_SECRET`, set by the launcher to the same
//! value for every rank, e.g. `export FSDP_STORE_SECRET=$(openssl rand -hex 32)` before
//! `mpirun -x FSDP_STORE_SECRET ...` or `srun`), every connection starts with an HMAC-SHA256
//! challenge-response over fresh random nonces from both sides: a client that does not hold the
//! secret is refused before it can read or write anything, and a client that holds it refuses a
//! server that does not (so a rank is not fooled by an impostor store). The secret never crosses
//! the wire. What it does **not** give: confidentiality or integrity of the traffic after the
//! handshake (values travel in clear, and an attacker who can rewrite packets on the path can
//! still tamper with an authenticated connection) — use a private network or a tunnel for that.
//!
//! Whoever reaches the port can still open connections: they are bounded
//! ([`StoreLimits::max_connections`]), must finish the handshake within
//! [`StoreLimits::handshake_timeout`], are closed at the first protocol error, and key, value
//! and total sizes are bounded, so a hostile or broken client cannot exhaust the host's
//! descriptors, threads or memory: the bytes being received are bounded for all connections
//! together ([`StoreLimits::max_inflight_bytes`]), each request's frame has one deadline
//! ([`StoreLimits::frame_timeout`], not per read), and when every slot is taken the connection
//! that waited longest without ever sending a request is closed to make room (every
//! [`TcpStore`] client sends one request as it connects). A client that sends one request and
//! then holds its connection still occupies a slot.
//!
//! Wire format: see the `wire` module source (big-endian frames; request
//! `cmd:u8, key_len:u32, key, arg:u64, value_len:u32, value`; response
//! `status:u8, len:u32, payload`).

mod env;
mod options;
mod server;
mod wire;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use env::{LaunchEnv, Launcher, RendezvousEnv, LAUNCHER_ENV};
pub use options::{
    StoreLimits, StoreOptions, StoreSecret, ALLOW_OPEN_ENV, MAX_KEY_LEN, MAX_VALUE_LEN,
    MIN_SECRET_LEN, SECRET_ENV,
};
pub use server::StoreServer;

use crate::error::{CollectiveError, Result};
use wire::*;

/// Locks `m`, taking the guard from a poisoned lock as well (moved here from `server.rs`, which
/// imports this file's helpers, so that this file does not import `server.rs` back).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn io_err(
    addr: impl std::fmt::Display,
    action: &str,
    e: impl std::fmt::Display,
) -> CollectiveError {
    CollectiveError::StoreIo {
        addr: addr.to_string(),
        action: action.to_string(),
        message: e.to_string(),
    }
}

/// The one address `addr` stands for, the same on the host (which binds it) and on clients
/// (which connect to it): the first IPv4 address it resolves to, else the first address.
pub(crate) fn resolve(addr: &str) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| io_err(addr, "resolve", e))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| io_err(addr, "resolve", "no address found"))
}

/// A client of the rendezvous store (on rank 0 it also owns the server).
pub struct TcpStore {
    addr: SocketAddr,
    conn: Mutex<TcpStream>,
    timeout: Duration,
    limits: StoreLimits,
    server: Option<StoreServer>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .field("hosts_server", &self.server.is_some())
            .finish()
    }
}

/// Why one connection attempt failed: worth retrying (nobody listening yet, store busy) or not.
enum Attempt {
    Retry(CollectiveError),
    Fatal(CollectiveError),
}

fn client_handshake(
    stream: &mut TcpStream,
    addr: SocketAddr,
    secret: Option<&StoreSecret>,
) -> std::result::Result<(), Attempt> {
    let io = |action: &str, e: std::io::Error| Attempt::Retry(io_err(addr, action, e));
    let proto = |detail: &str| {
        Attempt::Fatal(CollectiveError::StoreProtocol {
            addr: addr.to_string(),
            detail: detail.to_string(),
        })
    };
    let auth = |detail: &str| {
        Attempt::Fatal(CollectiveError::StoreAuth {
            addr: addr.to_string(),
            detail: detail.to_string(),
        })
    };
    let mut greet = [0u8; 8 + 1 + NONCE_LEN];
    stream
        .read_exact(&mut greet)
        .map_err(|e| io("read the greeting", e))?;
    if &greet[..8] != MAGIC {
        return Err(proto("the peer is not an fsdp-rs store (bad greeting)"));
    }
    let server_nonce = &greet[9..];
    match (greet[8], secret) {
        (GREET_BUSY, _) => {
            return Err(Attempt::Retry(io_err(
                addr,
                "connect",
                "the store is busy (every connection slot is taken)",
            )))
        }
        (GREET_AUTH, None) => {
            return Err(auth(
                "the store requires a shared secret and this process has none (set \
                 FSDP_STORE_SECRET)",
            ))
        }
        (GREET_OPEN, Some(_)) => {
            return Err(auth(
                "this process has a secret but the store does not authenticate, so it could be \
                 anyone's; refusing it (start the host with the same FSDP_STORE_SECRET)",
            ))
        }
        (GREET_OPEN | GREET_AUTH, _) => {}
        _ => return Err(proto("unknown greeting")),
    }
    let client_nonce = nonce().map_err(|e| Attempt::Fatal(io_err(addr, "make a nonce", e)))?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&client_nonce);
    match secret {
        Some(s) => {
            hello.extend_from_slice(&tag(s.bytes(), CLIENT_LABEL, server_nonce, &client_nonce))
        }
        None => hello.extend_from_slice(&[0u8; TAG_LEN]),
    }
    stream
        .write_all(&hello)
        .map_err(|e| io("send the hello", e))?;
    let mut status = [0u8; 1];
    stream
        .read_exact(&mut status)
        .map_err(|e| io("read the handshake reply", e))?;
    let n = read_u32(stream).map_err(|e| io("read the handshake reply", e))? as usize;
    if n > 4096 {
        return Err(proto("oversized handshake reply"));
    }
    let payload = read_exact_vec(stream, n).map_err(|e| io("read the handshake reply", e))?;
    match status[0] {
        ST_OK => {}
        ST_AUTH => return Err(auth(&String::from_utf8_lossy(&payload))),
        _ => return Err(proto(&String::from_utf8_lossy(&payload))),
    }
    if let Some(s) = secret {
        if !verify(
            s.bytes(),
            SERVER_LABEL,
            server_nonce,
            &client_nonce,
            &payload,
        ) {
            return Err(auth(
                "the store could not prove it holds the secret (wrong FSDP_STORE_SECRET on the \
                 host, or an impostor)",
            ));
        }
    }
    Ok(())
}

impl TcpStore {
    /// Hosts a store on `bind` (e.g. `127.0.0.1:0`) and connects to it, with the secret from
    /// `FSDP_STORE_SECRET` when set. `timeout` bounds every blocking call.
    pub fn host(bind: &str, timeout: Duration) -> Result<TcpStore> {
        TcpStore::host_with(bind, StoreOptions::from_env(timeout)?)
    }

    /// Hosts a store on exactly `bind` with `options` and connects to it.
    pub fn host_with(bind: &str, options: StoreOptions) -> Result<TcpStore> {
        let server = StoreServer::bind_with(bind, &options)?;
        let mut store = TcpStore::connect_with(&server.connect_addr().to_string(), options)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to the store at `addr` (`host:port`) with the secret from `FSDP_STORE_SECRET`
    /// when set, retrying until `timeout` passes (the server may not be up yet).
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        TcpStore::connect_with(addr, StoreOptions::from_env(timeout)?)
    }

    /// Connects to the store at `addr` with `options`, retrying (nobody listening yet, store
    /// busy) until `options.timeout` passes. Authentication failures are not retried.
    pub fn connect_with(addr: &str, options: StoreOptions) -> Result<TcpStore> {
        let timeout = options.timeout;
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        let (sock, stream) = loop {
            let attempt = resolve(addr).map_err(Attempt::Retry).and_then(|sock| {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(10), Duration::from_secs(2));
                let mut s = TcpStream::connect_timeout(&sock, left)
                    .map_err(|e| Attempt::Retry(io_err(addr, "connect", e)))?;
                let _ = s.set_nodelay(true);
                s.set_read_timeout(Some(left.max(Duration::from_millis(500))))
                    .map_err(|e| Attempt::Fatal(io_err(sock, "set_read_timeout", e)))?;
                client_handshake(&mut s, sock, options.secret.as_ref())?;
                Ok((sock, s))
            });
            match attempt {
                Ok(ok) => break ok,
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    if Instant::now() + backoff >= deadline {
                        return Err(match e {
                            CollectiveError::StoreIo { addr, message, .. } => {
                                CollectiveError::StoreIo {
                                    addr,
                                    action: format!("connect (gave up after {timeout:?})"),
                                    message,
                                }
                            }
                            other => other,
                        });
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                }
            }
        };
        let store = TcpStore {
            addr: sock,
            conn: Mutex::new(stream),
            timeout,
            limits: options.limits,
            server: None,
        };
        // One request right away: a server that runs out of connection slots closes only
        // connections that never sent one (clients that connected and did nothing).
        store.check("")?;
        Ok(store)
    }

    /// Rendezvous as `env` says: rank 0 hosts the store on exactly `MASTER_ADDR:MASTER_PORT`
    /// (knowing the world size, so barriers check it), the other ranks connect to it. The
    /// secret comes from `FSDP_STORE_SECRET` when set.
    pub fn rendezvous(env: &RendezvousEnv, timeout: Duration) -> Result<TcpStore> {
        TcpStore::rendezvous_with(env, StoreOptions::from_env(timeout)?)
    }

    /// [`TcpStore::rendezvous`] with explicit options (the world size is taken from `env`).
    pub fn rendezvous_with(env: &RendezvousEnv, options: StoreOptions) -> Result<TcpStore> {
        let options = options.with_world_size(env.world_size);
        if env.rank == 0 {
            TcpStore::host_with(&env.master(), options)
        } else {
            TcpStore::connect_with(&env.master(), options)
        }
    }

    /// [`RendezvousEnv::from_env`] followed by [`TcpStore::rendezvous`].
    pub fn from_env(timeout: Duration) -> Result<(TcpStore, RendezvousEnv)> {
        let env = RendezvousEnv::from_env()?;
        Ok((TcpStore::rendezvous(&env, timeout)?, env))
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// True on the rank that hosts the server.
    pub fn is_host(&self) -> bool {
        self.server.is_some()
    }

    /// The server, on the rank that hosts it.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    /// The bound on blocking calls.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn limit_err(&self, what: u8, size: usize, limit: usize) -> CollectiveError {
        CollectiveError::StoreLimit {
            addr: self.addr.to_string(),
            what: limit_name(what),
            size: size as u64,
            limit: limit as u64,
        }
    }

    fn request(
        &self,
        cmd: u8,
        key: &str,
        arg: u64,
        value: &[u8],
        wait: Duration,
    ) -> Result<(u8, Vec<u8>)> {
        if key.len() > self.limits.max_key_len {
            return Err(self.limit_err(LIMIT_KEY, key.len(), self.limits.max_key_len));
        }
        if value.len() > self.limits.max_value_len {
            return Err(self.limit_err(LIMIT_VALUE, value.len(), self.limits.max_value_len));
        }
        let (Ok(key_len), Ok(value_len)) = (u32::try_from(key.len()), u32::try_from(value.len()))
        else {
            return Err(self.limit_err(LIMIT_VALUE, value.len(), u32::MAX as usize));
        };
        let mut conn = lock(&self.conn);
        let e = |action: &str, err: std::io::Error| io_err(self.addr, action, err);
        conn.set_read_timeout(Some(wait + Duration::from_secs(5)))
            .map_err(|x| e("set_read_timeout", x))?;
        write_frame(
            &mut *conn,
            cmd,
            &[
                &key_len.to_be_bytes(),
                key.as_bytes(),
                &arg.to_be_bytes(),
                &value_len.to_be_bytes(),
                value,
            ],
        )
        .map_err(|x| e("send", x))?;
        let mut status = [0u8; 1];
        conn.read_exact(&mut status).map_err(|x| e("receive", x))?;
        let n = read_u32(&mut *conn).map_err(|x| e("receive", x))? as usize;
        if n > self.limits.max_value_len.max(4096) {
            return Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: format!("response of {n} bytes exceeds this client's value limit"),
            });
        }
        let payload = read_exact_vec(&mut *conn, n).map_err(|x| e("receive", x))?;
        drop(conn);
        match status[0] {
            ST_ERROR => Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: String::from_utf8_lossy(&payload).into_owned(),
            }),
            ST_LIMIT if payload.len() == 17 => {
                let num = |r: std::ops::Range<usize>| {
                    u64::from_be_bytes(payload[r].try_into().unwrap_or([0; 8]))
                };
                Err(CollectiveError::StoreLimit {
                    addr: self.addr.to_string(),
                    what: limit_name(payload[0]),
                    size: num(1..9),
                    limit: num(9..17),
                })
            }
            s => Ok((s, payload)),
        }
    }

    fn unexpected(&self, status: u8, what: &str) -> CollectiveError {
        CollectiveError::StoreProtocol {
            addr: self.addr.to_string(),
            detail: format!("unexpected status {status} for {what}"),
        }
    }

    /// Sets `key` to `value` (overwriting).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.request(CMD_SET, key, 0, value, self.timeout)? {
            (ST_OK, _) => Ok(()),
            (s, _) => Err(self.unexpected(s, "set")),
        }
    }

    /// The value of `key`, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.request(CMD_GET, key, ms, &[], timeout)? {
            (ST_OK, v) => Ok(v),
            (ST_TIMEOUT, _) => Err(CollectiveError::StoreTimeout {
                addr: self.addr.to_string(),
                key: key.to_string(),
                waited: timeout,
            }),
            (s, _) => Err(self.unexpected(s, "get")),
        }
    }

    /// Waits until every key in `keys` is set (bounded by the store's timeout overall).
    pub fn wait(&self, keys: &[&str]) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        for k in keys {
            let left = deadline.saturating_duration_since(Instant::now());
            self.get_timeout(k, left)?;
        }
        Ok(())
    }

    /// True if `key` is set (never blocks on the key).
    pub fn check(&self, key: &str) -> Result<bool> {
        match self.request(CMD_CHECK, key, 0, &[], self.timeout)? {
            (ST_OK, _) => Ok(true),
            (ST_MISSING, _) => Ok(false),
            (s, _) => Err(self.unexpected(s, "check")),
        }
    }

    /// Atomically adds `delta` to the counter `key` (starting at 0); the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let (s, v) = self.request(CMD_ADD, key, delta as u64, &[], self.timeout)?;
        if s != ST_OK {
            return Err(self.unexpected(s, "add"));
        }
        let b = <[u8; 8]>::try_from(v.as_slice()).map_err(|_| CollectiveError::StoreProtocol {
            addr: self.addr.to_string(),
            detail: format!("add returned {} bytes instead of 8", v.len()),
        })?;
        Ok(i64::from_be_bytes(b))
    }

    /// Blocks until `world_size` callers have entered the barrier called `name` (use a fresh
    /// name per barrier), up to the store's timeout.
    ///
    /// The store refuses ([`CollectiveError::StoreBarrier`]) a `world_size` that differs from
    /// the job's (when the host knows it: [`StoreOptions::world_size`], set by
    /// [`TcpStore::rendezvous`]) or from the first caller's of this barrier, and a caller
    /// beyond `world_size`. Barriers live on the server, so a barrier name costs its length
    /// against the store's total-bytes limit.
    pub fn barrier(&self, name: &str, world_size: usize) -> Result<()> {
        if world_size == 0 {
            return Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: format!("barrier {name:?} with world size 0"),
            });
        }
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        match self.request(
            CMD_BARRIER,
            name,
            world_size as u64,
            &ms.to_be_bytes(),
            self.timeout,
        )? {
            (ST_OK, _) => Ok(()),
            (ST_TIMEOUT, _) => Err(CollectiveError::StoreTimeout {
                addr: self.addr.to_string(),
                key: name.to_string(),
                waited: self.timeout,
            }),
            (ST_BARRIER, p) if p.len() == 9 => {
                let expected = u64::from_be_bytes(p[..8].try_into().unwrap_or([0; 8]));
                Err(CollectiveError::StoreBarrier {
                    addr: self.addr.to_string(),
                    name: name.to_string(),
                    got: world_size,
                    expected: usize::try_from(expected).unwrap_or(usize::MAX),
                    source_of_expected: if p[8] == 1 {
                        "job's world size"
                    } else {
                        "world size its first caller passed"
                    },
                })
            }
            (s, _) => Err(self.unexpected(s, "barrier")),
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // Close our own connection before the server (if we host it) shuts down.
        let _ = lock(&self.conn).shutdown(Shutdown::Both);
    }
}
