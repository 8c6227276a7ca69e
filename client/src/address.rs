//! The addresses the command line and scripts use: `NODE[/DEVICE[/NAME]]`, where NODE is
//! `HOST:PORT`, `unix:PATH` or `@MEMBER` (a member of a cluster, resolved by its directory).

use std::path::Path;

use ferry_io::transport::UNIX_PREFIX;

/// Why an address does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    /// It does not start with `HOST:PORT`, `unix:PATH` or `@MEMBER`.
    #[error("{0:?} does not start with a node address HOST:PORT, unix:PATH or @MEMBER")]
    NoNode(String),
    /// `@MEMBER` with a name no member can have.
    #[error("{0:?}: not a member name (1 to 63 letters, digits, '-', '_', '.')")]
    BadMember(String),
    /// `unix:PATH` where no prefix of PATH is a Unix socket.
    #[error("{0:?}: no Unix socket found at unix:PATH")]
    NoSocket(String),
    /// The part after the node is not a device index.
    #[error("{text:?}: device {device:?} is not a device index")]
    BadDevice {
        /// The whole address.
        text: String,
        /// The part that should have been a device.
        device: String,
    },
    /// A command that needs a device got a node alone.
    #[error("{what} needs a device: HOST:PORT/DEVICE")]
    NoDevice {
        /// The command.
        what: String,
    },
}

/// A parsed `NODE[/DEVICE[/NAME]]`, where NODE is `HOST:PORT`, `unix:PATH` or `@MEMBER`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// `HOST:PORT`, `unix:PATH` or `@MEMBER`.
    pub node: String,
    /// The device index, where given.
    pub device: Option<u32>,
    /// The tensor name (which may hold `/`), where given.
    pub name: Option<String>,
}

impl Address {
    /// Parses `text`, asking the file system which paths are Unix sockets.
    pub fn parse(text: &str) -> Result<Address, AddressError> {
        Self::parse_with(text, &|path| {
            use std::os::unix::fs::FileTypeExt;
            std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
        })
    }

    /// Parses with `is_socket` telling which paths are Unix sockets: a socket path can hold any
    /// number of `/` (and digit-only parts like `/run/user/1000`), so the node is the longest
    /// prefix that is a socket, and what follows it is DEVICE/NAME.
    pub fn parse_with(
        text: &str,
        is_socket: &dyn Fn(&Path) -> bool,
    ) -> Result<Address, AddressError> {
        let (node, rest) = match text.strip_prefix(UNIX_PREFIX) {
            Some(path) => {
                let ends = path
                    .match_indices('/')
                    .map(|(i, _)| i)
                    .chain([path.len()])
                    .filter(|&i| i > 0)
                    .rev();
                let Some(end) = ends.into_iter().find(|&i| is_socket(Path::new(&path[..i]))) else {
                    return Err(AddressError::NoSocket(text.to_string()));
                };
                let rest = path[end..].strip_prefix('/');
                (&text[..UNIX_PREFIX.len() + end], rest)
            }
            None => match text.split_once('/') {
                Some((node, rest)) => (node, Some(rest)),
                None => (text, None),
            },
        };
        match node.strip_prefix('@') {
            Some(member) if !ferry_proto::cluster::valid_member_name(member) => {
                return Err(AddressError::BadMember(text.to_string()));
            }
            Some(_) => {}
            None if node.is_empty() || !node.contains(':') => {
                return Err(AddressError::NoNode(text.to_string()));
            }
            None => {}
        }
        let (device, name) = match rest {
            None | Some("") => (None, None),
            Some(rest) => {
                let (device, name) = match rest.split_once('/') {
                    Some((device, name)) => (device, Some(name)),
                    None => (rest, None),
                };
                let device = device.parse::<u32>().map_err(|_| AddressError::BadDevice {
                    text: text.to_string(),
                    device: device.to_string(),
                })?;
                let name = name.filter(|n| !n.is_empty()).map(str::to_string);
                (Some(device), name)
            }
        };
        Ok(Address {
            node: node.to_string(),
            device,
            name,
        })
    }

    /// The device, which `what` (a command) needs.
    pub fn device(&self, what: &str) -> Result<u32, AddressError> {
        self.device.ok_or_else(|| AddressError::NoDevice {
            what: what.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            Address::parse("127.0.0.1:7070/1/encoder.layer1/weight").unwrap(),
            Address {
                node: "127.0.0.1:7070".into(),
                device: Some(1),
                name: Some("encoder.layer1/weight".into())
            }
        );
        assert_eq!(
            Address::parse("host:1/0").unwrap(),
            Address {
                node: "host:1".into(),
                device: Some(0),
                name: None
            }
        );
        assert_eq!(Address::parse("[::1]:7/2/x").unwrap().node, "[::1]:7");
        assert!(Address::parse("nohost/0").is_err());
        let sockets =
            |p: &Path| p == Path::new("/run/user/1000/ferry.sock") || p == Path::new("/s");
        assert_eq!(
            Address::parse_with("unix:/run/user/1000/ferry.sock/2/a/b", &sockets).unwrap(),
            Address {
                node: "unix:/run/user/1000/ferry.sock".into(),
                device: Some(2),
                name: Some("a/b".into())
            }
        );
        assert_eq!(
            Address::parse_with("unix:/s", &sockets).unwrap(),
            Address {
                node: "unix:/s".into(),
                device: None,
                name: None
            }
        );
        assert_eq!(
            Address::parse_with("unix:/s/0", &sockets).unwrap().device,
            Some(0)
        );
        assert!(Address::parse_with("unix:/nowhere/0/x", &sockets).is_err());
        assert!(Address::parse("h:1/gpu/x").is_err());
        assert_eq!(
            Address::parse("@cache/0/encoder.w").unwrap(),
            Address {
                node: "@cache".into(),
                device: Some(0),
                name: Some("encoder.w".into())
            }
        );
        assert_eq!(Address::parse("@worker-3").unwrap().device, None);
        for bad in ["@", "@/0", "@a b/0", "@.x/1"] {
            assert!(
                matches!(Address::parse(bad), Err(AddressError::BadMember(_))),
                "{bad}"
            );
        }
    }
}
