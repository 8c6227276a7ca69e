//! Writes a small quantized model file to try the CLI with: `cargo run -p ferry-cli --example make_model -- model.bpk`.
//!
//! Plain and quantized tensors (Q8S per-tensor, Q4S per-block [32] with UE8M0 scales, E2M1 with
//! two-level scales), quantized by Burn's own Flex backend; `.safetensors` works for a path
//! ending so, with the quantized tensors left out.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use ferry_files::{FileFormat, write_tensors};
use ferry_proto::{DType, TensorData};
use ferry_testkit::samples;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "model.bpk".to_string()),
    );
    let mut tensors: Vec<(String, TensorData)> = vec![
        (
            "embed.weight".into(),
            samples::plain(DType::F32, &[256, 64], 1),
        ),
        ("embed.norm".into(), samples::plain(DType::BF16, &[64], 2)),
        ("positions".into(), samples::plain(DType::I64, &[256], 3)),
    ];
    if FileFormat::from_path(&path)? == FileFormat::Burnpack {
        for (i, (label, scheme)) in samples::schemes().into_iter().enumerate() {
            if [
                "Q8S-tensor-F32",
                "Q4S-block32-UE8M0",
                "E2M1-block16-UE4M3+tensor-F32",
            ]
            .contains(&label.as_str())
            {
                tensors.push((
                    format!("layers.{i}.{label}"),
                    samples::quantized(&scheme, &[64, 64], i as u64),
                ));
            }
        }
    }
    write_tensors(&path, &tensors)?;
    println!("wrote {} tensors to {}", tensors.len(), path.display());
    Ok(())
}
