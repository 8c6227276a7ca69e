//! The node-to-node half of the exchange: a pulling node's `Fetch` of the tensor a capability
//! names (a guard that must be followed by its payload) and its `Release`.

use ferry_proto::{CapabilityToken, NodeId, ProtoError, Request, Response, TensorInfo, TensorMeta};

use super::{Exchange, ExchangeError, Step};
use crate::TensorAssembler;
use crate::connection::{PayloadRoute, RegionUse, SealedRegion};

/// A fetch the source answered: the tensor it is sending and its meta. The payload follows on
/// the wire, so the connection is in step again only once [`payload`](Self::payload) has read it;
/// dropping the guard instead leaves it out of step.
#[derive(Debug)]
pub struct Fetch<'a> {
    step: Step<'a>,
    /// The tensor the capability names.
    pub info: TensorInfo,
    /// Its validated meta: what the payload must fill.
    pub meta: TensorMeta,
}

impl Exchange {
    /// Asks the source for the tensor `capability` names, bound to `node_id`, from `offset` on.
    pub async fn fetch(
        &mut self,
        capability: &CapabilityToken,
        node_id: &NodeId,
        offset: u64,
    ) -> Result<Fetch<'_>, ExchangeError> {
        let mut step = self.begin()?;
        let request = Request::Fetch {
            capability: capability.clone(),
            node_id: node_id.clone(),
            offset,
        };
        step.send(&request).await?;
        let answer = step
            .answer(|answer| match answer {
                Response::Tensor { info, meta } => Some((info, meta)),
                _ => None,
            })
            .await;
        match answer {
            // Still in the exchange: the payload follows.
            Ok((info, wire)) => {
                let meta = TensorMeta::try_from(&wire).map_err(ProtoError::from)?;
                Ok(Fetch { step, info, meta })
            }
            Err(e) => Err(step.fail(e)),
        }
    }

    /// Tells the source every byte arrived, which uses the capability up.
    pub async fn release(
        &mut self,
        capability: &CapabilityToken,
        node_id: &NodeId,
    ) -> Result<(), ExchangeError> {
        let request = Request::Release {
            capability: capability.clone(),
            node_id: node_id.clone(),
        };
        self.call(&request, |answer| match answer {
            Response::Released => Some(()),
            _ => None,
        })
        .await
    }
}

impl Fetch<'_> {
    /// Reads the payload into `assembler`, from where its verified bytes end, doing with a
    /// payload that comes as a shared-memory region what `regions` says; ends the exchange.
    pub async fn payload(
        mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ExchangeError> {
        let received = self.step.read_payload(assembler, regions).await?;
        self.step.finish();
        Ok(received)
    }
}
