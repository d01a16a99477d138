//! The store's server: an accept thread plus one thread per (bounded) connection.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::options::{StoreLimits, StoreOptions, StoreSecret};
use super::wire::*;
use super::{io_err, lock, resolve};
use crate::error::Result;

/// How often a blocked `get`/`barrier` wakes to see whether its client hung up.
const POLL: Duration = Duration::from_millis(200);
/// Bytes a barrier costs against `max_total_bytes` besides its name.
const BARRIER_COST: usize = 16;

struct Barrier {
    world_size: usize,
    arrived: usize,
}

#[derive(Default)]
struct Data {
    map: HashMap<String, Vec<u8>>,
    barriers: HashMap<String, Barrier>,
    bytes: usize,
}

/// One open connection as the accept thread sees it.
struct Conn {
    /// A clone of the socket (to shut it down from `Drop` or on eviction).
    sock: TcpStream,
    /// The handler thread.
    handle: Option<JoinHandle<()>>,
    /// Since when it has been waiting for its client (handshake or next request); `None` while
    /// a request is being read or answered.
    idle_since: Option<Instant>,
    /// Requests answered so far.
    served: u64,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    /// Open connections.
    live: HashMap<u64, Conn>,
}

impl Conns {
    /// When every slot is taken: closes the connection that has waited longest without ever
    /// sending a request (a client that connected and did nothing), freeing its slot. Never a
    /// connection that has been served (a rank between requests) or one in the middle of a
    /// request. Returns whether a slot was freed.
    fn evict_idle(&mut self) -> bool {
        let victim = self
            .live
            .iter()
            .filter(|(_, c)| c.served == 0)
            .filter_map(|(id, c)| c.idle_since.map(|t| (t, *id)))
            .min();
        match victim.and_then(|(_, id)| self.live.remove(&id)) {
            Some(c) => {
                // Its handler sees the shutdown, ends, and finds itself already forgotten.
                let _ = c.sock.shutdown(Shutdown::Both);
                true
            }
            None => false,
        }
    }
}

struct Shared {
    data: Mutex<Data>,
    cv: Condvar,
    shutdown: AtomicBool,
    conns: Mutex<Conns>,
    /// Bytes reserved by requests being received, all connections together
    /// ([`StoreLimits::max_inflight_bytes`]).
    inflight: AtomicUsize,
    limits: StoreLimits,
    secret: Option<StoreSecret>,
    world_size: Option<usize>,
}

