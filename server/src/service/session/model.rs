//! Models over a connection: a version begun, committed or aborted by the connection that began
//! it, a version opened for an apply and closed, the listing, and a model deleted. What a
//! connection begins or opens is its own, bounded, and given up or let go when it ends.

use std::collections::BTreeMap;

use ferry_proto::Response;
use ferry_proto::message::{ModelSummary, PathsDigest};

use super::Session;
use crate::error::NodeError;
use crate::node::models::{ModelError, ModelId, ModelPin, ModelWriter, Replace};

/// The most versions one connection writes at once.
const MAX_WRITING: usize = 16;
/// The most versions one connection holds open at once.
const MAX_OPEN: usize = 64;

/// A connection's model versions: dropped with the session, the ones it writes are aborted and
/// the ones it holds let go.
#[derive(Debug, Default)]
pub(in crate::service) struct SessionModels {
    writing: Vec<ModelWriter>,
    open: Vec<ModelPin>,
}

impl Session<'_> {
    /// Begins a version: [`Response::ModelBegun`].
    pub(super) fn model_begin(
        &mut self,
        device: u32,
        prefix: &str,
        replace: bool,
    ) -> Result<Response, NodeError> {
        if self.models.writing.len() >= MAX_WRITING {
            return Err(NodeError::TooManyOpen {
                what: "model versions being written",
                max: MAX_WRITING,
            });
        }
        let writer = self
            .node
            .begin_model(device, prefix, Replace::when(replace))?;
        let version = writer.version();
        self.models.writing.push(writer);
        Ok(Response::ModelBegun { version })
    }

    /// The writer of a version this connection began, taken out.
    fn take_writer(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
    ) -> Result<ModelWriter, NodeError> {
        let model = ModelId::new(device, prefix);
        let at = self
            .models
            .writing
            .iter()
            .position(|w| w.model() == &model && w.version() == version);
        at.map(|at| self.models.writing.swap_remove(at))
            .ok_or_else(|| {
                ModelError::NotWriting {
                    device,
                    prefix: prefix.to_string(),
                    version,
                }
                .into()
            })
    }

    /// Commits a version this connection began: [`Response::Model`].
    pub(super) async fn model_commit(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
        sent: PathsDigest,
        metadata: Vec<(String, String)>,
    ) -> Result<Response, NodeError> {
        let writer = self.take_writer(device, prefix, version)?;
        let metadata: BTreeMap<String, String> = metadata.into_iter().collect();
        let manifest = writer.commit(Some(sent), metadata).await?;
        Ok(Response::Model(manifest.to_wire()))
    }

    /// Gives up a version this connection began: [`Response::Released`].
    pub(super) async fn model_abort(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
    ) -> Result<Response, NodeError> {
        self.take_writer(device, prefix, version)?.abort().await;
        Ok(Response::Released)
    }

    /// Holds the current version for an apply: [`Response::Model`].
    pub(super) fn model_open(&mut self, device: u32, prefix: &str) -> Result<Response, NodeError> {
        if self.models.open.len() >= MAX_OPEN {
            return Err(NodeError::TooManyOpen {
                what: "model versions held open",
                max: MAX_OPEN,
            });
        }
        let pin = self.node.open_model(device, prefix)?;
        let manifest = pin.manifest().to_wire();
        self.models.open.push(pin);
        Ok(Response::Model(manifest))
    }

    /// Lets go a version this connection opened: [`Response::Released`].
    pub(super) fn model_close(
        &mut self,
        device: u32,
        prefix: &str,
        version: u64,
    ) -> Result<Response, NodeError> {
        let model = ModelId::new(device, prefix);
        let at = self.models.open.iter().position(|p| {
            let m = p.manifest();
            m.model() == model && m.version == version
        });
        match at {
            Some(at) => {
                self.models.open.swap_remove(at);
                Ok(Response::Released)
            }
            None => Err(NodeError::NotOpen { model, version }),
        }
    }

    /// The models: [`Response::Models`].
    pub(super) fn model_list(&self, device: Option<u32>) -> Response {
        let models = self
            .node
            .models(device)
            .into_iter()
            .map(|(m, applies)| ModelSummary {
                device: m.device,
                prefix: m.prefix.clone(),
                version: m.version,
                tensors: m.tensors.len() as u64,
                bytes: m.bytes(),
                applies: applies as u64,
            })
            .collect();
        Response::Models(models)
    }

    /// Deletes a model: [`Response::Model`], the version deleted.
    pub(super) async fn model_delete(
        &mut self,
        device: u32,
        prefix: &str,
        version: Option<u64>,
    ) -> Result<Response, NodeError> {
        let deleted = self.node.delete_model(device, prefix, version).await?;
        Ok(Response::Model(deleted.to_wire()))
    }
}
