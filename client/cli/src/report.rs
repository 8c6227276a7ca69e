//! How results are printed: one `error:` line per failed tensor, dtypes by name.

use anyhow::bail;
use ferry_client::TensorInfo;
use ferry_proto::{DType, dtype_name};

pub(crate) fn check_all(
    results: Vec<(String, Result<TensorInfo, ferry_client::ClientError>)>,
) -> anyhow::Result<()> {
    let mut failed = 0;
    for (name, result) in &results {
        if let Err(e) = result {
            eprintln!("error: {name}: {e}");
            failed += 1;
        }
    }
    if failed > 0 {
        bail!("{failed} of {} tensors failed", results.len());
    }
    Ok(())
}

pub(crate) fn dtype_text(info: &TensorInfo) -> String {
    DType::try_from(&info.dtype)
        .map(|d| dtype_name(&d))
        .unwrap_or_else(|_| format!("unknown({})", info.dtype.tag))
}
