//! The Burn backends a device can be, what each can hold, and the calls into them.
//!
//! Burn's backends fail by panicking: every call into one is contained ([`contain`]) into a
//! [`BackendError`]. What a device stores bit-exact is measured by the device itself
//! ([`HoldsTable`]) and consulted before any byte moves.

use std::fmt;
use std::str::FromStr;

use burn_backend::quantization::QuantStore;
use burn_backend::{Backend, DType, TensorData, TensorMetadata, read_sync};
use ferry_proto::dtype_name;

use crate::gpu::GpuSpec;
use crate::holds::HoldsTable;

/// A backend a node can host a device of.
///
/// Not `#[non_exhaustive]`, on purpose: what a device holds bit-exact, which transfers go native
/// and whether its registered bytes are lent without a copy all depend on the backend, so code
/// that matches on it (tables per backend, as `tests/it/holds.rs` keeps) must be looked at
/// again, not pass a wildcard, when a backend is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// burn-flex, the pure-Rust CPU backend (the default).
    Flex,
    /// burn-ndarray, the second CPU backend.
    NdArray,
    /// burn-cubecl on the wgpu runtime (burn-wgpu): GPUs through Vulkan or OpenGL.
    Wgpu,
}

impl BackendKind {
    /// Whether a registered tensor of `dtype` on this backend can be read without a copy (what
    /// [`Primitive::shared_host_bytes`] gives): Flex, for plain dtypes and for quantized ones of
    /// one scale level stored one value per byte.
    pub fn shares_registered_bytes(self, dtype: &DType) -> bool {
        use burn_backend::quantization::global_scale_dtype;
        self == BackendKind::Flex
            && match dtype {
                DType::QFloat(scheme) => {
                    scheme.store == QuantStore::Native && global_scale_dtype(scheme).is_none()
                }
                _ => true,
            }
    }

    /// The name used in `--device` and in `stat`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Flex => "flex",
            BackendKind::NdArray => "ndarray",
            BackendKind::Wgpu => "wgpu",
        }
    }

    /// What a device of this CPU backend stores bit-exact, as measured by a probe of its
    /// default device (once per process; see [`HoldsTable`]); `None` for a GPU backend, whose
    /// table depends on its adapter (measured as the device opens).
    pub fn measured_holds(self) -> Option<std::sync::Arc<HoldsTable>> {
        let measure = match self {
            BackendKind::Flex => || HoldsTable::measure::<burn_flex::Flex>(&Default::default()),
            #[allow(deprecated)]
            BackendKind::NdArray => {
                || HoldsTable::measure::<burn_ndarray::NdArray>(&Default::default())
            }
            BackendKind::Wgpu => return None,
        };
        Some(HoldsTable::cached(self.name(), measure))
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A device to host, as given on the command line: `flex` (or `cpu`), `ndarray`, or a GPU
/// (`wgpu:0`, `vulkan:cpu`, `gl:default`...: see [`GpuSpec`]).
///
/// Not `#[non_exhaustive]`, on purpose, as [`BackendKind`] (one variant per backend): the node,
/// in another crate, opens each with an exhaustive match, which a new backend must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// burn-flex's device.
    Flex,
    /// burn-ndarray's device.
    NdArray,
    /// A GPU on burn-cubecl's wgpu runtime.
    Wgpu(GpuSpec),
}

impl DeviceSpec {
    /// Its backend.
    pub fn kind(&self) -> BackendKind {
        match self {
            DeviceSpec::Flex => BackendKind::Flex,
            DeviceSpec::NdArray => BackendKind::NdArray,
            DeviceSpec::Wgpu(_) => BackendKind::Wgpu,
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "flex" | "cpu" => Ok(DeviceSpec::Flex),
            "ndarray" => Ok(DeviceSpec::NdArray),
            other if other.starts_with("cuda") => Err(format!(
                "device {other:?}: this build has no CUDA runtime (burn-cuda's build downloads \
                 LLVM, which these machines cannot reach); wgpu devices are hosted: wgpu:N, \
                 vulkan:N, gl:N"
            )),
            other => match GpuSpec::parse(other) {
                Some(gpu) => gpu.map(DeviceSpec::Wgpu),
                None => Err(format!(
                    "unknown device {other:?}: expected flex, ndarray, or a GPU: wgpu:N (the N-th \
                     discrete GPU), wgpu:cpu (a software adapter), wgpu:default, or the same \
                     with vulkan or gl in place of wgpu"
                )),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Wgpu(gpu) => gpu.fmt(f),
            other => f.write_str(other.kind().name()),
        }
    }
}

/// A registered tensor's payload as its backend keeps it: a shared buffer, then (for a quantized
/// tensor) the scale bytes that follow it on the wire. (What a node knows beside it, the region
/// the bytes arrived in and their chunk checksums, its worker keeps.)
#[derive(Debug)]
pub struct SharedPayload {
    /// The buffer, shared with the tensor (nothing writes to a buffer that is shared).
    pub values: std::sync::Arc<burn_backend::Bytes>,
    /// What follows it: a quantized tensor's scales as `into_data` lays them out; else empty.
    pub tail: Vec<u8>,
    /// The dtype the payload is of.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<usize>,
}

impl SharedPayload {
    /// The payload's length in bytes.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.values.len() + self.tail.len()
    }
}

