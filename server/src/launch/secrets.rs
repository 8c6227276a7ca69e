//! Files of secrets (tokens, passwords) read for a server: whole, with a warning where other
//! users of the machine may read them too.

use std::path::Path;

use super::StartError;

/// A file of secrets, read whole; a warning where its group or others may read it.
pub(crate) fn read_secret(path: &Path) -> Result<String, StartError> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |source| StartError::Secret {
        path: path.to_path_buf(),
        source,
    };
    let metadata = std::fs::metadata(path).map_err(failed)?;
    if metadata.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "the file of secrets is readable by other users; chmod 600 it"
        );
    }
    std::fs::read_to_string(path).map_err(failed)
}

/// The token in a file: its first line that is neither blank nor a `#` comment.
pub(crate) fn token_in(path: &Path) -> Result<String, StartError> {
    ferry_io::credential::token_from_file(&read_secret(path)?).map_err(|source| {
        StartError::SecretFile {
            path: path.to_path_buf(),
            source,
        }
    })
}
