//! Counters for `GET /metrics`, in the Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use sluice_backend::ExpertCacheStats;
use sluice_store::StoreStats;

/// Updated by the handlers and the model thread; read by `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub requests_chat: AtomicU64,
    pub requests_completion: AtomicU64,
    /// Requests answered with an error status (4xx or 5xx).
    pub requests_failed: AtomicU64,
    /// Generations stopped because their client went away.
    pub requests_cancelled: AtomicU64,
    pub requests_finished: AtomicU64,
    /// Requests waiting for the model.
    pub queue_depth: AtomicU64,
    /// Requests in the running batch now.
    pub running: AtomicU64,
    /// Batched steps run, and the requests they advanced together (their mean batch size is
    /// the ratio).
    pub batch_steps: AtomicU64,
    pub batch_rows: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prompt_tokens_cached: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Speculative decoding: checking passes, tokens drafted and kept.
    pub speculative_passes: AtomicU64,
    pub draft_tokens: AtomicU64,
    pub draft_tokens_accepted: AtomicU64,
    timing: Mutex<Timing>,
}

#[derive(Default, Clone, Copy)]
struct Timing {
    prompt_secs: f64,
    decode_secs: f64,
    /// Tokens counted in `decode_secs` (the first token of each answer is in `prompt_secs`).
    decode_tokens: u64,
    last_decode_tok_s: f64,
    last_prompt_tok_s: f64,
    /// Requests timed from the moment they were queued.
    timed: u64,
    latency_secs: f64,
    first_token_secs: f64,
    last_latency_secs: f64,
    last_first_token_secs: f64,
}

impl Metrics {
    /// Records one step of the batch, which advanced `rows` requests.
    pub fn record_step(&self, rows: usize) {
        self.batch_steps.fetch_add(1, Relaxed);
        self.batch_rows.fetch_add(rows as u64, Relaxed);
    }

    /// Records one ended generation, `latency` after it was queued.
    pub fn record(&self, stats: &sluice_engine::GenerationStats, latency: std::time::Duration) {
        self.prompt_tokens
            .fetch_add(stats.prompt_tokens as u64, Relaxed);
        self.prompt_tokens_cached
            .fetch_add(stats.cached_tokens as u64, Relaxed);
        let spec = &stats.speculation;
        self.speculative_passes
            .fetch_add(spec.passes as u64, Relaxed);
        self.draft_tokens.fetch_add(spec.drafted as u64, Relaxed);
        self.draft_tokens_accepted
            .fetch_add(spec.accepted as u64, Relaxed);
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        t.prompt_secs += stats.prompt_secs;
        t.decode_secs += stats.decode_secs;
        t.decode_tokens += stats.generated_tokens.saturating_sub(1) as u64;
        t.last_prompt_tok_s = stats.prompt_tok_per_sec();
        if stats.generated_tokens > 1 {
            t.last_decode_tok_s = stats.decode_tok_per_sec();
        }
        let latency = latency.as_secs_f64();
        // Queued until the first token: everything but the time after it.
        let first = (latency - stats.decode_secs).max(0.0);
        t.timed += 1;
        t.latency_secs += latency;
        t.first_token_secs += first;
        t.last_latency_secs = latency;
        t.last_first_token_secs = first;
    }