/// A Flex tensor's buffer and shape, where the buffer is exactly the contiguous tensor from its
/// start (the conditions under which Flex's own `into_data` hands the buffer over as is).
fn whole_buffer(
    flex: &burn_flex::FlexTensor,
) -> Option<(std::sync::Arc<burn_backend::Bytes>, Vec<usize>)> {
    let layout = flex.layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        return None;
    }
    let shape = layout.shape().as_slice().to_vec();
    let expected = shape
        .iter()
        .try_fold(flex.dtype().size(), |acc, &d| acc.checked_mul(d))?;
    (flex.bytes().len() == expected).then(|| (flex.data_arc(), shape))
}

/// A Flex quantized tensor's payload without copying its values: Flex keeps the values as one
/// i8 per element and the scales as `f32`s, and `into_data` writes the values followed by the
/// scales encoded in the scheme's scale dtype. The scale bytes are made by Burn's own encoder
/// (`QuantizedBytes` on a one-value tensor), so their layout is Burn's by construction. A
/// two-level scheme is left to `into_data`: Flex does not expose its per-tensor scale.
fn flex_quantized_payload(q: &dyn std::any::Any) -> Option<SharedPayload> {
    use burn_backend::TensorMetadata;
    use burn_backend::quantization::{QuantizedBytes, global_scale_dtype};
    let q = q.downcast_ref::<burn_flex::FlexQTensor>()?;
    let DType::QFloat(scheme) = TensorMetadata::dtype(q) else {
        return None;
    };
    if scheme.store != QuantStore::Native || global_scale_dtype(&scheme).is_some() {
        return None;
    }
    let (values, shape) = whole_buffer(q.tensor())?;
    let scales = q.scales().to_vec();
    let encoded = contain("encoding scales", move || {
        QuantizedBytes::new(vec![0i8], [1], scheme, &scales, None).bytes
    })
    .ok()?;
    let tail = encoded.get(1..)?.to_vec();
    let payload = SharedPayload {
        values,
        tail,
        dtype: DType::QFloat(scheme),
        shape,
    };
    // Only where the result is exactly what the byte-length rule says `into_data` gives.
    let expected = ferry_proto::meta::expected_byte_len(&payload.shape, &payload.dtype).ok()?;
    (payload.len() == expected).then_some(payload)
}

/// Whether `B` is Flex and `dtype` a quantized dtype of one scale level with one `i8` per value
/// ([`flex_quantized_from_data`] builds those).
fn is_flex_quantized<B: Backend>(dtype: &DType) -> bool {
    use burn_backend::quantization::global_scale_dtype;
    let is_flex = std::any::TypeId::of::<B::QuantizedTensorPrimitive>()
        == std::any::TypeId::of::<burn_flex::FlexQTensor>();
    matches!(dtype, DType::QFloat(scheme)
        if is_flex && scheme.store == QuantStore::Native && global_scale_dtype(scheme).is_none())
}

