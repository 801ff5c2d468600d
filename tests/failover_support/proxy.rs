//! A TCP proxy in front of the database, as a failover endpoint (a DNS name, a virtual IP,
//! a cloud provider's writer endpoint) is: clients connect to one port, and the proxy
//! forwards to whichever server it points at. Re-pointing it drops every connection it
//! carries, as a real failover does to connections to the old primary.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The proxy; it stops listening (and drops what it carries) when dropped.
pub struct Proxy {
    port: u16,
    target: watch::Sender<u16>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target_port` there.
    pub async fn start(target_port: u16) -> Proxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (target, targets) = watch::channel(target_port);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, targets.clone()));
            }
        });
        Proxy {
            port,
            target,
            accept,
        }
    }

    /// The URL of database `name` through the proxy.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Drops every connection and refuses new ones (the endpoint points nowhere) until
    /// [`repoint`](Proxy::repoint).
    pub fn disconnect(&self) {
        // Port 0 cannot be connected to.
        self.target.send_replace(0);
    }

    /// Forwards new connections to `target_port` from now on, and drops every connection
    /// forwarded so far.
    pub fn repoint(&self, target_port: u16) {
        self.target.send_replace(target_port);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Carries one client's connection until either side closes it or the target changes.
async fn forward(mut client: TcpStream, mut targets: watch::Receiver<u16>) {
    let port = *targets.borrow_and_update();
    let Ok(mut server) = TcpStream::connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
    else {
        // The target is down: the client sees its connection closed, as it would.
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    tokio::select! {
        _ = copy_bidirectional(&mut client, &mut server) => {}
        _ = targets.changed() => {}
    }
}
