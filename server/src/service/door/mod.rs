//! The node's door: who may come in and with what. The credentials it accepts over TCP in clear
//! (`credential.rs`: tokens as digests, with their scopes, and the token-file format), the scopes
//! it grants to certificate identities under TLS (`certificate_grant.rs`), the accepting side's
//! half of the opening exchange (`handshake.rs`: the door a peer came in, its `Hello` heard and
//! welcomed or refused), and the log of refusals bounded in rate that every refusal a peer can
//! cause goes through (`refusal_log.rs`).

pub(crate) mod certificate_grant;
pub(crate) mod credential;
pub(crate) mod handshake;
pub(crate) mod refusal_log;
