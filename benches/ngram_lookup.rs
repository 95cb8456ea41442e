//! The n-gram drafter's lookup per decoding sequence and step, by sequence length: random
//! tokens over a 50k vocabulary (almost no match, so the whole sequence is searched: the worst
//! case), lookup 2..=4, 4 drafts.
//!
//!   cargo bench --bench ngram_lookup
use std::time::Instant;
fn main() {
    let cfg: iris::engine::speculative::SpeculativeConfig =
        r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#.parse().unwrap();
    let d = iris::engine::speculative::NgramDrafter::new(cfg);
    for len in [1024usize, 8192, 32768, 131072] {
        let mut x: u32 = 12345;
        let toks: Vec<u32> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x % 50000
            })
            .collect();
        let n = 200;
        let t = Instant::now();
        let mut got = 0;
        for _ in 0..n {
            got += std::hint::black_box(d.propose(&toks, 4)).len();
        }
        println!("len {len}: {:.1} us per propose (drafts {got})", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
}
