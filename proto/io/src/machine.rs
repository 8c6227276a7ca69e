//! This machine's name (the kernel's node name, as `uname -n` prints it), which a cluster member
//! publishes so that a client can tell which members share a host with which.

/// The machine's name; empty where the kernel reports none that is UTF-8.
pub fn name() -> String {
    let uname = rustix::system::uname();
    uname.nodename().to_str().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_machine_has_a_name() {
        let name = super::name();
        assert!(!name.is_empty());
        assert_eq!(name, super::name());
    }
}
