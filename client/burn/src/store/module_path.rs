//! `ModulePath`: where a walk over a module is, named as burn-store names a parameter's path
//! (field names joined by `.`) and matched by its `PathFilter` (with the containers' types).

use burn_store::PathFilter;

/// The fields entered so far, with the type of each container entered.
#[derive(Debug, Default)]
pub(crate) struct ModulePath {
    names: Vec<String>,
    containers: Vec<String>,
}

impl ModulePath {
    /// Into field `name` of a container of type `container_type`.
    pub(crate) fn enter(&mut self, name: &str, container_type: &str) {
        self.names.push(name.to_string());
        self.containers.push(container_type.to_string());
    }

    /// Out of the field last entered.
    pub(crate) fn exit(&mut self) {
        self.names.pop();
        self.containers.pop();
    }

    /// The path as burn-store names it: `encoder.layers.0.weight`.
    pub(crate) fn joined(&self) -> String {
        self.names.join(".")
    }

    /// The containers' types, as burn-store's `ApplyResult::missing` lists them (the embedded
    /// store's apply; the connected one's is burn-store's own).
    #[cfg(feature = "node")]
    pub(crate) fn containers_joined(&self) -> String {
        self.containers.join(".")
    }

    /// Whether `filter` lets the parameter here through, as burn-store's collector and
    /// `Applier` decide.
    pub(crate) fn passes(&self, filter: Option<&PathFilter>) -> bool {
        self.passes_at(&self.names, filter)
    }

    /// Whether `filter` lets through a parameter a module visits at the explicit path `names`
    /// (`visit_*_with_path`), matched, as burn-store's collector matches it, with the
    /// containers entered here.
    pub(crate) fn passes_at(&self, names: &[String], filter: Option<&PathFilter>) -> bool {
        filter.is_none_or(|f| f.matches_with_container_path(names, &self.containers))
    }
}
