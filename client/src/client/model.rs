//! Models over a connection: a version written (begun, its tensors put under
//! [`ModelManifest::name_of`]-style names, then committed as one step or aborted), a version held
//! for an apply (opened, read, closed), listed, deleted, and waited for.

use std::time::Duration;

use ferry_proto::message::{ModelManifest, ModelSummary, PathsDigest};
use ferry_proto::{Request, Response, WaitFor};

use super::{Client, ClientError};

impl Client {
    /// Begins writing a new version of the model `prefix` on `device`: its number. Put its
    /// tensors as `PREFIX/.vVERSION/PATH` (over this connection or others), then
    /// [`commit_model`](Self::commit_model) on this one. Refused where the device holds the model
    /// and `replace` is false. This connection's end gives the version up.
    pub async fn begin_model(
        &mut self,
        device: u32,
        prefix: &str,
        replace: bool,
    ) -> Result<u64, ClientError> {
        let request = Request::ModelBegin {
            device,
            prefix: prefix.to_string(),
            replace,
        };
        self.exchange
            .call(&request, |answer| match answer {
                Response::ModelBegun { version } => Some(version),
                _ => None,
            })
            .await
            .map_err(Into::into)
    }

    /// Commits a version this connection began, which must hold exactly the paths sent: it
    /// becomes the model's current version at once. Its manifest, every hash verified by the
    /// node.
    pub async fn commit_model<'a>(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
        sent: impl IntoIterator<Item = &'a str>,
        metadata: Vec<(String, String)>,
    ) -> Result<ModelManifest, ClientError> {
        let request = Request::ModelCommit {
            device,
            prefix: prefix.to_string(),
            version,
            sent: PathsDigest::of(sent),
            metadata,
        };
        self.model_answer(&request).await
    }

    /// Gives up a version this connection began: what was put into it is deleted.
    pub async fn abort_model(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
    ) -> Result<(), ClientError> {
        let request = Request::ModelAbort {
            device,
            prefix: prefix.to_string(),
            version,
        };
        self.released(&request).await
    }

    /// Holds the current version of the model `prefix` on `device` for an apply: its manifest.
    /// Its tensors (under [`ModelManifest::name_of`]) stay as they are until
    /// [`close_model`](Self::close_model) or this connection's end.
    pub async fn open_model(
        &mut self,
        device: u32,
        prefix: &str,
    ) -> Result<ModelManifest, ClientError> {
        let request = Request::ModelOpen {
            device,
            prefix: prefix.to_string(),
        };
        self.model_answer(&request).await
    }

    /// Lets go a version this connection opened.
    pub async fn close_model(&mut self, manifest: &ModelManifest) -> Result<(), ClientError> {
        let request = Request::ModelClose {
            device: manifest.device,
            prefix: manifest.prefix.clone(),
            version: manifest.version,
        };
        self.released(&request).await
    }

    /// The models on `device`, or on every device.
    pub async fn models(&mut self, device: Option<u32>) -> Result<Vec<ModelSummary>, ClientError> {
        self.exchange
            .call(&Request::ModelList { device }, |answer| match answer {
                Response::Models(models) => Some(models),
                _ => None,
            })
            .await
            .map_err(Into::into)
    }

    /// Deletes the model `prefix` on `device` (its tensors go once no apply holds them), only if
    /// its current version is `version` where given (else `Changed`): the version deleted.
    pub async fn delete_model(
        &mut self,
        device: u32,
        prefix: &str,
        version: Option<u64>,
    ) -> Result<ModelManifest, ClientError> {
        let request = Request::ModelDelete {
            device,
            prefix: prefix.to_string(),
            version,
        };
        self.model_answer(&request).await
    }

    /// The current version of the model `prefix` on `device` once one newer than `newer_than`
    /// (any, where `None`) is committed: at once if it is; `None` where `timeout` passed first.
    /// The node answers on the commit; nothing here polls.
    pub async fn wait_for_model(
        &mut self,
        device: u32,
        prefix: &str,
        newer_than: Option<u64>,
        timeout: Duration,
    ) -> Result<Option<ModelManifest>, ClientError> {
        let target = WaitFor::Model {
            device,
            prefix: prefix.to_string(),
            newer_than,
        };
        self.wait_until(target, timeout, |answer| match answer {
            Response::Model(manifest) => Some(Some(manifest)),
            Response::Arrived(None) => Some(None),
            _ => None,
        })
        .await
    }

    async fn model_answer(&mut self, request: &Request) -> Result<ModelManifest, ClientError> {
        self.exchange
            .call(request, |answer| match answer {
                Response::Model(manifest) => Some(manifest),
                _ => None,
            })
            .await
            .map_err(Into::into)
    }

    async fn released(&mut self, request: &Request) -> Result<(), ClientError> {
        self.exchange
            .call(request, |answer| match answer {
                Response::Released => Some(()),
                _ => None,
            })
            .await
            .map_err(Into::into)
    }
}
