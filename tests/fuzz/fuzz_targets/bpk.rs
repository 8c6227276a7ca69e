//! `.bpk` import on arbitrary files: every tensor read back is consistent with the byte-length
//! rule, or the file is refused with a typed error; nothing panics.
#![no_main]

use std::io::Write;

use ferry_files::read_tensors;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(mut file) = tempfile::Builder::new().suffix(".bpk").tempfile() else {
        return;
    };
    if file.write_all(data).is_err() || file.flush().is_err() {
        return;
    }
    if let Ok(tensors) = read_tensors(file.path()) {
        for (name, tensor) in &tensors {
            let meta = ferry_proto::tensor::meta_of(tensor)
                .unwrap_or_else(|e| panic!("{name}: imported but inconsistent: {e}"));
            assert_eq!(meta.byte_len(), tensor.as_bytes().len(), "{name}");
        }
    }
});