/// The server side of a [`TcpStore`](super::TcpStore): an accept thread plus one thread per
/// connection, at most [`StoreLimits::max_connections`] of them. A connection is closed and
/// forgotten as soon as its client hangs up, fails the handshake or breaks the protocol.
/// Dropping the server shuts every connection down and joins the threads.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("authenticated", &self.shared.secret.is_some())
            .field("connections", &self.connection_count())
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (e.g. `127.0.0.1:0` for an ephemeral port) and starts serving, with the
    /// secret from `FSDP_STORE_SECRET` when it is set and default limits.
    pub fn bind(addr: &str) -> Result<StoreServer> {
        StoreServer::bind_with(addr, &StoreOptions::from_env(Duration::from_secs(30))?)
    }

    /// Binds exactly the address `addr` resolves to (the one clients connect to: its IPv4
    /// address when it has one; never a wildcard unless `addr` is one) and starts serving with
    /// `options`' secret, limits and world size.
    ///
    /// Without a secret the store binds only loopback addresses (anyone who reaches an open
    /// store can use it) unless [`StoreOptions::allow_open_remote`] is set.
    pub fn bind_with(addr: &str, options: &StoreOptions) -> Result<StoreServer> {
        let sock = resolve(addr)?;
        if options.secret.is_none() && !options.allow_open_remote && !sock.ip().is_loopback() {
            return Err(io_err(
                addr,
                "bind",
                format!(
                    "refusing to serve a store without a secret on the non-loopback address \
                     {sock}: anyone who reaches it could use it; set {} on every process (e.g. \
                     `openssl rand -hex 32`), or set {}=1 to allow an open store on a trusted \
                     network",
                    super::options::SECRET_ENV,
                    super::options::ALLOW_OPEN_ENV
                ),
            ));
        }
        let listener = TcpListener::bind(sock).map_err(|e| io_err(addr, "bind", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| io_err(addr, "local_addr", e))?;
        let shared = Arc::new(Shared {
            data: Mutex::new(Data::default()),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            inflight: AtomicUsize::new(0),
            limits: options.limits.clone(),
            secret: options.secret.clone(),
            world_size: options.world_size,
        });
        let st = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name(format!("tcpstore-{local}"))
            .spawn(move || accept_loop(listener, st))
            .map_err(|e| io_err(local, "spawn the accept thread", e))?;
        Ok(StoreServer {
            addr: local,
            shared,
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

    /// Connections open right now (handshaking or authenticated).
    pub fn connection_count(&self) -> usize {
        lock(&self.shared.conns).live.len()
    }

    /// Bytes reserved right now by requests being received, as counted against
    /// [`StoreLimits::max_inflight_bytes`].
    pub fn inflight_bytes(&self) -> usize {
        self.shared.inflight.load(Ordering::Acquire)
    }

    /// Bytes stored right now, as counted against [`StoreLimits::max_total_bytes`].
    pub fn stored_bytes(&self) -> usize {
        lock(&self.shared.data).bytes
    }

    /// True when clients must authenticate with the shared secret.
    pub fn is_authenticated(&self) -> bool {
        self.shared.secret.is_some()
    }
}

fn accept_loop(listener: TcpListener, st: Arc<Shared>) {
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = listener.accept();
        if st.shutdown.load(Ordering::Acquire) {
            break;
        }
        let conn = match accepted {
            Ok((conn, _)) => {
                backoff = Duration::ZERO;
                conn
            }
            Err(_) => {
                // Out of descriptors (EMFILE/ENFILE), out of memory, or a connection reset
                // before we took it: wait instead of spinning, longer while it persists.
                backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_millis(500));
                std::thread::sleep(backoff);
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        let _ = conn.set_write_timeout(Some(st.limits.frame_timeout));
        let mut conns = lock(&st.conns);
        if conns.live.len() >= st.limits.max_connections && !conns.evict_idle() {
            drop(conns);
            refuse_busy(conn);
            continue;
        }
        let Ok(clone) = conn.try_clone() else {
            continue; // dropping `conn` closes it
        };
        let id = conns.next_id;
        conns.next_id += 1;
        conns.live.insert(
            id,
            Conn {
                sock: clone,
                handle: None,
                idle_since: Some(Instant::now()),
                served: 0,
            },
        );
        drop(conns);
        let st2 = Arc::clone(&st);
        match std::thread::Builder::new()
            .name("tcpstore-conn".into())
            .spawn(move || serve(conn, id, st2))
        {
            Ok(h) => {
                if let Some(entry) = lock(&st.conns).live.get_mut(&id) {
                    entry.handle = Some(h);
                }
                // Otherwise the handler has already finished and forgotten itself.
            }
            Err(_) => {
                // No thread for it: forget and close it (the closure, and its socket, dropped).
                lock(&st.conns).live.remove(&id);
            }
        }
    }
}

fn refuse_busy(mut conn: TcpStream) {
    let _ = conn.set_write_timeout(Some(Duration::from_millis(100)));
    let mut greet = MAGIC.to_vec();
    greet.push(GREET_BUSY);
    greet.extend_from_slice(&[0u8; NONCE_LEN]);
    let _ = conn.write_all(&greet);
    let _ = conn.shutdown(Shutdown::Both);
}

/// Forgets (and so closes) the connection when its handler ends, however it ends.
struct Forget<'a> {
    id: u64,
    st: &'a Shared,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        // Dropping the entry closes our clone of the socket; the handler's own copy is closed
        // when `serve` returns. The JoinHandle (if any) is detached: this thread is ending.
        let entry = lock(&self.st.conns).live.remove(&self.id);
        if let Some(c) = entry {
            let _ = c.sock.shutdown(Shutdown::Both);
        }
    }
}

fn serve(mut s: TcpStream, id: u64, st: Arc<Shared>) {
    let _forget = Forget { id, st: &st };
    if handshake(&mut s, &st).is_err() {
        return;
    }
    let mark = |idle: bool, served: bool| {
        if let Some(c) = lock(&st.conns).live.get_mut(&id) {
            c.idle_since = idle.then(Instant::now);
            c.served += u64::from(served);
        }
    };
    mark(true, false);
    loop {
        let mut cmd = [0u8; 1];
        // Authenticated ranks may stay idle for the whole job: no timeout for the first byte.
        if s.set_read_timeout(None).is_err() || s.read_exact(&mut cmd).is_err() {
            return;
        }
        mark(false, false);
        // The rest of the frame must arrive within `frame_timeout` of its first byte, in total
        // (a per-read timeout would let one byte every few seconds hold it open forever).
        let mut frame = Deadline {
            s: &s,
            until: Instant::now() + st.limits.frame_timeout,
        };
        let (status, payload, keep) = match read_rest(&mut frame, cmd[0], &st) {
            Ok(Ok((req, _reserved))) => handle(req, &s, &st),
            Ok(Err((status, payload))) => (status, payload, false),
            Err(_) => return, // the peer broke off mid-frame or missed the deadline
        };
        if write_response(&mut s, status, &payload).is_err() || !keep {
            return;
        }
        mark(true, true);
    }
}

/// Reads from a socket with one deadline for all the reads together.
struct Deadline<'a> {
    s: &'a TcpStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the frame's deadline passed",
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

/// Bytes of [`StoreLimits::max_inflight_bytes`] held by one request being received; given back
/// when dropped.
struct Reservation<'a> {
    st: &'a Shared,
    bytes: usize,
}

