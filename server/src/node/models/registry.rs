//! The node's models as a state machine, without I/O: which versions are being written, which is
//! current, which an apply holds, and what each step leaves to delete. Every transition is a
//! method that either changes the state or refuses with a [`ModelError`]; the node's async layer
//! (`super`) carries out what they return.
//!
//! Invariants (checked by `tests`' random histories):
//! - a model's current version only ever increases, and is replaced only by a commit;
//! - a committed version is never written again: writes go only to a version being written,
//!   before it is sealed, and a commit waits for those in flight;
//! - a version replaced or deleted is kept while an apply holds it, and handed out to be deleted
//!   exactly once, when none does;
//! - a version begun is committed or aborted, and an aborted one's tensors are deleted.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::manifest::{Manifest, ModelId};
use super::name::VersionName;

/// What a collect does where the model already has a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replace {
    /// Refuse: a model is replaced only when asked (burn-store's file stores refuse to
    /// overwrite by default, too).
    #[default]
    Refuse,
    /// Replace it: the new version becomes current at its commit; the old one's tensors go once
    /// no apply holds them.
    Allow,
}

impl Replace {
    /// `Allow` where asked to replace (the wire's and a store's flag), else `Refuse`.
    pub fn when(asked: bool) -> Self {
        if asked { Self::Allow } else { Self::Refuse }
    }
}

/// Why a model operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// No model under the prefix on the device.
    #[error("nothing under {prefix} on device {device}: no model was committed there")]
    NoModel {
        /// The device.
        device: u32,
        /// The prefix.
        prefix: String,
    },
    /// A model is there and the collect was not asked to replace it.
    #[error(
        "device {device} holds model {prefix} (version {version}): collect with replace to replace it"
    )]
    Exists {
        /// The device.
        device: u32,
        /// The prefix.
        prefix: String,
        /// Its current version.
        version: u64,
    },
    /// A newer version was committed while this one was written.
    #[error(
        "version {version} of model {prefix} on device {device} was superseded by version {current}, committed while it was written; nothing of it was kept"
    )]
    Superseded {
        /// The device.
        device: u32,
        /// The prefix.
        prefix: String,
        /// The version refused.
        version: u64,
        /// The current one.
        current: u64,
    },
    /// A delete of a version that is no longer the current one.
    #[error(
        "model {prefix} on device {device} is at version {current}, not {version}: nothing was deleted"
    )]
    NotCurrent {
        /// The device.
        device: u32,
        /// The prefix.
        prefix: String,
        /// The version asked for.
        version: u64,
        /// The current one.
        current: u64,
    },
    /// A write or delete of a tensor of a version no collect is writing.
    #[error(
        "{name} on device {device} belongs to version {version} of model {prefix}, which {state}: a model's versions change only by a collect"
    )]
    Sealed {
        /// The device.
        device: u32,
        /// The tensor's name.
        name: String,
        /// The model's prefix.
        prefix: String,
        /// The version.
        version: u64,
        /// What the version is: "is committed", "is no longer being written".
        state: &'static str,
    },
    /// A commit of a version that is not being written (committed, aborted, or never begun).
    #[error("version {version} of model {prefix} on device {device} is not being written")]
    NotWriting {
        /// The device.
        device: u32,
        /// The prefix.
        prefix: String,
        /// The version.
        version: u64,
    },
    /// A prefix that cannot name a model.
    #[error(
        "{prefix:?} cannot name a model: a valid tensor name, not ending in '/', without a `.vN` segment"
    )]
    BadPrefix {
        /// The prefix.
        prefix: String,
    },
}

/// A write admitted into a version being written, counted until it is registered or dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WriteInto {
    pub(crate) model: ModelId,
    pub(crate) version: u64,
}

/// One model's state.
#[derive(Debug, Default)]
struct Model {
    /// The next version a collect begins.
    next_version: u64,
    /// The version applies open, if any.
    current: Option<Arc<Manifest>>,
    /// Versions begun and neither committed nor aborted.
    writing: BTreeMap<u64, Writing>,
    /// How many applies hold each committed version.
    pins: BTreeMap<u64, usize>,
    /// Versions replaced or deleted while an apply held them: deleted at the last unpin.
    retired: BTreeMap<u64, Arc<Manifest>>,
}

#[derive(Debug)]
struct Writing {
    replace: Replace,
    /// No more writes are admitted (a commit or an abort began).
    sealed: bool,
    /// Writes admitted and not yet registered or dropped.
    in_flight: usize,
}

