//! The store's wire protocol: framing, commands and statuses, and the shared-secret handshake.
//!
//! Every integer is big-endian.
//!
//! Handshake (once per connection, before any request):
//! 1. server → client: `MAGIC, kind:u8, server_nonce:[u8; 32]` where kind is [`GREET_OPEN`]
//!    (no secret), [`GREET_AUTH`] (a secret is required) or [`GREET_BUSY`] (every connection
//!    slot is taken; the server closes the connection right after).
//! 2. client → server: `MAGIC, client_nonce:[u8; 32], tag:[u8; 32]` with
//!    `tag = HMAC-SHA256(secret, "fsdp-store client" ‖ server_nonce ‖ client_nonce)` (zeros when
//!    the store is open).
//! 3. server → client: a response frame; `ST_OK` with
//!    `HMAC-SHA256(secret, "fsdp-store server" ‖ server_nonce ‖ client_nonce)` as payload (empty
//!    when open), so the client knows the server holds the secret too; or `ST_AUTH` and the
//!    server closes the connection.
//!
//! The secret itself never crosses the wire and both nonces are fresh random bytes, so a recorded
//! handshake cannot be replayed.
//!
//! Requests: `cmd:u8, key_len:u32, key, arg:u64, value_len:u32, value`.
//! Responses: `status:u8, len:u32, payload`.

use std::io::{Read, Write};

use hmac::{KeyInit, Mac};

pub(crate) const MAGIC: &[u8; 8] = b"FSDPSTv1";
pub(crate) const NONCE_LEN: usize = 32;
pub(crate) const TAG_LEN: usize = 32;

pub(crate) const GREET_OPEN: u8 = 0;
pub(crate) const GREET_AUTH: u8 = 1;
pub(crate) const GREET_BUSY: u8 = 2;

pub(crate) const CMD_SET: u8 = 1;
pub(crate) const CMD_GET: u8 = 2;
pub(crate) const CMD_ADD: u8 = 3;
pub(crate) const CMD_CHECK: u8 = 4;
pub(crate) const CMD_BARRIER: u8 = 5;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_TIMEOUT: u8 = 1;
pub(crate) const ST_MISSING: u8 = 2;
/// Payload: a UTF-8 message.
pub(crate) const ST_ERROR: u8 = 3;
/// Payload: a UTF-8 message.
pub(crate) const ST_AUTH: u8 = 4;
/// Payload: `what:u8` ([`LIMIT_KEY`], [`LIMIT_VALUE`], [`LIMIT_TOTAL`], [`LIMIT_INFLIGHT`]),
/// `size:u64`, `limit:u64`.
pub(crate) const ST_LIMIT: u8 = 5;
/// Payload: `expected:u64, from_job:u8` (1: the job's world size; 0: an earlier caller's).
pub(crate) const ST_BARRIER: u8 = 6;

pub(crate) const LIMIT_KEY: u8 = 0;
pub(crate) const LIMIT_VALUE: u8 = 1;
pub(crate) const LIMIT_TOTAL: u8 = 2;
pub(crate) const LIMIT_INFLIGHT: u8 = 3;

/// The name of a limit code, as [`crate::CollectiveError::StoreLimit`] reports it.
pub(crate) fn limit_name(code: u8) -> &'static str {
    match code {
        LIMIT_KEY => "key",
        LIMIT_VALUE => "value",
        LIMIT_INFLIGHT => "bytes being received from all connections (the store is busy; retry)",
        _ => "total stored bytes",
    }
}

pub(crate) fn limit_payload(code: u8, size: u64, limit: u64) -> Vec<u8> {
    let mut p = vec![code];
    p.extend_from_slice(&size.to_be_bytes());
    p.extend_from_slice(&limit.to_be_bytes());
    p
}

pub(crate) fn read_u32(s: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

pub(crate) fn read_u64(s: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads exactly `n` bytes without allocating them up front: memory grows only as the peer
/// actually sends data, so a length prefix alone cannot make us allocate.
pub(crate) fn read_exact_vec(s: &mut impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::with_capacity(n.min(64 << 10));
    let got = s.take(n as u64).read_to_end(&mut v)?;
    if got < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("connection closed after {got} of {n} bytes"),
        ));
    }
    Ok(v)
}

pub(crate) fn write_frame(s: &mut impl Write, head: u8, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut buf = vec![head];
    for p in parts {
        buf.extend_from_slice(p);
    }
    s.write_all(&buf)?;
    s.flush()
}

/// Writes a response frame `status, len, payload`.
pub(crate) fn write_response(
    s: &mut impl Write,
    status: u8,
    payload: &[u8],
) -> std::io::Result<()> {
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes();
    write_frame(s, status, &[&len, payload])
}

/// Fresh random bytes from the operating system.
pub(crate) fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn mac(secret: &[u8], label: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; this cannot fail.
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    m.update(label);
    m.update(server_nonce);
    m.update(client_nonce);
    m
}

pub(crate) const CLIENT_LABEL: &[u8] = b"fsdp-store client";
pub(crate) const SERVER_LABEL: &[u8] = b"fsdp-store server";

/// The tag one side computes to prove it holds `secret`.
pub(crate) fn tag(
    secret: &[u8],
    label: &[u8],
    server_nonce: &[u8],
    client_nonce: &[u8],
) -> [u8; TAG_LEN] {
    mac(secret, label, server_nonce, client_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a tag in constant time.
pub(crate) fn verify(
    secret: &[u8],
    label: &[u8],
    server_nonce: &[u8],
    client_nonce: &[u8],
    tag: &[u8],
) -> bool {
    mac(secret, label, server_nonce, client_nonce)
        .verify_slice(tag)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_secret_label_and_both_nonces() {
        let (s, c) = ([1u8; 32], [2u8; 32]);
        let t = tag(b"secret-secret-16", CLIENT_LABEL, &s, &c);
        assert!(verify(b"secret-secret-16", CLIENT_LABEL, &s, &c, &t));
        assert!(!verify(b"secret-secret-17", CLIENT_LABEL, &s, &c, &t));
        assert!(!verify(b"secret-secret-16", SERVER_LABEL, &s, &c, &t));
        assert!(!verify(b"secret-secret-16", CLIENT_LABEL, &c, &s, &t));
        assert!(!verify(b"secret-secret-16", CLIENT_LABEL, &s, &c, &t[..31]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_length_prefix_alone_does_not_allocate_or_hang() {
        let mut short: &[u8] = b"abc";
        let e = read_exact_vec(&mut short, 1 << 30).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