impl<'a> Reservation<'a> {
    /// Reserves `bytes` more, or `None` when all connections together would exceed the budget.
    fn grow(&mut self, bytes: usize) -> bool {
        let limit = self.st.limits.max_inflight_bytes;
        let ok = self
            .st
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(bytes).filter(|&n| n <= limit)
            })
            .is_ok();
        if ok {
            self.bytes += bytes;
        }
        ok
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.st.inflight.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

fn handshake(s: &mut TcpStream, st: &Shared) -> std::io::Result<()> {
    let until = Instant::now() + st.limits.handshake_timeout;
    let server_nonce = nonce()?;
    let mut greet = MAGIC.to_vec();
    greet.push(if st.secret.is_some() {
        GREET_AUTH
    } else {
        GREET_OPEN
    });
    greet.extend_from_slice(&server_nonce);
    s.write_all(&greet)?;
    let mut hello = [0u8; 8 + NONCE_LEN + TAG_LEN];
    Deadline { s, until }.read_exact(&mut hello)?;
    let refuse = |s: &mut TcpStream, status: u8, msg: &str| -> std::io::Result<()> {
        write_response(s, status, msg.as_bytes())?;
        Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg))
    };
    if &hello[..8] != MAGIC {
        return refuse(s, ST_ERROR, "not an fsdp-rs store client (bad handshake)");
    }
    let client_nonce = &hello[8..8 + NONCE_LEN];
    let tag_in = &hello[8 + NONCE_LEN..];
    match &st.secret {
        None => write_response(s, ST_OK, &[]),
        Some(secret) => {
            if verify(
                secret.bytes(),
                CLIENT_LABEL,
                &server_nonce,
                client_nonce,
                tag_in,
            ) {
                let proof = tag(secret.bytes(), SERVER_LABEL, &server_nonce, client_nonce);
                write_response(s, ST_OK, &proof)
            } else {
                refuse(
                    s,
                    ST_AUTH,
                    "the client does not hold the store's secret (wrong or missing)",
                )
            }
        }
    }
}

struct Request {
    cmd: u8,
    key: String,
    arg: u64,
    value: Vec<u8>,
}

type Refusal = (u8, Vec<u8>);

/// The rest of a request after its command byte, with its key and value reserved against the
/// in-flight budget before they are read (the reservation ends with the request). `Err` is an
/// I/O failure (close silently); `Ok(Err(..))` a protocol violation to report before closing.
fn read_rest<'a>(
    s: &mut impl Read,
    cmd: u8,
    st: &'a Shared,
) -> std::io::Result<std::result::Result<(Request, Reservation<'a>), Refusal>> {
    let limits = &st.limits;
    let mut reserved = Reservation { st, bytes: 0 };
    let busy = |size: usize| {
        Ok(Err((
            ST_LIMIT,
            limit_payload(
                LIMIT_INFLIGHT,
                size as u64,
                limits.max_inflight_bytes as u64,
            ),
        )))
    };
    if !matches!(cmd, CMD_SET | CMD_GET | CMD_ADD | CMD_CHECK | CMD_BARRIER) {
        return Ok(Err((
            ST_ERROR,
            format!("unknown command {cmd}").into_bytes(),
        )));
    }
    let key_len = read_u32(s)? as usize;
    if key_len > limits.max_key_len {
        return Ok(Err((
            ST_LIMIT,
            limit_payload(LIMIT_KEY, key_len as u64, limits.max_key_len as u64),
        )));
    }
    if !reserved.grow(key_len) {
        return busy(key_len);
    }
    let key = match String::from_utf8(read_exact_vec(s, key_len)?) {
        Ok(k) => k,
        Err(_) => return Ok(Err((ST_ERROR, b"key is not UTF-8".to_vec()))),
    };
    let arg = read_u64(s)?;
    let value_len = read_u32(s)? as usize;
    if value_len > limits.max_value_len {
        return Ok(Err((
            ST_LIMIT,
            limit_payload(LIMIT_VALUE, value_len as u64, limits.max_value_len as u64),
        )));
    }
    if !reserved.grow(value_len) {
        return busy(value_len);
    }
    let value = read_exact_vec(s, value_len)?;
    Ok(Ok((
        Request {
            cmd,
            key,
            arg,
            value,
        },
        reserved,
    )))
}

