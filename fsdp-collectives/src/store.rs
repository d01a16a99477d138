//! A small TCP key-value store for rendezvous (plain `std`), after torch's `TCPStore`.
//!
//! Rank 0 hosts the server (and talks to it through an ordinary client connection); the other
//! ranks connect to `MASTER_ADDR:MASTER_PORT`. Keys map to byte strings; `get` and `wait` block
//! *on the server* until the key is set or the timeout passes, so waiting costs no polling.
//! Every blocking call is bounded by the store's timeout.
//!
//! Wire format (big-endian): request `cmd:u8, key_len:u32, key, arg:u64, value_len:u32, value`;
//! response `status:u8, len:u32, payload`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{CollectiveError, Result};

const CMD_SET: u8 = 1;
const CMD_GET: u8 = 2;
const CMD_ADD: u8 = 3;
const CMD_CHECK: u8 = 4;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_MISSING: u8 = 2;
const ST_ERROR: u8 = 3;

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value accepted.
pub const MAX_VALUE_LEN: usize = 64 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct ServerState {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
    shutdown: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    handlers: Mutex<Vec<JoinHandle<()>>>,
}

struct Request {
    cmd: u8,
    key: String,
    arg: u64,
    value: Vec<u8>,
}

fn read_u32(s: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_bytes(s: &mut impl Read, max: usize) -> std::io::Result<Vec<u8>> {
    let n = read_u32(s)? as usize;
    if n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the limit of {max}"),
        ));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_request(s: &mut impl Read) -> std::io::Result<Request> {
    let mut cmd = [0u8; 1];
    s.read_exact(&mut cmd)?;
    let key = String::from_utf8(read_bytes(s, MAX_KEY_LEN)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut arg = [0u8; 8];
    s.read_exact(&mut arg)?;
    let value = read_bytes(s, MAX_VALUE_LEN)?;
    Ok(Request {
        cmd: cmd[0],
        key,
        arg: u64::from_be_bytes(arg),
        value,
    })
}

fn write_frame(s: &mut impl Write, head: u8, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut buf = vec![head];
    for p in parts {
        buf.extend_from_slice(p);
    }
    s.write_all(&buf)?;
    s.flush()
}

fn handle(req: Request, st: &ServerState) -> (u8, Vec<u8>) {
    match req.cmd {
        CMD_SET => {
            lock(&st.map).insert(req.key, req.value);
            st.cv.notify_all();
            (ST_OK, Vec::new())
        }
        CMD_GET => {
            let deadline = Instant::now() + Duration::from_millis(req.arg.min(24 * 3600 * 1000));
            let mut map = lock(&st.map);
            loop {
                if let Some(v) = map.get(&req.key) {
                    return (ST_OK, v.clone());
                }
                let now = Instant::now();
                if now >= deadline || st.shutdown.load(Ordering::Acquire) {
                    return (ST_TIMEOUT, Vec::new());
                }
                map = st
                    .cv
                    .wait_timeout(map, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        CMD_ADD => {
            let mut map = lock(&st.map);
            let cur = match map.get(&req.key) {
                None => 0i64,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_be_bytes(b),
                    Err(_) => {
                        return (
                            ST_ERROR,
                            format!("key {:?} does not hold a counter", req.key).into_bytes(),
                        )
                    }
                },
            };
            let new = cur.wrapping_add(req.arg as i64);
            map.insert(req.key, new.to_be_bytes().to_vec());
            drop(map);
            st.cv.notify_all();
            (ST_OK, new.to_be_bytes().to_vec())
        }
        CMD_CHECK => {
            if lock(&st.map).contains_key(&req.key) {
                (ST_OK, Vec::new())
            } else {
                (ST_MISSING, Vec::new())
            }
        }
        c => (ST_ERROR, format!("unknown command {c}").into_bytes()),
    }
}

fn serve(mut s: TcpStream, st: Arc<ServerState>) {
    while let Ok(req) = read_request(&mut s) {
        let (status, payload) = handle(req, &st);
        let len = (payload.len() as u32).to_be_bytes();
        if write_frame(&mut s, status, &[&len, &payload]).is_err() {
            return;
        }
    }
}

/// The server side of a [`TcpStore`]: a listener thread plus one thread per connection. Dropping
/// it shuts every connection down and joins the threads.
pub struct StoreServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

fn io_err(
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

impl StoreServer {
    /// Binds `addr` (e.g. `127.0.0.1:0` for an ephemeral port) and starts serving.
    pub fn bind(addr: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| io_err(addr, "bind", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| io_err(addr, "local_addr", e))?;
        let state = Arc::new(ServerState {
            map: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            handlers: Mutex::new(Vec::new()),
        });
        let st = Arc::clone(&state);
        let accept = std::thread::Builder::new()
            .name(format!("tcpstore-{local}"))
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.shutdown.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let _ = conn.set_nodelay(true);
                    if let Ok(c) = conn.try_clone() {
                        lock(&st.conns).push(c);
                    }
                    let st2 = Arc::clone(&st);
                    if let Ok(h) = std::thread::Builder::new()
                        .name("tcpstore-conn".into())
                        .spawn(move || serve(conn, st2))
                    {
                        lock(&st.handlers).push(h);
                    }
                }
            })
            .map_err(|e| io_err(local, "spawn the accept thread", e))?;
        Ok(StoreServer {
            addr: local,
            state,
            accept: Some(accept),
        })
    }

    /// The address it listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// An address a local client can connect to (the loopback address if bound to 0.0.0.0/::).
    pub fn connect_addr(&self) -> SocketAddr {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        SocketAddr::new(ip, self.addr.port())
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.state.shutdown.store(true, Ordering::Release);
        {
            // Wake GETs blocked on the condition variable (they see the shutdown flag).
            let _map = lock(&self.state.map);
            self.state.cv.notify_all();
        }
        // Close only the read side: a handler that is answering a request still writes its
        // response (a client whose SET is what let the host leave must get its reply), then
        // reads end-of-file and exits; the joins below wait for that.
        for c in lock(&self.state.conns).drain(..) {
            let _ = c.shutdown(Shutdown::Read);
        }
        // Wake the accept loop with a throwaway connection.
        let _ = TcpStream::connect_timeout(&self.connect_addr(), Duration::from_secs(1));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        // Connections accepted after the drain above.
        for c in lock(&self.state.conns).drain(..) {
            let _ = c.shutdown(Shutdown::Read);
        }
        let handlers: Vec<_> = lock(&self.state.handlers).drain(..).collect();
        for h in handlers {
            let _ = h.join();
        }
    }
}

/// The torchrun-style launch environment: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Host of rank 0's store.
    pub master_addr: String,
    /// Port of rank 0's store.
    pub master_port: u16,
}

