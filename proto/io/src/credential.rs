//! A client's token file, and what can be wrong with a token or a token file. The credentials a
//! node accepts (digests of tokens, with their scopes) and the node's token-file format are the
//! node's own (`ferry-server`); the error is shared, as both the `ferry` command and a node read
//! a token from a file ([`token_from_file`]) and report it alike.

/// Why a credential could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// An empty token, which would be no authentication at all.
    #[error("a token may not be empty")]
    Empty,
    /// No scopes: a credential that allows nothing.
    #[error("a credential needs at least one scope")]
    NoScopes,
    /// A scope name that is not `read`, `write` or `peer`. Not echoed: a line written the wrong
    /// way round would put its token there.
    #[error("an unknown scope (the scopes are read, write, peer and all)")]
    UnknownScope,
    /// A line of a token file that is not a credential, by number (from 1).
    #[error("line {line}: {error}")]
    Line {
        /// The line's number.
        line: usize,
        /// What is wrong with it.
        error: Box<CredentialError>,
    },
    /// One token on two lines, by number: which scopes it has would be ambiguous.
    #[error("line {line}: the same token as line {first}")]
    Duplicate {
        /// The later line.
        line: usize,
        /// The line it repeats.
        first: usize,
    },
}

/// The token in a client's token file: its first line that is neither blank nor a `#` comment,
/// trimmed.
pub fn token_from_file(text: &str) -> Result<String, CredentialError> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .ok_or(CredentialError::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_the_first_line_that_is_neither_blank_nor_a_comment() {
        assert_eq!(
            token_from_file("# mine\n\n  s3cret \n"),
            Ok("s3cret".to_string())
        );
        assert_eq!(token_from_file("# nothing\n"), Err(CredentialError::Empty));
    }
}