/// True if a blocked request should be abandoned: the client closed its end, the socket failed,
/// or the client sent more bytes while waiting for the answer (our clients never pipeline).
fn peer_gone(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let r = s.peek(&mut [0u8; 1]);
    let _ = s.set_nonblocking(false);
    !matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// How a blocking wait ended.
#[derive(PartialEq, Eq)]
enum Waited {
    /// The condition holds.
    Done,
    /// The deadline passed or the server is shutting down.
    Expired,
    /// The client hung up or broke the protocol: close the connection.
    Abandoned,
}

/// Waits on the condition variable until `done` holds, the deadline passes, the server shuts
/// down or the client goes away (checked every [`POLL`]).
fn wait_until<'a>(
    st: &'a Shared,
    s: &TcpStream,
    mut data: MutexGuard<'a, Data>,
    deadline: Instant,
    done: impl Fn(&Data) -> bool,
) -> (MutexGuard<'a, Data>, Waited) {
    loop {
        if done(&data) {
            return (data, Waited::Done);
        }
        let now = Instant::now();
        if now >= deadline || st.shutdown.load(Ordering::Acquire) {
            return (data, Waited::Expired);
        }
        data = st
            .cv
            .wait_timeout(data, (deadline - now).min(POLL))
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if !done(&data) {
            drop(data);
            if peer_gone(s) {
                return (lock(&st.data), Waited::Abandoned);
            }
            data = lock(&st.data);
        }
    }
}

/// Answers a well-formed request: `(status, payload, keep the connection open)`.
fn handle(req: Request, s: &TcpStream, st: &Shared) -> (u8, Vec<u8>, bool) {
    let limits = &st.limits;
    let wait_for = |ms: u64| Duration::from_millis(ms).min(limits.max_wait);
    let over_total = |size: usize| {
        (
            ST_LIMIT,
            limit_payload(LIMIT_TOTAL, size as u64, limits.max_total_bytes as u64),
            true,
        )
    };
    match req.cmd {
        CMD_SET => {
            let mut data = lock(&st.data);
            let old = data
                .map
                .get(&req.key)
                .map_or(0, |v| req.key.len() + v.len());
            let new_total = data.bytes - old + req.key.len() + req.value.len();
            if new_total > limits.max_total_bytes {
                return over_total(new_total);
            }
            data.bytes = new_total;
            data.map.insert(req.key, req.value);
            drop(data);
            st.cv.notify_all();
            (ST_OK, Vec::new(), true)
        }
        CMD_GET => {
            let deadline = Instant::now() + wait_for(req.arg);
            let data = lock(&st.data);
            let (data, waited) =
                wait_until(st, s, data, deadline, |d| d.map.contains_key(&req.key));
            match (waited, data.map.get(&req.key)) {
                (Waited::Done, Some(v)) => (ST_OK, v.clone(), true),
                (Waited::Abandoned, _) => (ST_TIMEOUT, Vec::new(), false),
                _ => (ST_TIMEOUT, Vec::new(), true),
            }
        }
        CMD_ADD => {
            let mut data = lock(&st.data);
            let cur = match data.map.get(&req.key) {
                None => 0i64,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_be_bytes(b),
                    Err(_) => {
                        let msg = format!("key {:?} does not hold a counter", req.key);
                        return (ST_ERROR, msg.into_bytes(), true);
                    }
                },
            };
            if !data.map.contains_key(&req.key) {
                let new_total = data.bytes + req.key.len() + 8;
                if new_total > limits.max_total_bytes {
                    return over_total(new_total);
                }
                data.bytes = new_total;
            }
            let new = cur.wrapping_add(req.arg as i64);
            data.map.insert(req.key, new.to_be_bytes().to_vec());
            drop(data);
            st.cv.notify_all();
            (ST_OK, new.to_be_bytes().to_vec(), true)
        }
        CMD_CHECK => {
            if lock(&st.data).map.contains_key(&req.key) {
                (ST_OK, Vec::new(), true)
            } else {
                (ST_MISSING, Vec::new(), true)
            }
        }
        CMD_BARRIER => barrier(req, s, st),
        c => (ST_ERROR, format!("unknown command {c}").into_bytes(), false),
    }
}