    /// The exposition text; `store` adds the expert cache's counters when experts stream.
    pub fn render(&self, store: Option<&StoreStats>, vram: Option<&ExpertCacheStats>) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP sluice_{name} {help}");
            let _ = writeln!(out, "# TYPE sluice_{name} {kind}");
            let _ = writeln!(out, "sluice_{name} {value}");
        };
        let get = |c: &AtomicU64| c.load(Relaxed) as f64;
        metric(
            "chat_requests_total",
            "counter",
            "POST /v1/chat/completions requests received.",
            get(&self.requests_chat),
        );
        metric(
            "completion_requests_total",
            "counter",
            "POST /v1/completions requests received.",
            get(&self.requests_completion),
        );
        metric(
            "requests_failed_total",
            "counter",
            "Requests answered with an error.",
            get(&self.requests_failed),
        );
        metric(
            "requests_cancelled_total",
            "counter",
            "Generations stopped because the client disconnected.",
            get(&self.requests_cancelled),
        );
        metric(
            "requests_finished_total",
            "counter",
            "Generations that ran to the end.",
            get(&self.requests_finished),
        );
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for the model.",
            get(&self.queue_depth),
        );
        metric(
            "requests_running",
            "gauge",
            "Requests being generated now.",
            get(&self.running),
        );
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished generations.",
            get(&self.prompt_tokens),
        );
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the prompt cache instead of recomputed.",
            get(&self.prompt_tokens_cached),
        );
        metric(
            "generated_tokens_total",
            "counter",
            "Tokens generated.",
            get(&self.generated_tokens),
        );
        metric(
            "speculative_passes_total",
            "counter",
            "Forward passes that checked drafted tokens (--speculate).",
            get(&self.speculative_passes),
        );
        metric(
            "draft_tokens_total",
            "counter",
            "Tokens drafted for checking (--speculate).",
            get(&self.draft_tokens),
        );
        metric(
            "draft_tokens_accepted_total",
            "counter",
            "Drafted tokens the model kept (their ratio to draft_tokens_total is the acceptance rate).",
            get(&self.draft_tokens_accepted),
        );
        let t = *self.timing.lock().unwrap_or_else(|e| e.into_inner());
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Generation speed over all requests (tokens after the first / their time).",
            t.decode_tokens as f64 / t.decode_secs.max(1e-9),
        );
        metric(
            "last_decode_tokens_per_second",
            "gauge",
            "Generation speed of the last request.",
            t.last_decode_tok_s,
        );
        metric(
            "last_prompt_tokens_per_second",
            "gauge",
            "Prompt processing speed of the last request (computed tokens only).",
            t.last_prompt_tok_s,
        );
        metric(
            "batch_steps_total",
            "counter",
            "Steps of the running batch (each decodes a token for every request in it).",
            get(&self.batch_steps),
        );
        metric(
            "batch_rows_total",
            "counter",
            "Requests advanced by those steps (over batch_steps_total: the mean batch size).",
            get(&self.batch_rows),
        );
        metric(
            "requests_timed_total",
            "counter",
            "Ended requests counted in the latency sums below.",
            t.timed as f64,
        );
        metric(
            "request_latency_seconds_total",
            "counter",
            "Sum over ended requests of the time from queued to the last token.",
            t.latency_secs,
        );
        metric(
            "time_to_first_token_seconds_total",
            "counter",
            "Sum over ended requests of the time from queued to the first token.",
            t.first_token_secs,
        );
        metric(
            "last_request_latency_seconds",
            "gauge",
            "Time from queued to the last token of the last ended request.",
            t.last_latency_secs,
        );
        metric(
            "last_time_to_first_token_seconds",
            "gauge",
            "Time from queued to the first token of the last ended request.",
            t.last_first_token_secs,
        );
        metric(
            "prompt_seconds_total",
            "counter",
            "Time spent on prompts, first token included.",
            t.prompt_secs,
        );
        metric(
            "decode_seconds_total",
            "counter",
            "Time spent generating after the first token.",
            t.decode_secs,
        );
        if let Some(s) = store {
            metric(
                "expert_requests_total",
                "counter",
                "Routed experts the model asked the expert cache for.",
                s.requests as f64,
            );
            metric(
                "expert_cache_hit_rate",
                "gauge",
                "Share of expert requests served without a demand read (cached or prefetched).",
                s.hit_rate(),
            );
            metric(
                "expert_read_bytes_total",
                "counter",
                "Bytes of experts read from disk.",
                s.bytes_read as f64,
            );
            metric(
                "expert_read_gbps",
                "gauge",
                "Expert read throughput while reads were in flight, GB/s.",
                s.read_gbps(),
            );
            metric(
                "expert_io_wait_seconds_total",
                "counter",
                "Time the model waited for expert reads.",
                s.io_wait_secs,
            );
            metric(
                "expert_verify_seconds_total",
                "counter",
                "Time spent comparing expert blocks read with their checksums (--verify).",
                s.verify_secs,
            );
            metric(
                "expert_read_errors_total",
                "counter",
                "Failed expert reads and checksum mismatches.",
                s.errors as f64,
            );
        }
        if let Some(v) = vram {
            metric(
                "vram_expert_hits_total",
                "counter",
                "Streamed experts found in the GPU's expert cache.",
                v.hits as f64,
            );
            metric(
                "vram_expert_uploads_total",
                "counter",
                "Streamed experts copied to the GPU (into a cache slot, for one call, or placed \
                 in a slot between calls).",
                (v.misses + v.bypassed + v.placed) as f64,
            );
            metric(
                "vram_expert_hit_rate",
                "gauge",
                "Share of streamed experts the GPU's expert cache held.",
                v.hit_rate(),
            );
            metric(
                "vram_expert_upload_bytes_total",
                "counter",
                "Bytes of experts copied to the GPU.",
                v.bytes_uploaded as f64,
            );
            metric(
                "vram_expert_upload_gbps",
                "gauge",
                "Expert copy throughput to the GPU while copying, GB/s.",
                v.upload_gbps(),
            );
            metric(
                "vram_expert_upload_seconds_total",
                "counter",
                "Time the GPU spent copying experts in.",
                v.upload_secs,
            );
            metric(
                "vram_expert_read_in_place_total",
                "counter",
                "Experts kept in host memory that the GPU read there (not held in VRAM).",
                v.read_in_place as f64,
            );
            metric(
                "vram_expert_read_in_place_bytes_total",
                "counter",
                "Bytes of experts the GPU read in host memory over its link.",
                v.bytes_read_in_place as f64,
            );
            metric(
                "vram_expert_cpu_computed_total",
                "counter",
                "Experts kept in host memory that the CPU computed beside the GPU (routed \
                 pairs).",
                v.host_computed as f64,
            );
            metric(
                "vram_expert_cpu_computed_bytes_total",
                "counter",
                "Bytes of experts the CPU read to compute them beside the GPU.",
                v.bytes_host_computed as f64,
            );
            metric(
                "vram_expert_cpu_seconds_total",
                "counter",
                "Time the CPU spent computing experts beside the GPU.",
                v.host_secs,
            );
            if let Some(share) = v.host_share {
                metric(
                    "vram_expert_cpu_share",
                    "gauge",
                    "Share of the experts held in no VRAM slot that the CPU computes now.",
                    share,
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_tier_is_rendered_only_where_there_is_one() {
        let m = Metrics::default();
        let plain = m.render(None, None);
        assert!(!plain.contains("vram"), "{plain}");
        let v = ExpertCacheStats {
            hits: 30,
            misses: 8,
            bypassed: 2,
            bytes_uploaded: 4_000_000_000,
            upload_secs: 0.1,
            read_in_place: 10,
            bytes_read_in_place: 123,
            placed: 5,
            host_computed: 10,
            bytes_host_computed: 456,
            host_secs: 0.25,
            host_share: Some(0.5),
            ..ExpertCacheStats::default()
        };
        let text = m.render(None, Some(&v));
        for want in [
            "sluice_vram_expert_hits_total 30",
            "sluice_vram_expert_uploads_total 15",
            "sluice_vram_expert_hit_rate 0.5",
            "sluice_vram_expert_cpu_computed_total 10",
            "sluice_vram_expert_cpu_computed_bytes_total 456",
            "sluice_vram_expert_cpu_seconds_total 0.25",
            "sluice_vram_expert_cpu_share 0.5",
            "sluice_vram_expert_read_in_place_total 10",
            "sluice_vram_expert_read_in_place_bytes_total 123",
            "sluice_vram_expert_upload_bytes_total 4000000000",
            "sluice_vram_expert_upload_gbps 40",
            "# TYPE sluice_vram_expert_upload_seconds_total counter",
        ] {
            assert!(text.contains(want), "missing `{want}` in:\n{text}");
        }
    }
}
