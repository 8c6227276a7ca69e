//! A squatter, for tests: a loopback port that another local user (`nobody`) bound first, as one
//! can while a node is down, recording every byte clients send it, so that a test can show no
//! token (nor anything else) reached it.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// `nobody`'s user id on Debian.
pub const NOBODY: u32 = 65534;

/// How often the squatter's thread looks for connections and bytes.
const POLL: Duration = Duration::from_millis(10);

/// A loopback port held by `nobody`, accepting every connection and recording what arrives,
/// until dropped.
pub struct Squatter {
    addr: SocketAddr,
    received: Arc<Mutex<Vec<u8>>>,
    connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Squatter {
    /// Binds `127.0.0.1:0` as `nobody` on a thread of its own (Linux keeps user ids per thread,
    /// so the rest of the process stays as it is). `None`, with the reason printed, where this
    /// process may not take another user's id: only root may, as the tests run in CI. `what`
    /// names the test in that line.
    pub fn bind(what: &str) -> Option<Squatter> {
        let euid = rustix::process::geteuid().as_raw();
        if euid != 0 {
            eprintln!(
                "SKIPPED {what}: binding a port as another user needs root (running as {euid})"
            );
            return None;
        }
        let received = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (bound, addr) = std::sync::mpsc::channel();
        let thread = {
            let (received, connections, stop) =
                (received.clone(), connections.clone(), stop.clone());
            std::thread::spawn(move || {
                let nobody = rustix::process::Uid::from_raw(NOBODY);
                rustix::thread::set_thread_res_uid(nobody, nobody, nobody)
                    .expect("root may take another user's id");
                let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
                listener
                    .set_nonblocking(true)
                    .expect("a non-blocking listener");
                bound
                    .send(listener.local_addr().expect("bound"))
                    .expect("the test waits");
                record(&listener, &received, &connections, &stop);
            })
        };
        let addr = addr.recv().expect("the squatter bound its port");
        Some(Squatter {
            addr,
            received,
            connections,
            stop,
            thread: Some(thread),
        })
    }

    /// The port's address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections reached the port so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Every byte received, after `settle` more for late ones.
    pub fn received_after(&self, settle: Duration) -> Vec<u8> {
        std::thread::sleep(settle);
        self.received.lock().expect("the record").clone()
    }
}

/// Accepts and reads until `stop`: every byte any connection sends goes into `received`.
fn record(
    listener: &TcpListener,
    received: &Mutex<Vec<u8>>,
    connections: &AtomicUsize,
    stop: &AtomicBool,
) {
    let mut open: Vec<TcpStream> = Vec::new();
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        while let Ok((stream, _)) = listener.accept() {
            stream.set_nonblocking(true).expect("a non-blocking stream");
            connections.fetch_add(1, Ordering::SeqCst);
            open.push(stream);
        }
        for stream in &mut open {
            while let Ok(n @ 1..) = stream.read(&mut buf) {
                received
                    .lock()
                    .expect("the record")
                    .extend_from_slice(&buf[..n]);
            }
        }
        std::thread::sleep(POLL);
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
