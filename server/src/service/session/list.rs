//! List and ListPage: the tensors a node holds, on one device or all, in one bounded answer or a
//! page at a time.

use ferry_proto::{Response, TensorKey};

use super::Session;
use crate::error::NodeError;
use crate::node::MAX_PAGE;

impl Session<'_> {
    /// The old, unpaged listing: bounded to what one answer holds.
    pub(super) async fn list_whole(&self, device: Option<u32>) -> Result<Response, NodeError> {
        let (page, next) = self.node.list_page(device, None, MAX_PAGE).await?;
        if let Some(next) = next
            && !self
                .node
                .list_page(device, Some(&next), 1)
                .await?
                .0
                .is_empty()
        {
            let indexes: Vec<u32> = match device {
                Some(index) => vec![index],
                None => self.node.devices().iter().map(|d| d.index()).collect(),
            };
            let mut tensors = 0u64;
            for index in indexes {
                tensors += self.node.summary(index).await?.tensors;
            }
            return Err(NodeError::ListingTooLarge {
                tensors,
                limit: MAX_PAGE,
            });
        }
        Ok(Response::Listing(
            page.iter().map(|d| d.to_wire()).collect(),
        ))
    }

    /// A page of the listing: at most `limit` tensors after the key `after` (the node may
    /// answer fewer), and the key to ask the next page after.
    pub(super) async fn list_page(
        &self,
        device: Option<u32>,
        after: Option<&TensorKey>,
        limit: u32,
    ) -> Result<Response, NodeError> {
        self.node
            .list_page(device, after, limit as usize)
            .await
            .map(|(page, next)| Response::Page {
                tensors: page.iter().map(|d| d.to_wire()).collect(),
                next,
            })
    }
}
