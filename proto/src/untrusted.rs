//! Strings a peer chose (its agent name, an address it asks a node to pull from), made safe to
//! write into a log: control characters escaped, so that no peer can start a forged log line, and
//! the length bounded, so that no peer can fill a disk one line at a time.

use std::fmt;

/// The most characters of an untrusted string a log line carries; the rest is elided.
pub const MAX_LOGGED_CHARS: usize = 128;

/// A string a peer chose, displayed escaped and truncated (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Untrusted<'a>(pub &'a str);

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut chars = self.0.chars();
        for c in chars.by_ref().take(MAX_LOGGED_CHARS) {
            if c.is_control() || c == '\\' {
                write!(f, "{}", c.escape_default())?;
            } else {
                write!(f, "{c}")?;
            }
        }
        let rest = chars.count();
        if rest > 0 {
            write!(f, "...({rest} more characters)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_length_is_bounded() {
        assert_eq!(Untrusted("ferry-cli/0.1").to_string(), "ferry-cli/0.1");
        assert_eq!(
            Untrusted("evil\nINFO forged line\r\u{1b}[31m").to_string(),
            "evil\\nINFO forged line\\r\\u{1b}[31m"
        );
        assert_eq!(
            Untrusted("a\\nb").to_string(),
            "a\\\\nb",
            "a literal backslash stays apart"
        );
        assert_eq!(
            Untrusted("näme").to_string(),
            "näme",
            "printable text is left alone"
        );
        let long = "x".repeat(MAX_LOGGED_CHARS + 5);
        let shown = Untrusted(&long).to_string();
        assert_eq!(
            shown,
            format!("{}...(5 more characters)", "x".repeat(MAX_LOGGED_CHARS))
        );
    }
}