impl RendezvousEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<RendezvousEnv> {
        RendezvousEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the four variables through `lookup` (for tests and custom launchers).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<RendezvousEnv> {
        let get = |var: &'static str| -> Result<String> {
            let v = lookup(var).ok_or(CollectiveError::MissingEnv { var })?;
            let t = v.trim().to_string();
            if t.is_empty() {
                return Err(CollectiveError::InvalidEnv {
                    var,
                    value: v,
                    reason: "it is empty".into(),
                });
            }
            Ok(t)
        };
        let num = |var: &'static str| -> Result<usize> {
            let v = get(var)?;
            v.parse::<usize>().map_err(|e| CollectiveError::InvalidEnv {
                var,
                value: v.clone(),
                reason: format!("not a non-negative integer ({e})"),
            })
        };
        let rank = num("RANK")?;
        let world_size = num("WORLD_SIZE")?;
        if world_size == 0 {
            return Err(CollectiveError::InvalidEnv {
                var: "WORLD_SIZE",
                value: "0".into(),
                reason: "there must be at least one rank".into(),
            });
        }
        if rank >= world_size {
            return Err(CollectiveError::InvalidEnv {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("ranks are 0..{world_size} (WORLD_SIZE={world_size})"),
            });
        }
        let master_addr = get("MASTER_ADDR")?;
        let port = get("MASTER_PORT")?;
        let master_port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            Ok(_) => {
                return Err(CollectiveError::InvalidEnv {
                    var: "MASTER_PORT",
                    value: port,
                    reason: "port 0 cannot be reached by the other ranks; pick a fixed port".into(),
                })
            }
            Err(e) => {
                return Err(CollectiveError::InvalidEnv {
                    var: "MASTER_PORT",
                    value: port.clone(),
                    reason: format!("not a TCP port 1..=65535 ({e})"),
                })
            }
        };
        Ok(RendezvousEnv {
            rank,
            world_size,
            master_addr,
            master_port,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// A client of the rendezvous store (on rank 0 it also owns the server).
pub struct TcpStore {
    addr: SocketAddr,
    conn: Mutex<TcpStream>,
    timeout: Duration,
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

fn resolve(addr: &str) -> Result<SocketAddr> {
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

impl TcpStore {
    /// Hosts a store on `bind` (e.g. `127.0.0.1:0`) and connects to it. `timeout` bounds every
    /// blocking call.
    pub fn host(bind: &str, timeout: Duration) -> Result<TcpStore> {
        let server = StoreServer::bind(bind)?;
        let mut store = TcpStore::connect(&server.connect_addr().to_string(), timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` passes (the
    /// server may not be up yet).
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        let (sock, stream) = loop {
            let attempt = resolve(addr).and_then(|sock| {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(10), Duration::from_secs(2));
                TcpStream::connect_timeout(&sock, left)
                    .map(|s| (sock, s))
                    .map_err(|e| io_err(addr, "connect", e))
            });
            match attempt {
                Ok(ok) => break ok,
                Err(e) => {
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
        let _ = stream.set_nodelay(true);
        Ok(TcpStore {
            addr: sock,
            conn: Mutex::new(stream),
            timeout,
            server: None,
        })
    }

    /// Rendezvous as `env` says: rank 0 hosts the store on `MASTER_ADDR:MASTER_PORT`, the other
    /// ranks connect to it.
    pub fn rendezvous(env: &RendezvousEnv, timeout: Duration) -> Result<TcpStore> {
        if env.rank == 0 {
            TcpStore::host(&env.master(), timeout)
        } else {
            TcpStore::connect(&env.master(), timeout)
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

    /// The bound on blocking calls.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn request(
        &self,
        cmd: u8,
        key: &str,
        arg: u64,
        value: &[u8],
        wait: Duration,
    ) -> Result<(u8, Vec<u8>)> {
        if key.len() > MAX_KEY_LEN || value.len() > MAX_VALUE_LEN {
            return Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: format!(
                    "key of {} bytes or value of {} bytes exceeds the limits ({MAX_KEY_LEN}, \
                     {MAX_VALUE_LEN})",
                    key.len(),
                    value.len()
                ),
            });
        }
        let mut conn = lock(&self.conn);
        let e = |action: &str, err: std::io::Error| io_err(self.addr, action, err);
        conn.set_read_timeout(Some(wait + Duration::from_secs(5)))
            .map_err(|x| e("set_read_timeout", x))?;
        write_frame(
            &mut *conn,
            cmd,
            &[
                &(key.len() as u32).to_be_bytes(),
                key.as_bytes(),
                &arg.to_be_bytes(),
                &(value.len() as u32).to_be_bytes(),
                value,
            ],
        )
        .map_err(|x| e("send", x))?;
        let mut status = [0u8; 1];
        conn.read_exact(&mut status).map_err(|x| e("receive", x))?;
        let payload = read_bytes(&mut *conn, MAX_VALUE_LEN).map_err(|x| e("receive", x))?;
        if status[0] == ST_ERROR {
            return Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: String::from_utf8_lossy(&payload).into_owned(),
            });
        }
        Ok((status[0], payload))
    }

    /// Sets `key` to `value` (overwriting).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(CMD_SET, key, 0, value, self.timeout)
            .map(|_| ())
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
            (s, _) => Err(CollectiveError::StoreProtocol {
                addr: self.addr.to_string(),
                detail: format!("unexpected status {s} for get"),
            }),
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
        Ok(self.request(CMD_CHECK, key, 0, &[], self.timeout)?.0 == ST_OK)
    }

    /// Atomically adds `delta` to the counter `key` (starting at 0); the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let (_, v) = self.request(CMD_ADD, key, delta as u64, &[], self.timeout)?;
        let b = <[u8; 8]>::try_from(v.as_slice()).map_err(|_| CollectiveError::StoreProtocol {
            addr: self.addr.to_string(),
            detail: format!("add returned {} bytes instead of 8", v.len()),
        })?;
        Ok(i64::from_be_bytes(b))
    }

    /// Blocks until `world_size` callers have entered the barrier called `name` (use a fresh
    /// name per barrier).
    pub fn barrier(&self, name: &str, world_size: usize) -> Result<()> {
        let n = self.add(&format!("{name}/arrived"), 1)?;
        if n == world_size as i64 {
            self.set(&format!("{name}/done"), b"1")?;
        }
        self.get(&format!("{name}/done")).map(|_| ())
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // Close our own connection before the server (if we host it) shuts down.
        let _ = lock(&self.conn).shutdown(Shutdown::Both);
    }
}
