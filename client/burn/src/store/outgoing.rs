//! A collect's parameters on their way to the connections that send them (`Deal`): each found
//! by `CollectWalk` or burn-store's collect, read off its device (a Flex parameter's buffers
//! shared as Flex keeps them, quantized ones included, sent end to end without joining them;
//! anything else copied to the host as burn-store reads it, within a window of host copies)
//! and dealt to connection `i % n` in the order the module is walked, where each connection's
//! sender puts what has arrived for it in one pipelined batch (`next_batch`, `put_batch`).

use std::sync::mpsc::{Receiver, Sender};

use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Tensor, TensorData};
use burn_pack::Tensor as PackTensor;
use burn_store::bridge;
use ferry_backend::SharedPayload;
use ferry_client::{BlockingClient, TensorParts, Wait};

use crate::StoreError;
use crate::shared_data::shared_param;
use crate::store::collect_walk::TakeParam;
use crate::store::link::Sending;
use crate::store::window::Window;

/// A parameter on its way to a sender: its path, its bytes as read off its device, and the
/// bytes of host copy it holds of the window (a copy's, or the scale bytes encoded beside a
/// quantized tensor's shared values; none for a plain buffer shared as it lies).
pub(crate) struct Outgoing {
    pub(crate) path: String,
    pub(crate) data: Result<Outbound, StoreError>,
    pub(crate) held: u64,
}

/// A parameter's bytes: Flex's own buffers, shared, or a host copy.
pub(crate) enum Outbound {
    /// Where Flex keeps them (the values' buffer, then any scale bytes `into_data` appends).
    Shared(SharedPayload),
    /// Read off as burn-store reads it.
    Copy(TensorData),
}

impl Outbound {
    /// What a put sends: the shared buffers end to end, never joined, or the copy.
    pub(crate) fn parts(&self) -> TensorParts<'_> {
        match self {
            Outbound::Shared(shared) => {
                let parts = [&shared.values[..], &shared.tail[..]]
                    .into_iter()
                    .filter(|part| !part.is_empty())
                    .collect();
                TensorParts::new(shared.shape.clone(), shared.dtype, parts)
            }
            Outbound::Copy(data) => TensorParts::new(
                data.shape().as_slice().to_vec(),
                data.dtype(),
                vec![data.as_bytes()],
            ),
        }
    }
}

/// Deals parameters to the senders' channels in turn. Stops for good once a sender has gone
/// (its channel refuses) or closed the window (it failed): the walk then reads nothing more.
pub(crate) struct Deal<'a> {
    senders: Vec<Sender<Outgoing>>,
    window: &'a Window,
    dealt: usize,
    stopped: bool,
}

impl<'a> Deal<'a> {
    pub(crate) fn new(senders: Vec<Sender<Outgoing>>, window: &'a Window) -> Self {
        Self {
            senders,
            window,
            dealt: 0,
            stopped: false,
        }
    }

    /// Hands the parameter at `path` to the next sender: `held` bytes of the window taken
    /// first (waiting for room; what holds none never waits), then `read` run. False once the
    /// deal stopped.
    pub(crate) fn offer(
        &mut self,
        path: String,
        held: u64,
        read: impl FnOnce() -> Result<Outbound, StoreError>,
    ) -> bool {
        if self.stopped || self.senders.is_empty() {
            self.stopped = true;
            return false;
        }
        let room = match held {
            0 => !self.window.is_closed(),
            _ => self.window.take(held),
        };
        if !room {
            self.stopped = true;
            return false;
        }
        let outgoing = Outgoing {
            path,
            data: read(),
            held,
        };
        let sender = &self.senders[self.dealt % self.senders.len()];
        self.dealt += 1;
        if sender.send(outgoing).is_err() {
            self.stopped = true;
        }
        !self.stopped
    }