/// Flex's own `q_from_data` copies the values out of any buffer it cannot take over as a `Vec`,
/// such as a shared-memory mapping: twice the tensor in memory, and the region could not be
/// kept. For a scheme of one scale level and one `i8` per value, the same tensor is built here
/// over the payload's own memory instead: the values are the payload's first bytes (shared, not
/// copied), the scales are decoded by Burn's own decoder from the bytes after them, exactly as
/// `q_from_data` decodes them.
fn flex_quantized_from_data(data: TensorData) -> Result<burn_flex::FlexQTensor, BackendError> {
    use burn_backend::SplitPolicy;
    use burn_backend::quantization::QuantizedBytes;
    let (bytes, shape, dtype) = data.into_parts();
    let DType::QFloat(scheme) = dtype else {
        return Err(BackendError(format!("{dtype:?} is not quantized")));
    };
    let values_len = shape.num_elements();
    let scales = bytes
        .get(values_len..)
        .ok_or_else(|| BackendError("a quantized payload shorter than its values".into()))?
        .to_vec();
    // A buffer from the global allocator becomes the values as it is (as `q_from_data` would
    // take it over); any other (a mapping) is shared between values and scales, not copied.
    let values = match bytes.try_into_vec::<i8>() {
        Ok(mut values) => {
            values.truncate(values_len);
            burn_backend::Bytes::from_elems(values)
        }
        Err(bytes) => {
            bytes
                .split(values_len, SplitPolicy::Shared)
                .map_err(|(_, e)| BackendError(format!("splitting off the scales: {e:?}")))?
                .0
        }
    };
    let scales_shape = shape.clone();
    // Only the scale bytes go to the decoder: it peels the scales off the end and reads
    // whatever precedes them (the alignment padding here) as values it then drops.
    let decoded = contain("decoding scales", move || {
        QuantizedBytes {
            bytes: burn_backend::Bytes::from_bytes_vec(scales),
            scheme,
            shape: scales_shape,
        }
        .into_vec_i8()
        .1
    })?;
    contain("building the quantized tensor", move || {
        let values = TensorData::from_bytes(values, shape, DType::I8);
        burn_flex::FlexQTensor::new(
            burn_flex::FlexTensor::from_data(values),
            scheme,
            decoded.block,
            decoded.global,
        )
    })
}

/// A tensor on a backend, of whichever kind its dtype calls for.
///
/// Exhaustive on purpose: one variant per tensor primitive of Burn's `Backend` trait, which
/// every function of a primitive must handle; another would come only with another Burn.
pub enum Primitive<B: Backend> {
    /// F64, F32, Flex32, F16, BF16.
    Float(B::FloatTensorPrimitive),
    /// Signed and unsigned integers.
    Int(B::IntTensorPrimitive),
    /// Booleans of every store.
    Bool(B::BoolTensorPrimitive),
    /// Quantized values with their scales.
    Quantized(B::QuantizedTensorPrimitive),
}

impl<B: Backend> Clone for Primitive<B> {
    fn clone(&self) -> Self {
        match self {
            Primitive::Float(t) => Primitive::Float(t.clone()),
            Primitive::Int(t) => Primitive::Int(t.clone()),
            Primitive::Bool(t) => Primitive::Bool(t.clone()),
            Primitive::Quantized(t) => Primitive::Quantized(t.clone()),
        }
    }
}

/// A backend call that failed or panicked: what was asked and what the backend said, for a
/// person. (ferry-server answers it as its `NodeError::Backend`.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

/// Runs a backend call, turning a panic into an error so that one bad tensor never takes a
/// device worker (or the node, or the program) down.
pub(crate) fn contain<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, BackendError> {
    ferry_proto::contained(f)
        .map_err(|panic| BackendError(format!("{what}: backend panicked: {panic}")))
}

impl<B: Backend> Primitive<B> {
    /// The dtype and shape Burn gives the tensor.
    pub fn dtype_and_shape(&self) -> (DType, Vec<usize>) {
        let (dtype, shape) = match self {
            Primitive::Float(t) => (t.dtype(), t.shape()),
            Primitive::Int(t) => (t.dtype(), t.shape()),
            Primitive::Bool(t) => (t.dtype(), t.shape()),
            Primitive::Quantized(t) => (t.dtype(), t.shape()),
        };
        (dtype, shape.as_slice().to_vec())
    }

    /// Whether the variant is the one its dtype calls for (Flex's float, int and bool tensors are
    /// one type, so a caller could wrap one in another's variant).
    pub fn variant_fits_dtype(&self) -> bool {
        let (dtype, _) = self.dtype_and_shape();
        match self {
            Primitive::Float(_) => dtype.is_float(),
            Primitive::Int(_) => dtype.is_int() || dtype.is_uint(),
            Primitive::Bool(_) => matches!(dtype, DType::Bool(_)),
            Primitive::Quantized(_) => matches!(dtype, DType::QFloat(_)),
        }
    }

    /// The host bytes the tensor keeps alive, where the backend says (Flex): a view (a slice, a
    /// narrow) keeps its whole parent buffer, more than its own payload.
    pub fn held_host_bytes(&self) -> Option<u64> {
        let any: &dyn std::any::Any = match self {
            Primitive::Float(t) => t,
            Primitive::Int(t) => t,
            Primitive::Bool(t) => t,
            Primitive::Quantized(q) => {
                let q: &dyn std::any::Any = q;
                let q = q.downcast_ref::<burn_flex::FlexQTensor>()?;
                let scales = std::mem::size_of_val(q.scales()) as u64;
                return Some(q.tensor().bytes().len() as u64 + scales);
            }
        };
        let flex = any.downcast_ref::<burn_flex::FlexTensor>()?;
        Some(flex.bytes().len() as u64)
    }

