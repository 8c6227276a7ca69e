//! The etcd roles of a ferry cluster: what each member and each reader may touch in the
//! directory, set up on an etcd that then runs with auth on.
//!
//! A member reads the whole directory (`/ferry/`) and writes its own keys alone: its member
//! record (`/ferry/members/NAME`) and its tensor entries (`/ferry/tensors/NAME/`). A reader (an
//! operator's CLI, a coordinator) reads and writes nothing else. Leases need no permission; a
//! lease's revocation deletes only keys its holder could write.

use ferry_etcd::{Access, Etcd, EtcdError, Grant, Keys};
use ferry_proto::cluster::{self as keys, PREFIX};

/// The role etcd gives member `name`.
pub fn member_role(name: &str) -> String {
    format!("ferry-member-{name}")
}

/// The role etcd gives every reader.
pub const READER_ROLE: &str = "ferry-reader";

/// Adds the role of member `name` (read the directory, write its own keys) and gives it to etcd
/// user `user`, created with `password` where given (an existing user otherwise).
pub async fn add_member(
    etcd: &mut Etcd,
    name: &str,
    user: &str,
    password: Option<&str>,
) -> Result<(), EtcdError> {
    let role = member_role(name);
    let record = keys::member_key(name);
    let tensors = keys::member_tensors(name);
    etcd.role_add(&role).await?;
    for grant in [
        Grant {
            access: Access::Read,
            keys: Keys::Prefix(PREFIX.as_bytes()),
        },
        Grant {
            access: Access::ReadWrite,
            keys: Keys::Exact(record.as_bytes()),
        },
        Grant {
            access: Access::ReadWrite,
            keys: Keys::Prefix(tensors.as_bytes()),
        },
    ] {
        etcd.role_grant(&role, grant).await?;
    }
    if let Some(password) = password {
        etcd.user_add(user, password).await?;
    }
    etcd.user_grant_role(user, &role).await
}

/// Adds the readers' role (read the directory alone) where it is missing, and gives it to
/// etcd user `user`, created with `password` where given.
pub async fn add_reader(
    etcd: &mut Etcd,
    user: &str,
    password: Option<&str>,
) -> Result<(), EtcdError> {
    match etcd.role_add(READER_ROLE).await {
        Ok(()) => {
            etcd.role_grant(
                READER_ROLE,
                Grant {
                    access: Access::Read,
                    keys: Keys::Prefix(PREFIX.as_bytes()),
                },
            )
            .await?;
        }
        // Added with an earlier reader.
        Err(EtcdError::Refused { message, .. }) if message.contains("role name already exists") => {
        }
        Err(e) => return Err(e),
    }
    if let Some(password) = password {
        etcd.user_add(user, password).await?;
    }
    etcd.user_grant_role(user, READER_ROLE).await
}

/// Turns etcd's auth on, with user `root` (given `root_password`) holding etcd's all-powerful
/// role `root`, as etcd asks. Add the members and readers first: from then on only `root` may.
pub async fn enable_auth(etcd: &mut Etcd, root_password: &str) -> Result<(), EtcdError> {
    etcd.user_add("root", root_password).await?;
    etcd.role_add("root").await?;
    etcd.user_grant_role("root", "root").await?;
    etcd.auth_enable().await
}