    /// Reads `tensor` (one of burn-store's, as its collect gives them) off its device as
    /// burn-store does, within the window, and hands it on.
    pub(crate) fn offer_read_off(&mut self, tensor: PackTensor) -> bool {
        let path = tensor.name.clone();
        let held = tensor.byte_len() as u64;
        let read_path = path.clone();
        self.offer(path, held, move || read_off(read_path, tensor))
    }
}

/// `tensor`'s bytes as burn-store reads them: its provider run (a copy off the device).
fn read_off(path: String, tensor: PackTensor) -> Result<Outbound, StoreError> {
    bridge::into_data(tensor)
        .map(Outbound::Copy)
        .map_err(|e| StoreError::ReadBack {
            path,
            message: e.to_string(),
        })
}

/// Deals what a collect's walk finds: a Flex parameter's buffers shared, anything else read off
/// as burn-store reads it.
impl TakeParam for &mut Deal<'_> {
    fn stopped(&self) -> bool {
        self.stopped
    }

    fn take<const D: usize, K: Basic + 'static>(&mut self, path: String, tensor: &Tensor<D, K>) {
        match shared_param(tensor) {
            // The module holds the values' buffer throughout the collect: only the scale bytes
            // made for the send (none for a plain tensor) hold window room.
            Some(shared) => {
                let held = shared.tail.len() as u64;
                self.offer(path, held, || Ok(Outbound::Shared(shared)))
            }
            None => self.offer_read_off(bridge::from_tensor(tensor, path, None)),
        };
    }
}

/// The most tensors a sender puts in one pipelined exchange.
const BATCH: usize = 16;