/// Every model of a node. A model's entry stays once begun (its version numbers never start
/// over), a few dozen bytes per prefix ever written.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    models: BTreeMap<ModelId, Model>,
}

impl Registry {
    /// Begins writing a new version of `model`: its number.
    pub(crate) fn begin(&mut self, model: &ModelId, replace: Replace) -> Result<u64, ModelError> {
        let entry = self.models.entry(model.clone()).or_default();
        if let (Replace::Refuse, Some(current)) = (replace, &entry.current) {
            return Err(ModelError::Exists {
                device: model.device,
                prefix: model.prefix.clone(),
                version: current.version,
            });
        }
        let version = entry.next_version;
        entry.next_version += 1;
        entry.writing.insert(
            version,
            Writing {
                replace,
                sealed: false,
                in_flight: 0,
            },
        );
        Ok(version)
    }

    /// Admits a write of `name` on `device`: `None` for a name outside every model version,
    /// counted in its version where that version is being written and not sealed, refused
    /// otherwise.
    pub(crate) fn admit_write(
        &mut self,
        device: u32,
        name: &str,
        version_name: Option<VersionName<'_>>,
    ) -> Result<Option<WriteInto>, ModelError> {
        let Some(v) = version_name else {
            return Ok(None);
        };
        let model = ModelId::new(device, v.prefix);
        let writing = self
            .models
            .get_mut(&model)
            .and_then(|m| m.writing.get_mut(&v.version));
        match writing {
            Some(writing) if !writing.sealed => {
                writing.in_flight += 1;
                Ok(Some(WriteInto {
                    model,
                    version: v.version,
                }))
            }
            Some(_) => Err(self.sealed(device, name, &v, "is no longer being written")),
            None => Err(self.sealed(device, name, &v, self.state_of(&model, v.version))),
        }
    }

    /// A write admitted by [`admit_write`](Self::admit_write) was registered or dropped.
    pub(crate) fn end_write(&mut self, write: &WriteInto) {
        let writing = self
            .models
            .get_mut(&write.model)
            .and_then(|m| m.writing.get_mut(&write.version));
        if let Some(writing) = writing {
            writing.in_flight = writing.in_flight.saturating_sub(1);
        }
    }

    /// Whether `name` on `device` may be deleted by a client or a program: not a tensor of a
    /// committed version (the node deletes those itself, once replaced and unheld).
    pub(crate) fn may_delete(
        &self,
        device: u32,
        name: &str,
        version_name: Option<VersionName<'_>>,
    ) -> Result<(), ModelError> {
        let Some(v) = version_name else {
            return Ok(());
        };
        let model = ModelId::new(device, v.prefix);
        match self.state_of(&model, v.version) {
            "is committed" => Err(self.sealed(device, name, &v, "is committed")),
            _ => Ok(()),
        }
    }

