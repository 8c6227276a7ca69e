use ferry::client::{Client, NodeCopy, copy_between};
use ferry::proto::{DType, TensorKey};
use ferry::samples;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (a, b, n) = (&args[1], &args[2], args[3].parse::<usize>().unwrap());
    let data = samples::plain(DType::F32, &[8192, 8192], 1);
    let mut sa = Client::connect(a.as_str(), None).await.unwrap();
    let mut sb = Client::connect(b.as_str(), None).await.unwrap();
    sa.put(0, "w", &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let how = NodeCopy { source_addr: a, dst_device: 0, dst_name: None, remove_source: false, overwrite: false };
    let mut times = vec![];
    for _ in 0..n {
        let t = std::time::Instant::now();
        copy_between(&mut sa, &mut sb, std::slice::from_ref(&key), &how).await.unwrap()[0].as_ref().unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
        loop { if sb.stat().await.unwrap().hashes_pending == 0 { break; } tokio::time::sleep(std::time::Duration::from_millis(1)).await; }
        sb.delete(&key).await.unwrap();
    }
    let mut sorted = times.clone(); sorted.sort_by(f64::total_cmp);
    println!("median {:.1} ms min {:.1} all {:?}", sorted[n / 2], sorted[0], times.iter().map(|t| *t as u32).collect::<Vec<_>>());
}