fn barrier_mismatch(expected: usize, from_job: bool) -> (u8, Vec<u8>, bool) {
    let mut p = (expected as u64).to_be_bytes().to_vec();
    p.push(u8::from(from_job));
    (ST_BARRIER, p, true)
}

fn barrier(req: Request, s: &TcpStream, st: &Shared) -> (u8, Vec<u8>, bool) {
    let ws = usize::try_from(req.arg).unwrap_or(usize::MAX);
    if ws == 0 {
        return (ST_ERROR, b"barrier with world size 0".to_vec(), true);
    }
    if let Some(job) = st.world_size {
        if ws != job {
            return barrier_mismatch(job, true);
        }
    }
    let Ok(ms) = <[u8; 8]>::try_from(req.value.as_slice()) else {
        return (
            ST_ERROR,
            b"barrier without its 8-byte timeout".to_vec(),
            false,
        );
    };
    let deadline =
        Instant::now() + Duration::from_millis(u64::from_be_bytes(ms)).min(st.limits.max_wait);
    let mut data = lock(&st.data);
    match data.barriers.get_mut(&req.key) {
        Some(b) if b.world_size != ws => return barrier_mismatch(b.world_size, false),
        Some(b) if b.arrived >= b.world_size => {
            let msg = format!(
                "barrier {:?} was already passed by all {} ranks; use a fresh name per barrier",
                req.key, b.world_size
            );
            return (ST_ERROR, msg.into_bytes(), true);
        }
        Some(b) => b.arrived += 1,
        None => {
            let new_total = data.bytes + req.key.len() + BARRIER_COST;
            if new_total > st.limits.max_total_bytes {
                return (
                    ST_LIMIT,
                    limit_payload(
                        LIMIT_TOTAL,
                        new_total as u64,
                        st.limits.max_total_bytes as u64,
                    ),
                    true,
                );
            }
            data.bytes = new_total;
            data.barriers.insert(
                req.key.clone(),
                Barrier {
                    world_size: ws,
                    arrived: 1,
                },
            );
        }
    }
    st.cv.notify_all();
    let key = req.key;
    let (_data, waited) = wait_until(st, s, data, deadline, |d| {
        d.barriers
            .get(&key)
            .is_some_and(|b| b.arrived >= b.world_size)
    });
    match waited {
        Waited::Done => (ST_OK, Vec::new(), true),
        Waited::Expired => (ST_TIMEOUT, Vec::new(), true),
        Waited::Abandoned => (ST_TIMEOUT, Vec::new(), false),
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        let st = &self.shared;
        st.shutdown.store(true, Ordering::Release);
        {
            // Wake waits blocked on the condition variable (they see the shutdown flag).
            let _data = lock(&st.data);
            st.cv.notify_all();
        }
        // Close only the read side: a handler that is answering a request still writes its
        // response (a client whose SET is what let the host leave must get its reply), then
        // reads end-of-file and exits; the joins below wait for that.
        for Conn { sock: c, .. } in lock(&st.conns).live.values() {
            let _ = c.shutdown(Shutdown::Read);
        }
        // Wake the accept loop with a throwaway connection.
        let _ = TcpStream::connect_timeout(&self.connect_addr(), Duration::from_secs(1));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        // Every connection, including any accepted after the first pass.
        let live: Vec<_> = lock(&st.conns)
            .live
            .drain()
            .map(|(_, v)| (v.sock, v.handle))
            .collect();
        for (c, h) in live {
            let _ = c.shutdown(Shutdown::Read);
            if let Some(h) = h {
                let _ = h.join();
            }
        }
    }
}
