//! The frame decoder on arbitrary bytes: check-then-parse never panics, never takes more than it
//! reports, and every frame it yields decodes (or is refused with a typed error) as a control
//! message, a chunk or a region.
#![no_main]

use bytes::BytesMut;
use ferry_proto::frame::{self, FrameKind, RegionDescriptor};
use ferry_proto::control;
use libfuzzer_sys::fuzz_target;

const MAX_BODY: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    loop {
        let before = buf.len();
        let checked = frame::check(&buf, MAX_BODY);
        match frame::parse(&mut buf, MAX_BODY) {
            Ok(Some(frame)) => {
                let (_, total) = checked.expect("check agreed").expect("check saw a frame");
                assert_eq!(before - buf.len(), total, "parse took what check reported");
                match frame.kind {
                    FrameKind::Control => {
                        let _ = control::decode_request(&frame.body);
                        let _ = control::decode_response(&frame.body);
                    }
                    FrameKind::Chunk => {
                        let _ = frame.into_chunk();
                    }
                    FrameKind::Region => {
                        let _ = RegionDescriptor::decode(&frame.body);
                    }
                }
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "an incomplete frame consumes nothing");
                break;
            }
            Err(_) => break,
        }
    }
    // Control bodies are also fed to the decoders directly, without a frame around them.
    let _ = control::decode_request(data);
    let _ = control::decode_response(data);
});