    /// Builds the tensor on `device`. The caller has validated `data` against the byte-length
    /// rule and checked the device's [`HoldsTable`].
    pub fn from_data(data: TensorData, device: &B::Device) -> Result<Self, BackendError> {
        let dtype = data.dtype();
        if is_flex_quantized::<B>(&dtype) {
            let flex = flex_quantized_from_data(data)?;
            let boxed: Box<dyn std::any::Any> = Box::new(flex);
            return boxed
                .downcast::<B::QuantizedTensorPrimitive>()
                .map(|q| Primitive::Quantized(*q))
                .map_err(|_| BackendError("a Flex tensor for another backend".into()));
        }
        contain(
            &format!("from_data({})", dtype_name(&dtype)),
            || match dtype {
                DType::QFloat(_) => Primitive::Quantized(B::q_from_data(data, device)),
                DType::Bool(_) => Primitive::Bool(B::bool_from_data(data, device)),
                d if d.is_float() => Primitive::Float(B::float_from_data(data, device)),
                _ => Primitive::Int(B::int_from_data(data, device)),
            },
        )
    }

    /// The tensor's bytes exactly as `into_data` would return them, shared instead of copied,
    /// where the backend already keeps them in host memory in that layout: Flex, contiguous,
    /// plain dtypes (one buffer), and quantized tensors of one scale level (the values buffer,
    /// then the few scale bytes `into_data` would append). A source serving a download or a pull
    /// then sends straight from the registered tensor: no host copy of the tensor at all. `None`
    /// means: take [`to_data`](Self::to_data).
    pub fn shared_host_bytes(&self) -> Option<SharedPayload> {
        let any: &dyn std::any::Any = match self {
            Primitive::Float(t) => t,
            Primitive::Int(t) => t,
            Primitive::Bool(t) => t,
            Primitive::Quantized(q) => return flex_quantized_payload(q),
        };
        let flex = any.downcast_ref::<burn_flex::FlexTensor>()?;
        let (values, shape) = whole_buffer(flex)?;
        Some(SharedPayload {
            values,
            tail: Vec::new(),
            dtype: flex.dtype(),
            shape,
        })
    }

    /// Reads the tensor back to host bytes; the tensor itself stays where it is.
    pub fn to_data(&self) -> Result<TensorData, BackendError> {
        let this = self.clone();
        contain("into_data", move || match this {
            Primitive::Float(t) => read_sync(B::float_into_data(t)),
            Primitive::Int(t) => read_sync(B::int_into_data(t)),
            Primitive::Bool(t) => read_sync(B::bool_into_data(t)),
            Primitive::Quantized(t) => read_sync(B::q_into_data(t)),
        })?
        .map_err(|e| BackendError(format!("into_data failed: {e:?}")))
    }

    /// Asks the device whether the tensor's memory was allocated and written: a GPU runtime
    /// (cubecl) defers a failed allocation to the first read of the buffer, so a `from_data`
    /// that returned is not yet a tensor the device holds. Host backends fail (or panic) at
    /// the call itself: nothing to ask.
    pub fn confirm_written(&self) -> Result<(), BackendError> {
        let any: &dyn std::any::Any = match self {
            Primitive::Float(t) => t,
            Primitive::Int(t) => t,
            Primitive::Bool(t) => t,
            Primitive::Quantized(q) => q,
        };
        #[cfg(feature = "wgpu")]
        if let Some(written) = contain("sync", || crate::gpu::confirm_written(any))? {
            return written.map_err(|e| {
                BackendError(format!("the device did not take the tensor's bytes: {e}"))
            });
        }
        let _ = any;
        Ok(())
    }

    /// Moves the tensor to `device` with the backend's own `*_to_device` (the native path).
    pub fn to_device(self, device: &B::Device) -> Result<Self, BackendError> {
        contain("to_device", move || match self {
            Primitive::Float(t) => Primitive::Float(B::float_to_device(t, device)),
            Primitive::Int(t) => Primitive::Int(B::int_to_device(t, device)),
            Primitive::Bool(t) => Primitive::Bool(B::bool_to_device(t, device)),
            Primitive::Quantized(t) => Primitive::Quantized(B::q_to_device(t, device)),
        })
    }
}
