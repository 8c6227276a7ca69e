//! [`EtcdUser`]: the name and password of an etcd user, for an etcd that runs with auth on.

/// An etcd user a client authenticates as (etcd's `auth enable`), so that etcd's roles decide
/// which keys it may read and write. The password goes to the endpoints the caller configured
/// only, over TLS or to loopback ([`EtcdError::PasswordInClear`](crate::EtcdError) otherwise),
/// and is never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    name: String,
    password: String,
}

impl EtcdUser {
    /// A user named `name` with `password`; `None` where either is empty (etcd has no such user
    /// and no such password).
    pub fn new(name: impl Into<String>, password: impl Into<String>) -> Option<EtcdUser> {
        let (name, password) = (name.into(), password.into());
        (!name.is_empty() && !password.is_empty()).then_some(EtcdUser { name, password })
    }

    /// The user's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn password(&self) -> &str {
        &self.password
    }
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}
