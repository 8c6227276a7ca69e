//! etcd's users and roles: the calls that set up an etcd with auth on, so that its roles keep
//! each client to the keys it may read and write (etcd's `auth enable`).

use serde::Serialize;
use serde::de::IgnoredAny;

use crate::client::Etcd;
use crate::error::EtcdError;
use crate::wire::{self, base64};

/// What a role may do with the keys of a [`Permission`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read them (ranges, watches).
    Read,
    /// Write them (puts, deletes).
    Write,
    /// Both.
    ReadWrite,
}

/// The keys a role's permission covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys<'a> {
    /// This one key.
    Exact(&'a [u8]),
    /// Every key that starts with this prefix (not empty: etcd reads that as every key).
    Prefix(&'a [u8]),
}

/// One permission of a role: an access to some keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission<'a> {
    /// What may be done.
    pub access: Access,
    /// To which keys.
    pub keys: Keys<'a>,
}

#[derive(Serialize)]
struct UserAdd<'a> {
    name: &'a str,
    password: &'a str,
}

#[derive(Serialize)]
struct RoleAdd<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct RoleGrant<'a> {
    name: &'a str,
    perm: WirePermission,
}

/// A [`Permission`] as the gateway's JSON spells it.
#[derive(Serialize)]
struct WirePermission {
    #[serde(rename = "permType")]
    kind: &'static str,
    key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    range_end: Option<String>,
}

#[derive(Serialize)]
struct UserGrant<'a> {
    user: &'a str,
    role: &'a str,
}

impl Etcd {
    /// Adds user `name` with `password`, refused where any endpoint would get the password in
    /// clear beyond loopback.
    pub async fn user_add(&mut self, name: &str, password: &str) -> Result<(), EtcdError> {
        self.check_password_route()?;
        let _: IgnoredAny = self
            .call("/v3/auth/user/add", &UserAdd { name, password })
            .await?;
        Ok(())
    }

    /// Adds role `name`, with no permission yet.
    pub async fn role_add(&mut self, name: &str) -> Result<(), EtcdError> {
        let _: IgnoredAny = self.call("/v3/auth/role/add", &RoleAdd { name }).await?;
        Ok(())
    }

    /// Gives role `role` the permission `permission`.
    pub async fn role_grant(
        &mut self,
        role: &str,
        permission: Permission<'_>,
    ) -> Result<(), EtcdError> {
        let (key, range_end) = match permission.keys {
            Keys::Exact(key) => (key, None),
            Keys::Prefix(prefix) => {
                // An empty prefix would be etcd's "every key": said as it is, not guessed.
                if prefix.is_empty() {
                    return Err(EtcdError::EmptyPrefix);
                }
                (prefix, Some(base64(&wire::prefix_end(prefix))))
            }
        };
        let perm = WirePermission {
            kind: match permission.access {
                Access::Read => "READ",
                Access::Write => "WRITE",
                Access::ReadWrite => "READWRITE",
            },
            key: base64(key),
            range_end,
        };
        let _: IgnoredAny = self
            .call("/v3/auth/role/grant", &RoleGrant { name: role, perm })
            .await?;
        Ok(())
    }

    /// Gives user `user` role `role`.
    pub async fn user_grant_role(&mut self, user: &str, role: &str) -> Result<(), EtcdError> {
        let _: IgnoredAny = self
            .call("/v3/auth/user/grant", &UserGrant { user, role })
            .await?;
        Ok(())
    }

    /// Turns auth on: from then on every request is made as a user, and etcd's roles decide it
    /// (etcd asks for a user `root` with role `root` first).
    pub async fn auth_enable(&mut self) -> Result<(), EtcdError> {
        let _: IgnoredAny = self.call("/v3/auth/enable", &serde_json::json!({})).await?;
        Ok(())
    }
}
