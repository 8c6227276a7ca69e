//! [`Watch`]: the changes under a prefix as etcd streams them, one message at a time, each read
//! with a bound.

use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::error::EtcdError;
use crate::link::{Endpoint, MAX_WATCH_MESSAGE, refused};
use crate::wire::{Event, StreamItem, WatchResponse};

/// A watch etcd created. Its messages come in etcd's order, each change exactly once, from the
/// revision asked for on.
///
/// The gateway ends each message with a newline (protobuf's JSON never holds a raw one), so a
/// message is parsed once, when its newline arrives, and each received byte is scanned once:
/// a peer that sends a message a byte at a time costs no more than one that sends it whole.
pub struct Watch {
    endpoint: Endpoint,
    body: Incoming,
    /// Bytes received and not yet parsed: at most [`MAX_WATCH_MESSAGE`].
    pending: Vec<u8>,
    /// How much of `pending` is known to hold no newline.
    scanned: usize,
}

/// One message of a watch.
// Exhaustive on purpose: a watcher must handle a cancelled watch as well as its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchBatch {
    /// Changes, in revision order.
    Events(Vec<Event>),
    /// etcd cancelled the watch (the revision asked for was compacted, say): no more changes
    /// come.
    Canceled {
        /// etcd's reason, where it gave one.
        reason: String,
        /// The oldest revision etcd still has, where compaction was the reason.
        compact_revision: i64,
    },
}

impl Watch {
    /// Waits (within `timeout`) for etcd to confirm the watch.
    pub(crate) async fn start(
        endpoint: Endpoint,
        body: Incoming,
        timeout: Duration,
    ) -> Result<Watch, EtcdError> {
        let mut watch = Watch {
            endpoint,
            body,
            pending: Vec::new(),
            scanned: 0,
        };
        let first = tokio::time::timeout(timeout, watch.message())
            .await
            .map_err(|_| EtcdError::Timeout {
                endpoint: watch.endpoint.url().to_string(),
                timeout,
            })??;
        match first {
            Some(answer) if answer.created && !answer.canceled => Ok(watch),
            Some(answer) => Err(EtcdError::Refused {
                endpoint: watch.endpoint.url().to_string(),
                code: 0,
                message: format!("watch not created: {:?}", answer.cancel_reason),
            }),
            None => Err(watch.ended_early()),
        }
    }

    /// The next message: `None` once etcd ended the stream. Waits as long as nothing changes.
    pub async fn next(&mut self) -> Result<Option<WatchBatch>, EtcdError> {
        let Some(answer) = self.message().await? else {
            return Ok(None);
        };
        Ok(Some(if answer.canceled {
            WatchBatch::Canceled {
                reason: answer.cancel_reason,
                compact_revision: answer.compact_revision,
            }
        } else {
            WatchBatch::Events(answer.events)
        }))
    }

    /// Reads until one whole message is buffered and parses it. Cancel-safe: bytes are kept in
    /// `pending` before any other await.
    async fn message(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        loop {
            if let Some(item) = self.take_line()? {
                return match item.error {
                    Some(error) => Err(refused(&self.endpoint, &error)),
                    None => Ok(Some(item.result.unwrap_or_default())),
                };
            }
            match self.body.frame().await {
                // The stream's end: a message cut short by it is an error, not silence.
                None if self.pending.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => {
                    return Err(EtcdError::Malformed {
                        endpoint: self.endpoint.url().to_string(),
                        detail: format!(
                            "the watch ended within a message ({} bytes)",
                            self.pending.len()
                        ),
                    });
                }
                Some(Err(e)) => {
                    return Err(EtcdError::Http {
                        endpoint: self.endpoint.url().to_string(),
                        cause: e.to_string(),
                    });
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers
                    };
                    if self.pending.len().saturating_add(data.len()) > MAX_WATCH_MESSAGE {
                        return Err(EtcdError::TooLarge {
                            endpoint: self.endpoint.url().to_string(),
                            limit: MAX_WATCH_MESSAGE,
                        });
                    }
                    self.pending.extend_from_slice(&data);
                }
            }
        }
    }

    /// The first whole message in `pending` (a line that is not blank), removed from it with
    /// the blank lines before it; `None` while no whole message is there.
    fn take_line(&mut self) -> Result<Option<StreamItem<WatchResponse>>, EtcdError> {
        while let Some(at) = self.pending[self.scanned..]
            .iter()
            .position(|&b| b == b'\n')
        {
            let end = self.scanned + at;
            let line = &self.pending[..end];
            let item = if line.iter().all(u8::is_ascii_whitespace) {
                None
            } else {
                Some(
                    serde_json::from_slice(line).map_err(|e| EtcdError::Malformed {
                        endpoint: self.endpoint.url().to_string(),
                        detail: e.to_string(),
                    })?,
                )
            };
            self.pending.drain(..=end);
            self.scanned = 0;
            if item.is_some() {
                return Ok(item);
            }
        }
        self.scanned = self.pending.len();
        Ok(None)
    }

    fn ended_early(&self) -> EtcdError {
        EtcdError::Http {
            endpoint: self.endpoint.url().to_string(),
            cause: "the watch ended before etcd confirmed it".into(),
        }
    }
}
