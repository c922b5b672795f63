//! `sluice pack`: rewrite a checkpoint into the streaming layout.

use std::path::PathBuf;
use std::sync::Once;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_store::{pack_with_mtp, PackOptions};

#[derive(Args)]
#[command(
    after_help = "Writes OUT/model.safetensors (every tensor except the routed experts, \
unchanged), OUT/experts.bin (one 4 KiB-aligned block per layer x expert), OUT/experts.json \
(where each block lives, with checksums) and copies of the other files (config.json, \
tokenizer files, ...). A GGUF file packs too: its quantised blocks become the same values in \
MLX-affine form, and config.json and the tokenizer files are made from its metadata. The \
output is written as OUT.partial and renamed when complete.\n\n\
Examples:\n  sluice pack ~/models/Qwen3.5-35B-A3B-4bit -o ~/models/Qwen3.5-35B-A3B-4bit-packed\n  \
sluice pack ~/models/Qwen3-30B-A3B-Q4_K_M.gguf -o ~/models/Qwen3-30B-A3B-Q4_K_M-packed"
)]
pub struct PackArgs {
    /// Model directory to pack (config.json, tokenizer.json, *.safetensors), or a GGUF file.
    #[arg(value_name = "MODEL_DIR|FILE.gguf")]
    model: PathBuf,
    /// Output directory (must not exist unless --force).
    #[arg(long, short = 'o', value_name = "OUT_DIR")]
    out: PathBuf,
    /// Replace OUT_DIR if it exists (never the source directory).
    #[arg(long)]
    force: bool,
    /// Add the multi-token-prediction layer (`mtp.*`, for `--speculate mtp`) of this official
    /// Qwen3.5 / Qwen3-Next checkpoint directory (bf16 or f32 safetensors), converted to the
    /// model's layout and MLX quantisation: mlx-community conversions drop it.
    #[arg(long, value_name = "OFFICIAL_DIR")]
    mtp_from: Option<PathBuf>,
}

pub fn run(a: PackArgs) -> Result<()> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    let start = Instant::now();
    let started = Once::new();
    let summary = pack_with_mtp(
        &a.model,
        &a.out,
        &PackOptions { force: a.force },
        a.mtp_from.as_deref(),
        &|done, total| {
            // Called once the checks have passed: errors before it stay one line.
            started.call_once(|| {
                bar.println(format!(
                    "sluice pack: {} -> {} ({:.2} GB)",
                    a.model.display(),
                    a.out.display(),
                    total as f64 / 1e9
                ));
                bar.set_length(total);
            });
            bar.set_position(done);
        },
    );
    bar.finish_and_clear();
    let s = summary?;
    let secs = start.elapsed().as_secs_f64();
    let total = (s.resident_bytes + s.expert_bytes) as f64 / 1e9;
    eprintln!(
        "packed {}: resident {:.2} GB, experts {:.2} GB ({} layers x {} experts = {} blocks) in {:.1} s, {:.2} GB/s",
        a.out.display(),
        s.resident_bytes as f64 / 1e9,
        s.expert_bytes as f64 / 1e9,
        s.layers,
        s.experts_per_layer,
        s.blocks,
        secs,
        total / secs.max(1e-9)
    );
    if s.mtp_tensors > 0 {
        eprintln!(
            "added the multi-token-prediction layer of {} ({} tensors; use --speculate mtp)",
            a.mtp_from.as_deref().unwrap_or(a.model.as_path()).display(),
            s.mtp_tensors
        );
    }
    Ok(())
}
