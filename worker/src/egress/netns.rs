//! Binding the proxy's listener inside a sandbox's network namespace: a dedicated thread
//! joins `/proc/<pid>/ns/net` (setns), binds, and ends; the socket stays in the namespace
//! it was made in, so the sandbox reaches it at 127.0.0.1 while the node serves it from
//! its own namespace (where its upstream connections are made). No other thread of the
//! node ever changes namespace. Joining needs CAP_SYS_ADMIN over the sandbox's namespace
//! and the node's own: a node running as root (an unprivileged node would need a
//! single-threaded helper process that joins the sandbox's user namespace first).

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::time::Duration;

use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};

/// How long to wait for the namespace's loopback to come up (bwrap brings `lo` up in its
/// child, possibly just after reporting the child's pid).
const LOOPBACK_WAIT: Duration = Duration::from_secs(2);

/// Binds a TCP listener at `addr` inside the network namespace of process `pid`.
pub fn bind_in_netns(pid: u32, addr: SocketAddr) -> io::Result<TcpListener> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let thread = std::thread::Builder::new()
        .name("egress-netns".into())
        .spawn(move || -> io::Result<TcpListener> {
            move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))?;
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
            // The thread ends here: its namespace change ends with it.
        })?;
    thread
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
}
