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
pub struct Watch {
    endpoint: Endpoint,
    body: Incoming,
    /// Bytes received and not yet parsed: at most [`MAX_WATCH_MESSAGE`].
    pending: Vec<u8>,
}

/// One message of a watch.
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

    /// Reads until one whole message is buffered and parses it.
    async fn message(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        loop {
            if let Some(item) = self.parse_one()? {
                return match item.error {
                    Some(error) => Err(refused(&self.endpoint, &error)),
                    None => Ok(Some(item.result.unwrap_or_default())),
                };
            }
            match self.body.frame().await {
                None => return Ok(None),
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

    /// The first whole message in `pending`, removed from it; `None` while it is incomplete.
    fn parse_one(&mut self) -> Result<Option<StreamItem<WatchResponse>>, EtcdError> {
        let mut values = serde_json::Deserializer::from_slice(&self.pending)
            .into_iter::<StreamItem<WatchResponse>>();
        match values.next() {
            Some(Ok(item)) => {
                let used = values.byte_offset();
                self.pending.drain(..used);
                Ok(Some(item))
            }
            Some(Err(e)) if e.is_eof() => Ok(None),
            None => Ok(None),
            Some(Err(e)) => Err(EtcdError::Malformed {
                endpoint: self.endpoint.url().to_string(),
                detail: e.to_string(),
            }),
        }
    }

    fn ended_early(&self) -> EtcdError {
        EtcdError::Http {
            endpoint: self.endpoint.url().to_string(),
            cause: "the watch ended before etcd confirmed it".into(),
        }
    }
}