    fn state_of(&self, model: &ModelId, version: u64) -> &'static str {
        let Some(m) = self.models.get(model) else {
            return "was never begun";
        };
        let current = m.current.as_ref().is_some_and(|c| c.version == version);
        if current || m.retired.contains_key(&version) {
            "is committed"
        } else if m.writing.contains_key(&version) {
            "is being written"
        } else {
            "is not being written"
        }
    }

    fn sealed(
        &self,
        device: u32,
        name: &str,
        v: &VersionName<'_>,
        state: &'static str,
    ) -> ModelError {
        ModelError::Sealed {
            device,
            name: name.to_string(),
            prefix: v.prefix.to_string(),
            version: v.version,
            state,
        }
    }

    /// Stops admitting writes to `version` (a commit or an abort begins): the writes still in
    /// flight, which the caller waits for.
    pub(crate) fn seal(&mut self, model: &ModelId, version: u64) -> Result<usize, ModelError> {
        let writing = self
            .models
            .get_mut(model)
            .and_then(|m| m.writing.get_mut(&version))
            .filter(|w| !w.sealed);
        match writing {
            Some(writing) => {
                writing.sealed = true;
                Ok(writing.in_flight)
            }
            None => Err(ModelError::NotWriting {
                device: model.device,
                prefix: model.prefix.clone(),
                version,
            }),
        }
    }

    /// Writes of `version` still in flight (0 once it is neither written nor begun).
    pub(crate) fn in_flight(&self, model: &ModelId, version: u64) -> usize {
        self.models
            .get(model)
            .and_then(|m| m.writing.get(&version))
            .map_or(0, |w| w.in_flight)
    }

    /// Makes the sealed `manifest` its model's current version: the version it replaced, where
    /// no apply holds it, to delete now. Refused (the version is then no longer being written:
    /// its tensors are the caller's to delete) where a newer version was committed meanwhile, or
    /// where one was and the collect may not replace it.
    pub(crate) fn commit(
        &mut self,
        manifest: Arc<Manifest>,
    ) -> Result<Option<Arc<Manifest>>, ModelError> {
        let model = manifest.model();
        let (device, prefix, version) = (model.device, model.prefix.clone(), manifest.version);
        let entry = self.models.get_mut(&model);
        let Some(writing) = entry.as_ref().and_then(|m| m.writing.get(&version)) else {
            return Err(ModelError::NotWriting {
                device,
                prefix,
                version,
            });
        };
        debug_assert!(writing.sealed && writing.in_flight == 0);
        let replace = writing.replace;
        let Some(entry) = entry else { unreachable!() };
        entry.writing.remove(&version);
        match (&entry.current, replace) {
            (Some(current), _) if current.version > version => {
                let current = current.version;
                return Err(ModelError::Superseded {
                    device,
                    prefix,
                    version,
                    current,
                });
            }
            (Some(current), Replace::Refuse) => {
                let current = current.version;
                return Err(ModelError::Exists {
                    device,
                    prefix,
                    version: current,
                });
            }
            _ => {}
        }
        let replaced = entry.current.replace(manifest);
        Ok(replaced.and_then(|old| entry.retire(old)))
    }

    /// Gives up writing `version`: its tensors are the caller's to delete.
    pub(crate) fn abort(&mut self, model: &ModelId, version: u64) {
        if let Some(m) = self.models.get_mut(model) {
            m.writing.remove(&version);
        }
    }

    /// The current version of `model`, held for an apply until [`unpin`](Self::unpin).
    pub(crate) fn pin(&mut self, model: &ModelId) -> Result<Arc<Manifest>, ModelError> {
        let current = self.models.get_mut(model).and_then(|m| {
            let current = m.current.clone()?;
            *m.pins.entry(current.version).or_default() += 1;
            Some(current)
        });
        current.ok_or_else(|| ModelError::NoModel {
            device: model.device,
            prefix: model.prefix.clone(),
        })
    }

    /// An apply let `version` go: the version to delete now, where it was retired and this was
    /// its last apply.
    pub(crate) fn unpin(&mut self, model: &ModelId, version: u64) -> Option<Arc<Manifest>> {
        let m = self.models.get_mut(model)?;
        let pins = m.pins.get_mut(&version)?;
        *pins -= 1;
        if *pins > 0 {
            return None;
        }
        m.pins.remove(&version);
        m.retired.remove(&version)
    }

    /// Deletes `model`'s current version (only if it is `version`, where given): it goes now,
    /// or at its last apply's end.
    pub(crate) fn delete(
        &mut self,
        model: &ModelId,
        version: Option<u64>,
    ) -> Result<(Arc<Manifest>, Option<Arc<Manifest>>), ModelError> {
        let no_model = || ModelError::NoModel {
            device: model.device,
            prefix: model.prefix.clone(),
        };
        let m = self.models.get_mut(model).ok_or_else(no_model)?;
        let held = m.current.as_ref().ok_or_else(no_model)?.version;
        if let Some(version) = version.filter(|&v| v != held) {
            return Err(ModelError::NotCurrent {
                device: model.device,
                prefix: model.prefix.clone(),
                version,
                current: held,
            });
        }
        let current = m.current.take().ok_or_else(no_model)?;
        let doomed = m.retire(current.clone());
        Ok((current, doomed))
    }

    /// The current version of `model`, if any.
    pub(crate) fn current(&self, model: &ModelId) -> Option<Arc<Manifest>> {
        self.models.get(model)?.current.clone()
    }

    /// Every current version, on `device` or on all, sorted by device and prefix; with how many
    /// applies hold each.
    pub(crate) fn list(&self, device: Option<u32>) -> Vec<(Arc<Manifest>, usize)> {
        self.models
            .iter()
            .filter(|(id, _)| device.is_none_or(|d| id.device == d))
            .filter_map(|(_, m)| {
                let current = m.current.clone()?;
                let pins = m.pins.get(&current.version).copied().unwrap_or(0);
                Some((current, pins))
            })
            .collect()
    }
}

impl Model {
    /// A version no longer current: kept while an apply holds it, else handed back to delete.
    fn retire(&mut self, old: Arc<Manifest>) -> Option<Arc<Manifest>> {
        if self.pins.contains_key(&old.version) {
            self.retired.insert(old.version, old);
            None
        } else {
            Some(old)
        }
    }
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
