//! The choices a request makes, as types rather than flags: what becomes of a tensor already
//! registered under the target key ([`IfExists`]), and whether a transfer keeps its source
//! ([`Transfer`]). On the wire they are the booleans `overwrite` and `remove_source`.

/// What becomes of a tensor already registered under the key a new one is registered under.
// Exhaustive on purpose, as `Transfer` is: each is the wire's boolean (`overwrite`,
// `remove_source`) as a type, and a third answer would be a new request field, not a variant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum IfExists {
    /// It stays, and the new tensor is refused (`AlreadyExists`).
    #[default]
    Refuse,
    /// The new tensor replaces it (and takes over its slot under the device's tensor cap).
    Replace,
}

impl IfExists {
    /// The wire's `overwrite` flag.
    pub fn overwrite(self) -> bool {
        self == IfExists::Replace
    }

    /// What a request's `overwrite` flag asks for.
    pub fn from_overwrite(overwrite: bool) -> Self {
        if overwrite {
            IfExists::Replace
        } else {
            IfExists::Refuse
        }
    }
}

/// Whether a transfer keeps its source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Transfer {
    /// The source stays.
    #[default]
    Copy,
    /// The source is deleted once the target registered the tensor (and, between nodes, only
    /// the version that was copied).
    Move,
}

impl Transfer {
    /// The wire's `remove_source` flag.
    pub fn removes_source(self) -> bool {
        self == Transfer::Move
    }

    /// What a request's `remove_source` flag asks for.
    pub fn from_remove_source(remove_source: bool) -> Self {
        if remove_source {
            Transfer::Move
        } else {
            Transfer::Copy
        }
    }
}
