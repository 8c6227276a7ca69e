//! A pull's connections to its source: kept across the pulls of one session, reused only where
//! in step and opened on the terms the node's policy gives the source now, dialled otherwise.

use ferry_io::{Dial, Exchange};

use super::failure::{AttemptError, opening_failed};
use crate::error::NodeError;
use crate::node::{Node, PeerTerms};

/// A pull's connection to its source, kept across the pulls of one session (a batch goes over
/// one connection), and the helper connections its striped pulls opened beside it.
#[derive(Debug, Default)]
pub(crate) struct PeerLink {
    pub(super) source: Option<OpenLink>,
    pub(super) helpers: Vec<OpenLink>,
}

/// A connection to a source, with the terms it was opened on.
#[derive(Debug)]
pub(super) struct OpenLink {
    pub(super) addr: String,
    /// What was checked of it before anything was sent, and whether the peer token was sent.
    pub(super) terms: PeerTerms,
    pub(super) conn: Exchange,
}

impl Node {
    /// A link whose peer stopped answering mid-exchange is out of step: never reuse it.
    pub(super) fn drop_link_after_timeout(&self, link: &mut PeerLink) {
        link.source = None;
    }

    /// The session's connection to `source`, opened if needed.
    pub(super) async fn link_to<'a>(
        &self,
        link: &'a mut PeerLink,
        source: &str,
    ) -> Result<&'a mut Exchange, AttemptError> {
        let terms = self.terms_for(source)?;
        // A connection left out of step (a fetch abandoned before its payload) is never reused,
        // nor one opened on other terms (another identity checked, another token sent).
        let kept = link
            .source
            .take()
            .filter(|kept| kept.addr == source && kept.terms == terms && kept.conn.in_step());
        let current = match kept {
            Some(current) => current,
            None => self.dial(source, terms).await?,
        };
        Ok(&mut link.source.insert(current).conn)
    }

    /// The terms this node connects to `source` on, decided on every pull, a reused link
    /// included: the cluster's member list may have changed since the link was opened (or since
    /// this pull was admitted).
    pub(super) fn terms_for(&self, source: &str) -> Result<PeerTerms, AttemptError> {
        let config = self.config();
        config
            .pulls
            .peers
            .terms(
                source,
                config.tls.is_some(),
                config.pulls.peer_token.as_ref(),
            )
            .ok_or_else(|| AttemptError::Fatal(NodeError::NotAllowedPeer(source.to_string())))
    }

    /// A new connection to `source`, on `terms`.
    pub(super) async fn dial(
        &self,
        source: &str,
        terms: PeerTerms,
    ) -> Result<OpenLink, AttemptError> {
        let config = self.config();
        let dial = Dial {
            token: terms.token.as_ref(),
            agent: crate::node::AGENT,
            tls: config.tls.as_ref().map(|tls| tls.client()),
            check: &terms.check,
            clear_tokens: config.pulls.clear_tokens,
            shared_memory: config.shared_memory,
            limits: config.pulls.peer_limits,
        };
        let endpoint = ferry_io::Endpoint::parse(source);
        let connect = dial.open(&endpoint);
        let conn = tokio::time::timeout(config.pulls.peer_limits.idle_timeout, connect)
            .await
            .map_err(|_| AttemptError::Transient(format!("connecting to {source} timed out")))?
            .map_err(|e| opening_failed(source, e))?;
        Ok(OpenLink {
            addr: source.to_string(),
            terms,
            conn,
        })
    }
}
