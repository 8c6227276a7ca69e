//! A fault-injecting TCP proxy ([`proxy`], [`Fault`]) between a client and a source node.

use std::net::SocketAddr;

/// What a [`proxy`] does to the bytes flowing from upstream (the source node) to the client.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Cuts the first connection after this many bytes; later connections pass.
    CutOnceAfter(usize),
    /// Cuts the first connection after this many bytes and refuses every later one, as a node
    /// that died would.
    DieAfter(usize),
    /// Flips one bit of the byte at this position of the first connection.
    FlipAt(usize),
    /// Flips one bit of the first payload byte of every chunk frame on the first connection and
    /// writes the frame's checksum anew, as an attacker on the path would: every frame checks,
    /// only the end-to-end content hash can tell.
    FlipAndReframe,
    /// Passes this many bytes of the first connection, then stops reading from upstream and
    /// holds the connection open, as a congested link would: the source's send stays under
    /// way. Later connections pass.
    StallAfter(usize),
    /// Passes this many bytes of the first connection, then pauses that long, then passes the
    /// rest, as a link that stalls a while does. Later connections pass.
    PauseAfter(usize, std::time::Duration),
    /// Passes this many whole frames from upstream on the first connection (its `Welcome`
    /// first), then cuts it; later connections pass.
    CutAfterFrames(usize),
}

/// A TCP proxy on loopback in front of `upstream` that applies `fault`; returns its address.
pub async fn proxy(upstream: SocketAddr, fault: Fault) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                return;
            };
            let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
                return;
            };
            let fault_now = first;
            first = false;
            if fault_now {
                match fault {
                    Fault::FlipAndReframe => {
                        tokio::spawn(relay_frames(down, up, flip_and_reframe));
                        continue;
                    }
                    Fault::CutAfterFrames(frames) => {
                        tokio::spawn(relay_frames(down, up, move |n, _, _| n < frames));
                        continue;
                    }
                    _ => {}
                }
            }
            let (mut down_r, mut down_w) = down.split();
            let (mut up_r, mut up_w) = up.split();
            let to_upstream = tokio::io::copy(&mut down_r, &mut up_w);
            let from_upstream = async {
                let mut seen = 0usize;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match up_r.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let piece = &mut buf[..n];
                    if fault_now {
                        match fault {
                            Fault::CutOnceAfter(at) | Fault::DieAfter(at) if seen + n > at => {
                                let _ = down_w.write_all(&piece[..at - seen]).await;
                                return;
                            }
                            Fault::StallAfter(at) if seen + n > at => {
                                let _ = down_w.write_all(&piece[..at - seen]).await;
                                std::future::pending::<()>().await;
                            }
                            Fault::PauseAfter(at, pause) if seen <= at && seen + n > at => {
                                let (before, after) = piece.split_at(at - seen);
                                if down_w.write_all(before).await.is_err() {
                                    return;
                                }
                                tokio::time::sleep(pause).await;
                                if down_w.write_all(after).await.is_err() {
                                    return;
                                }
                                seen += n;
                                continue;
                            }
                            Fault::FlipAt(at) if seen <= at && at < seen + n => {
                                piece[at - seen] ^= 0x10;
                            }
                            _ => {}
                        }
                    }
                    seen += n;
                    if down_w.write_all(piece).await.is_err() {
                        return;
                    }
                }
            };
            // Either direction ending ends the connection (as a cut does).
            tokio::select! {
                _ = to_upstream => {},
                () = from_upstream => {},
            }
            drop(down);
            drop(up);
            if fault_now && matches!(fault, Fault::DieAfter(_)) {
                return;
            }
        }
    });
    addr
}

/// One bit of a chunk frame's first payload byte flipped and the frame's CRC-32C computed again
/// over the altered body: every frame still checks.
fn flip_and_reframe(_: usize, header: &mut [u8; 16], body: &mut [u8]) -> bool {
    // Kind 2 is a chunk: an 8-byte offset, then payload.
    if header[5] == 2 && body.len() > 8 {
        body[8] ^= 0x01;
        header[12..16].copy_from_slice(&crc32c::crc32c(body).to_le_bytes());
    }
    true
}

/// Relays one connection, frame by frame from upstream: `edit` sees each frame (its number
/// from 0, header and body) and may rewrite it, or end the connection before it (false).
async fn relay_frames(
    mut down: tokio::net::TcpStream,
    mut up: tokio::net::TcpStream,
    mut edit: impl FnMut(usize, &mut [u8; 16], &mut [u8]) -> bool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut down_r, mut down_w) = down.split();
    let (mut up_r, mut up_w) = up.split();
    let to_upstream = tokio::io::copy(&mut down_r, &mut up_w);
    let from_upstream = async {
        for n in 0.. {
            let mut header = [0u8; 16];
            if up_r.read_exact(&mut header).await.is_err() {
                return;
            }
            let len = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            if up_r.read_exact(&mut body).await.is_err() || !edit(n, &mut header, &mut body) {
                return;
            }
            if down_w.write_all(&header).await.is_err() || down_w.write_all(&body).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = to_upstream => {},
        () = from_upstream => {},
    }
}
