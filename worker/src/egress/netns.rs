//! Binding the proxy's listener inside a sandbox's network namespace: a dedicated thread
//! joins `/proc/<pid>/ns/net` (setns), binds, and ends; the socket stays in the namespace
//! it was made in, so the sandbox reaches it at 127.0.0.1 while the node serves it from
//! its own namespace (where its upstream connections are made). No other thread of the
//! node ever changes namespace. Joining needs CAP_SYS_ADMIN over the sandbox's namespace
//! and the node's own: a node running as root (an unprivileged node would need a
//! single-threaded helper process that joins the sandbox's user namespace first).
//!
//! The egress proxy also connects into the namespace, to the sandbox's own loopback
//! listeners ([`Netns::connect`]), on such a thread too.

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};

/// How long to wait for the namespace's loopback to come up (bwrap brings `lo` up in its
/// child, possibly just after reporting the child's pid).
const LOOPBACK_WAIT: Duration = Duration::from_secs(2);

/// A sandbox's network namespace, held by descriptor from the moment its first listener
/// is bound: a later connection into it (the egress proxy reaching the sandbox's own
/// loopback listener) never reopens `/proc/<pid>`, whose pid may be another process's by
/// then.
#[derive(Debug, Clone)]
pub struct Netns(Arc<File>);

impl Netns {
    /// The network namespace of process `pid`, opened now.
    pub fn of_pid(pid: u32) -> io::Result<Netns> {
        Ok(Netns(Arc::new(File::open(format!("/proc/{pid}/ns/net"))?)))
    }

    /// Runs `f` on a thread of its own that has joined the namespace; the thread ends with
    /// `f`, and its namespace change with it.
    fn on_thread<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let ns = Arc::clone(&self.0);
        std::thread::Builder::new()
            .name("egress-netns".into())
            .spawn(move || -> io::Result<T> {
                move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))?;
                f()
            })?
            .join()
            .map_err(|_| io::Error::other("the namespace thread panicked"))?
    }

    /// Binds a TCP listener at `addr` in the namespace (waiting for its loopback to
    /// come up).
    pub fn bind(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        self.on_thread(move || {
            let until = std::time::Instant::now() + LOOPBACK_WAIT;
            loop {
                match TcpListener::bind(addr) {
                    Err(e)
                        if e.kind() == io::ErrorKind::AddrNotAvailable
                            && std::time::Instant::now() < until =>
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    other => return other,
                }
            }
        })
    }

    /// Connects to `addr` from inside the namespace, within `timeout`: the socket stays
    /// the namespace's, so `127.0.0.1` is the sandbox's loopback, never the node's.
    pub fn connect(&self, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        self.on_thread(move || TcpStream::connect_timeout(&addr, timeout))
    }
}

/// Binds a TCP listener at `addr` inside the network namespace of process `pid`.
pub fn bind_in_netns(pid: u32, addr: SocketAddr) -> io::Result<TcpListener> {
    Netns::of_pid(pid)?.bind(addr)
}
