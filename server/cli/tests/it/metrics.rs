//! Reading a node's Prometheus endpoint from a test: a free port for it, a scrape, one sample.

use std::io::{Read, Write};
use std::time::Duration;

/// A port free right now on loopback.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` over plain HTTP, the body as text.
pub(crate) fn scrape(port: u16) -> String {
    let mut last = String::new();
    // The exporter starts listening just after the node prints its address.
    for _ in 0..50 {
        if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            if let Some((head, body)) = response.split_once("\r\n\r\n") {
                assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                return body.to_string();
            }
            last = response;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("no metrics on port {port}: {last}");
}

/// The value of the sample whose name and labels contain every one of `parts`.
pub(crate) fn sample(text: &str, parts: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}
