//! Counters, gauges and histograms, rendered in the Prometheus text format at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// A fixed-bucket histogram (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Default)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, inner: Mutex::new(HistInner { counts: vec![0; bounds.len()], sum: 0.0, count: 0 }) }
    }

    pub fn observe(&self, v: f64) {
        let mut h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += v;
        h.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&h.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5,
];
const E2E_BUCKETS: &[f64] =
    &[0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0];

pub struct Metrics {
    /// HTTP responses by (endpoint, status code).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Finished sequences by finish reason (stop, length, abort, error).
    finished: Mutex<BTreeMap<String, u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_used: AtomicUsize,
    pub kv_free: AtomicUsize,
    pub preemptions: AtomicUsize,
    /// Requests refused with 429 because the queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Speculative decoding's counters, as the engine last published them.
    pub spec: Mutex<crate::engine::SpecStats>,
    /// Prefix caching's counters (vLLM's `prefix_cache_queries` / `prefix_cache_hits`), as the
    /// engine last published them.
    pub prefix: Mutex<crate::engine::PrefixStats>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            finished: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            kv_used: AtomicUsize::new(0),
            kv_free: AtomicUsize::new(0),
            preemptions: AtomicUsize::new(0),
            rejected_queue_full: AtomicU64::new(0),
            spec: Mutex::new(crate::engine::SpecStats::default()),
            prefix: Mutex::new(crate::engine::PrefixStats::default()),
        }
    }

    pub fn record_request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn record_finish(&self, reason: &str) {
        let mut m = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(reason.to_string()).or_default() += 1;
    }

    /// The Prometheus text exposition (version 0.0.4).
    pub fn render(&self, model: &str, kv_total: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP iris_model_info The served model.\n# TYPE iris_model_info gauge");
        let _ = writeln!(out, "iris_model_info{{model_name=\"{}\"}} 1", escape(model));
        {
            let m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(
                out,
                "# HELP iris_http_requests_total HTTP requests by endpoint and status code.\n# TYPE iris_http_requests_total counter"
            );
            for ((ep, status), n) in m.iter() {
                let _ =
                    writeln!(out, "iris_http_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}", escape(ep));
            }
        }
        {
            let m = self.finished.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(
                out,
                "# HELP iris_request_success_total Finished sequences by finish reason.\n# TYPE iris_request_success_total counter"
            );
            for (reason, n) in m.iter() {
                let _ = writeln!(out, "iris_request_success_total{{finished_reason=\"{}\"}} {n}", escape(reason));
            }
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "iris_prompt_tokens_total",
            "Prompt tokens of finished sequences.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "iris_generation_tokens_total",
            "Generated tokens.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "iris_queue_full_rejections_total",
            "Requests refused with 429 because the queue was full.",
            self.rejected_queue_full.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "iris_num_preemptions_total",
            "Sequences preempted because KV blocks ran out.",
            self.preemptions.load(Ordering::Relaxed) as u64,
        );
        {
            let prefix = *self.prefix.lock().unwrap_or_else(|p| p.into_inner());
            counter(
                &mut out,
                "iris_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache when their sequence started.",
                prefix.queries,
            );
            counter(
                &mut out,
                "iris_prefix_cache_hits_total",
                "Of those, tokens found in the prefix cache (not computed).",
                prefix.hits,
            );
        }
        {
            let spec = self.spec.lock().unwrap_or_else(|p| p.into_inner()).clone();
            counter(
                &mut out,
                "iris_spec_decode_num_drafts_total",
                "Verify passes: sequences whose step checked draft tokens.",
                spec.num_drafts,
            );
            counter(
                &mut out,
                "iris_spec_decode_num_draft_tokens_total",
                "Draft tokens verified.",
                spec.num_draft_tokens,
            );
            counter(
                &mut out,
                "iris_spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                spec.num_accepted_tokens,
            );
            let _ = writeln!(
                out,
                "# HELP iris_spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by their place in the draft.\n# TYPE iris_spec_decode_num_accepted_tokens_per_pos_total counter"
            );
            for (pos, n) in spec.accepted_per_position.iter().enumerate() {
                let _ = writeln!(out, "iris_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{pos}\"}} {n}");
            }
        }
        gauge(
            &mut out,
            "iris_num_requests_running",
            "Sequences running in the engine.",
            self.running.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "iris_num_requests_waiting",
            "Sequences waiting for a slot.",
            self.waiting.load(Ordering::Relaxed),
        );
        gauge(&mut out, "iris_kv_cache_blocks_used", "KV cache blocks in use.", self.kv_used.load(Ordering::Relaxed));
        gauge(&mut out, "iris_kv_cache_blocks_free", "KV cache blocks free.", self.kv_free.load(Ordering::Relaxed));
        gauge(&mut out, "iris_kv_cache_blocks_total", "KV cache blocks in the pool.", kv_total);
        let used = self.kv_used.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP iris_kv_cache_usage_perc Fraction of KV blocks in use.\n# TYPE iris_kv_cache_usage_perc gauge\niris_kv_cache_usage_perc {}",
            if kv_total == 0 { 0.0 } else { used as f64 / kv_total as f64 }
        );
        self.ttft.render(&mut out, "iris_time_to_first_token_seconds", "Time from arrival to the first token.");
        self.itl.render(&mut out, "iris_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.");
        self.e2e.render(&mut out, "iris_e2e_request_latency_seconds", "Time from arrival to the last token.");
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
