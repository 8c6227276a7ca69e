//! A registered Flex tensor as `TensorData` that shares its buffer: what a model applied from
//! an embedded node is built from, so that its parameters read the node's own bytes (a write
//! by the model copies them first; the node's stay as they are).

use std::sync::Arc;

use burn_core::tensor::{AllocationProperty, Bytes, TensorData};
use burn_flex::{Flex, FlexTensor};
use ferry_backend::Primitive;
use ferry_server::NodeError;

/// The node's buffer, kept alive by the data built over it.
struct NodeBuffer(Arc<Bytes>);

impl AsRef<[u8]> for NodeBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// `primitive`'s bytes as `into_data` would give them. A plain, contiguous tensor that spans its
/// whole buffer shares that buffer (copy-on-write: a `Bytes` over shared memory copies before
/// its first write); anything else (a view, a quantized tensor, whose values and scales
/// `into_data` joins) is read out as a copy.
pub(crate) fn shared_data(primitive: Primitive<Flex>) -> Result<TensorData, NodeError> {
    let flex = match &primitive {
        Primitive::Float(t) | Primitive::Int(t) | Primitive::Bool(t) => Some(t),
        Primitive::Quantized(_) => None,
    };
    if let Some(flex) = flex.filter(|t| spans_its_buffer(t)) {
        let shape = flex.layout().shape().clone();
        let bytes = Bytes::from_shared(
            bytes::Bytes::from_owner(NodeBuffer(flex.data_arc())),
            AllocationProperty::Other,
        );
        return Ok(TensorData::from_bytes(bytes, shape, flex.dtype()));
    }
    Ok(primitive.to_data()?)
}

/// Whether `tensor`'s elements are its whole buffer, in order.
fn spans_its_buffer(tensor: &FlexTensor) -> bool {
    let layout = tensor.layout();
    let Some(len) = layout.num_elements().checked_mul(tensor.dtype().size()) else {
        return false;
    };
    layout.is_contiguous() && layout.start_offset() == 0 && tensor.bytes().len() == len
}
