//! The node-to-node half of the exchange: a pulling node's `Fetch` of the tensor a capability
//! names, or of a range of it (`FetchRange`: one stripe), each a guard that must be followed by
//! its payload, and its `Release`.

use std::ops::Range;

use ferry_proto::{CapabilityToken, NodeId, ProtoError, Request, Response, TensorInfo, TensorMeta};

use super::{Exchange, ExchangeError, Step};
use crate::TensorAssembler;
use crate::connection::{PayloadRoute, RegionUse, SealedRegion};
use crate::striped::StripeReceiver;

/// A fetch the source answered: the tensor it is sending, its meta and the payload bytes that
/// follow. They follow on the wire, so the connection is in step again only once
/// [`payload`](Self::payload) or [`stripe`](Self::stripe) has read them; dropping the guard
/// instead leaves it out of step.
#[derive(Debug)]
pub struct Fetch<'a> {
    step: Step<'a>,
    /// The tensor the capability names.
    pub info: TensorInfo,
    /// Its validated meta: what the payload must fill.
    pub meta: TensorMeta,
    /// The payload bytes that follow, within the payload: from the offset asked for to the end,
    /// or for a ranged fetch the range the source answered.
    pub range: Range<u64>,
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
                let range = offset.min(meta.byte_len() as u64)..meta.byte_len() as u64;
                Ok(Fetch {
                    step,
                    info,
                    meta,
                    range,
                })
            }
            Err(e) => Err(step.fail(e)),
        }
    }

    /// Asks the source for the part of the tensor `capability` names at `input` of its content
    /// hash's input (the meta's bytes, then the payload: PROTOCOL.md §7.2), bound to `node_id`.
    /// The answer names the payload range that follows: the part asked for, or from its start to
    /// the payload's end where the source sends the rest on this connection instead. A source
    /// of an older minor is [`ExchangeError::NodeTooOld`], nothing sent.
    pub async fn fetch_range(
        &mut self,
        capability: &CapabilityToken,
        node_id: &NodeId,
        input: Range<u64>,
    ) -> Result<Fetch<'_>, ExchangeError> {
        let mut step = self.begin()?;
        let request = Request::FetchRange {
            capability: capability.clone(),
            node_id: node_id.clone(),
            from: input.start,
            to: input.end,
        };
        step.send(&request).await?;
        let answer = step
            .answer(|answer| match answer {
                Response::TensorPart {
                    info,
                    meta,
                    start,
                    end,
                } => Some((info, meta, start..end)),
                _ => None,
            })
            .await;
        let (info, wire, range) = match answer {
            Ok(answer) => answer,
            Err(e) => return Err(step.fail(e)),
        };
        let meta = TensorMeta::try_from(&wire).map_err(ProtoError::from)?;
        // The range must lie in the payload and start where the part asked for starts.
        let prefix = ferry_proto::tensor::content_hash_prefix(&meta).len() as u64;
        let len = meta.byte_len() as u64;
        let asked = ferry_proto::stripes::payload_part(prefix, len, input);
        let fits = range.start == asked.start
            && range.end <= len
            && (range.end == asked.end || range.end == len);
        if !fits {
            let what =
                format!("payload bytes {range:?} of {len} for the part asked for, bytes {asked:?}");
            return Err(step.fail(ExchangeError::Unexpected(what)));
        }
        Ok(Fetch {
            step,
            info,
            meta,
            range,
        })
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
    /// payload that comes as a shared-memory region what `regions` says; ends the exchange. The
    /// bytes that follow must run from there to the payload's end.
    pub async fn payload(
        mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ExchangeError> {
        let rest = assembler.received() as u64..assembler.meta().byte_len() as u64;
        if self.range != rest {
            let what = format!("payload bytes {:?} where {rest:?} are due", self.range);
            return Err(self.step.fail(ExchangeError::Unexpected(what)));
        }
        let received = self.step.read_payload(assembler, regions).await?;
        self.step.finish();
        Ok(received)
    }

    /// Reads the part that follows into `stripe`, whose next bytes it must be, to the stripe's
    /// end; ends the exchange.
    pub async fn stripe(mut self, stripe: &mut StripeReceiver) -> Result<(), ExchangeError> {
        let due = stripe.next_offset()..stripe.payload_range().end;
        if self.range != due {
            let what = format!("payload bytes {:?} where {due:?} are due", self.range);
            return Err(self.step.fail(ExchangeError::Unexpected(what)));
        }
        self.step.read_chunks(stripe).await?;
        self.step.finish();
        Ok(())
    }
}