/// What has arrived for a sender, up to [`BATCH`] tensors and, past the first, `held_cap`
/// bytes of window room: waits for the first, takes the rest only if already there; `None`
/// once the walk is done and everything was taken.
pub(crate) fn next_batch(arrived: &Receiver<Outgoing>, held_cap: u64) -> Option<Vec<Outgoing>> {
    let first = arrived.recv().ok()?;
    let mut held = first.held;
    let mut batch = vec![first];
    while batch.len() < BATCH && held < held_cap {
        match arrived.try_recv() {
            Ok(more) => {
                held = held.saturating_add(more.held);
                batch.push(more);
            }
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Puts `batch` over `client` in one pipelined exchange: the paths stored, in order, or the
/// first failure (a parameter that could not be read off, a name, a refusal, the connection).
/// Those before a parameter that could not be read off still go, so that its error is the one
/// met first.
pub(crate) fn put_batch(
    client: &mut BlockingClient,
    sending: &Sending<'_>,
    batch: Vec<Outgoing>,
) -> Result<Vec<String>, StoreError> {
    let mut paths = Vec::with_capacity(batch.len());
    let mut keys = Vec::with_capacity(batch.len());
    let mut outbound = Vec::with_capacity(batch.len());
    let mut unread = None;
    for Outgoing { path, data, .. } in batch {
        match data.and_then(|data| Ok((sending.key(&path)?, data))) {
            Ok((key, data)) => {
                paths.push(path);
                keys.push(key);
                outbound.push(data);
            }
            Err(e) => {
                unread = Some(e);
                break;
            }
        }
    }
    let tensors: Vec<_> = keys
        .into_iter()
        .zip(outbound.iter().map(Outbound::parts))
        .collect();
    if !tensors.is_empty() {
        for answer in client.put_batch(&tensors).wait()? {
            answer?;
        }
    }
    match unread {
        Some(e) => Err(e),
        None => Ok(paths),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::mpsc::channel;

    use burn_core as burn;
    use burn_core::module::{Module, Param, ParamId};
    use burn_core::tensor::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
    use burn_core::tensor::{Device, Tensor, TensorData};
    use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
    use burn_flex::Flex;
    use burn_nn::{Linear, LinearConfig};
    use burn_store::PathFilter;

    use super::{Deal, Outbound, Outgoing};
    use crate::store::collect_walk::CollectWalk;
    use crate::store::window::Window;

    #[derive(Module, Debug)]
    struct Layers {
        left: Linear,
        right: Linear,
        transposed: Param<Tensor<2>>,
        quantized: Param<Tensor<2>>,
    }

    fn layers(device: &Device) -> Layers {
        let values = TensorData::new((0..12).map(|i| i as f32).collect::<Vec<_>>(), [3, 4]);
        Layers {
            left: LinearConfig::new(4, 3).init(device),
            right: LinearConfig::new(4, 3).init(device),
            transposed: Param::initialized(
                ParamId::new(),
                Tensor::from_data(values.clone(), device).transpose(),
            ),
            quantized: Param::initialized(
                ParamId::new(),
                Tensor::from_data(values, device).quantize_dynamic(
                    &QuantScheme::default()
                        .with_value(QuantValue::Q8S)
                        .with_store(QuantStore::Native)
                        .per_block([2], ScaleDtype::F32),
                ),
            ),
        }
    }

    /// What one walk deals (over one sender), by path.
    fn walk(module: &Layers, filter: Option<&PathFilter>) -> BTreeMap<String, Outgoing> {
        let window = Window::new(1 << 20);
        let (sender, arrived) = channel();
        let mut deal = Deal::new(vec![sender], &window);
        module.visit(&mut CollectWalk::new(&mut deal, filter));
        drop(deal);
        arrived.into_iter().map(|o| (o.path.clone(), o)).collect()
    }

    /// Where a float tensor's Flex buffer lies.
    fn buffer_of(tensor: Tensor<2>) -> usize {
        let backend = <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(
            tensor.into_dispatch(),
        )
        .expect("a Flex tensor");
        let BackendTensor::Float(flex) = backend else {
            panic!("a float tensor");
        };
        flex.bytes().as_ptr() as usize
    }

    /// A plain Flex parameter goes from its own buffer and holds no room, a quantized one holds
    /// room for its scale bytes only; a view is read off within the window; a parameter the filter leaves out is never touched, so a lazy one
    /// stays uninitialized.
    #[test]
    fn a_walk_shares_plain_flex_parameters_and_leaves_filtered_ones_untouched() {
        let device = Device::flex();
        let module = layers(&device);
        let dealt = walk(&module, None);
        let paths: Vec<&str> = dealt.keys().map(String::as_str).collect();
        assert_eq!(
            paths,
            [
                "left.bias",
                "left.weight",
                "quantized",
                "right.bias",
                "right.weight",
                "transposed"
            ]
        );
        let weight = &dealt["left.weight"];
        assert_eq!(weight.held, 0, "shared, no room held");
        let Ok(Outbound::Shared(shared)) = &weight.data else {
            panic!("a plain Flex parameter is shared");
        };
        assert_eq!(
            shared.values.as_ptr() as usize,
            buffer_of(module.left.weight.val()),
            "the parameter's own buffer"
        );
        // A quantized parameter's values are shared; its scale bytes, encoded for the send,
        // hold their room.
        let quantized = &dealt["quantized"];
        let Ok(Outbound::Shared(shared)) = &quantized.data else {
            panic!("a Q8S parameter is shared");
        };
        assert!(!shared.tail.is_empty());
        assert_eq!(quantized.held, shared.tail.len() as u64);
        let transposed = &dealt["transposed"];
        assert_eq!(
            transposed.held,
            12 * 4,
            "a view is a copy, within the window"
        );
        let Ok(Outbound::Copy(copy)) = &transposed.data else {
            panic!("a view is read off");
        };
        assert!(copy.as_bytes() == module.transposed.val().into_data().as_bytes());

        let lazy = layers(&device);
        assert!(!lazy.right.weight.is_initialized());
        let only_left = PathFilter::new().with_regex(r"^left\.");
        let dealt = walk(&lazy, Some(&only_left));
        let paths: Vec<&str> = dealt.keys().map(String::as_str).collect();
        assert_eq!(paths, ["left.bias", "left.weight"]);
        assert!(
            !lazy.right.weight.is_initialized()
                && !lazy.right.bias.as_ref().expect("bias").is_initialized(),
            "a parameter the filter leaves out stays as it was"
        );
    }
}
