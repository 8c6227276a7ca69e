//! The etcd roles of a ferry cluster: what each member and each reader may touch in the
//! directory, set up on an etcd that then runs with auth on.
//!
//! A member reads the whole directory (`/ferry/`) and writes its own keys alone: its member
//! record (`/ferry/members/NAME`) and its tensor entries (`/ferry/tensors/NAME/`). A reader (an
//! operator's CLI, a coordinator) reads it. Every step is idempotent: run again, it adds what
//! is missing and grants again what is there (an existing user keeps its password).

use ferry_etcd::{Access, Etcd, EtcdError, Keys, Permission};
use ferry_proto::cluster::{self as keys, PREFIX};

/// Why a role could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RoleError {
    /// `root` is etcd's administrator: no member or reader may be it.
    #[error("{0:?} is etcd's administrator, not a member or reader")]
    Reserved(String),
    /// etcd refused or did not answer.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
}

/// etcd's administrator, the user and role `auth enable` asks for.
const ROOT: &str = "root";

/// The role etcd gives member `name`.
pub fn member_role(name: &str) -> String {
    format!("ferry-member-{name}")
}

/// The role etcd gives every reader.
pub const READER_ROLE: &str = "ferry-reader";

/// Adds the role of member `name` (read the directory, write its own keys) and gives it to etcd
/// user `user`, created with `password` where given and missing.
pub async fn add_member(
    etcd: &mut Etcd,
    name: &str,
    user: &str,
    password: Option<&str>,
) -> Result<(), RoleError> {
    not_root(name)?;
    not_root(user)?;
    let role = member_role(name);
    let record = keys::member_key(name);
    let tensors = keys::member_tensors(name);
    let grants = [
        Permission {
            access: Access::Read,
            keys: Keys::Prefix(PREFIX.as_bytes()),
        },
        Permission {
            access: Access::ReadWrite,
            keys: Keys::Exact(record.as_bytes()),
        },
        Permission {
            access: Access::ReadWrite,
            keys: Keys::Prefix(tensors.as_bytes()),
        },
    ];
    add_role(etcd, &role, &grants).await?;
    add_user(etcd, user, password, &role).await
}

/// Adds the readers' role (read the directory alone) where it is missing, and gives it to etcd
/// user `user`, created with `password` where given and missing.
pub async fn add_reader(
    etcd: &mut Etcd,
    user: &str,
    password: Option<&str>,
) -> Result<(), RoleError> {
    not_root(user)?;
    let grants = [Permission {
        access: Access::Read,
        keys: Keys::Prefix(PREFIX.as_bytes()),
    }];
    add_role(etcd, READER_ROLE, &grants).await?;
    add_user(etcd, user, password, READER_ROLE).await
}

/// Turns etcd's auth on, with user `root` (given `root_password` where it is missing) holding
/// etcd's all-powerful role `root`, as etcd asks. Add the members and readers first: from then
/// on only `root` may.
pub async fn enable_auth(etcd: &mut Etcd, root_password: &str) -> Result<(), RoleError> {
    add_role(etcd, ROOT, &[]).await?;
    add_user(etcd, ROOT, Some(root_password), ROOT).await?;
    Ok(etcd.auth_enable().await?)
}

fn not_root(name: &str) -> Result<(), RoleError> {
    if name == ROOT {
        return Err(RoleError::Reserved(name.to_string()));
    }
    Ok(())
}

/// Adds `role` where missing and grants it each of `grants` (again, where it was there).
async fn add_role(etcd: &mut Etcd, role: &str, grants: &[Permission<'_>]) -> Result<(), RoleError> {
    match etcd.role_add(role).await {
        Ok(()) => {}
        Err(e) if already_exists(&e) => {}
        Err(e) => return Err(e.into()),
    }
    for &grant in grants {
        etcd.role_grant(role, grant).await?;
    }
    Ok(())
}

/// Adds `user` with `password` where given and missing, and gives it `role`.
async fn add_user(
    etcd: &mut Etcd,
    user: &str,
    password: Option<&str>,
    role: &str,
) -> Result<(), RoleError> {
    if let Some(password) = password {
        match etcd.user_add(user, password).await {
            Ok(()) => {}
            Err(e) if already_exists(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(etcd.user_grant_role(user, role).await?)
}

/// etcd's "user name already exists" and "role name already exists".
fn already_exists(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Refused { message, .. } if message.contains("name already exists"))
}
