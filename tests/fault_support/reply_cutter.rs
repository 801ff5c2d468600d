//! A TCP proxy in front of Postgres that loses the reply of one statement after the server
//! committed it: the fault of a server restart, a failover or a network cut that strikes
//! between a commit and its reply, made exact.
//!
//! It forwards every connection. The first statement whose text (in the client's Parse
//! message) contains the given needle is executed and committed as usual, but from the
//! server's first row or completion of it on, nothing more reaches the client, and once
//! the server says it is ready for the next query (`ReadyForQuery`, sent after the
//! implicit transaction committed) the proxy closes both sides. Connect through it with
//! `sslmode=disable`: it reads the server's messages from the first byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct ReplyCutter {
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
}

impl ReplyCutter {
    /// Starts the proxy in front of `server` (host:port); it cuts the reply of the first
    /// statement containing `needle`.
    pub async fn start(server: SocketAddr, needle: &'static [u8]) -> ReplyCutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(true));
        let cut = Arc::new(AtomicBool::new(false));
        let (armed_task, cut_task) = (armed.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(server).await else {
                    continue;
                };
                tokio::spawn(proxy(
                    client,
                    server,
                    needle,
                    armed_task.clone(),
                    cut_task.clone(),
                ));
            }
        });
        ReplyCutter { addr, cut }
    }

    /// Whether a reply was cut.
    pub fn has_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}

async fn proxy(
    client: TcpStream,
    server: TcpStream,
    needle: &'static [u8],
    armed: Arc<AtomicBool>,
    cut: Arc<AtomicBool>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Set (before the statement is forwarded) when this connection carries the statement.
    let cutting = Arc::new(AtomicBool::new(false));
    let upstream = {
        let cutting = cutting.clone();
        async move {
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let chunk = &buffer[..n];
                if chunk.windows(needle.len()).any(|w| w == needle)
                    && armed.swap(false, Ordering::SeqCst)
                {
                    cutting.store(true, Ordering::SeqCst);
                }
                if server_write.write_all(chunk).await.is_err() {
                    return;
                }
            }
        }
    };
    let downstream = async move {
        // Server messages: a type byte, then a big-endian length that counts itself.
        let mut swallowing = false;
        loop {
            let mut header = [0u8; 5];
            if server_read.read_exact(&mut header).await.is_err() {
                return;
            }
            let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
            let mut body = vec![0u8; (length as usize).saturating_sub(4)];
            if server_read.read_exact(&mut body).await.is_err() {
                return;
            }
            let kind = header[0];
            if cutting.load(Ordering::SeqCst) && matches!(kind, b'D' | b'C') {
                swallowing = true;
            }
            if swallowing {
                if kind == b'Z' {
                    // Committed; the client never hears of it.
                    cut.store(true, Ordering::SeqCst);
                    return;
                }
                continue;
            }
            if client_write.write_all(&header).await.is_err()
                || client_write.write_all(&body).await.is_err()
            {
                return;
            }
        }
    };
    // Either side ending drops both halves of both sockets: the connection is gone.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
