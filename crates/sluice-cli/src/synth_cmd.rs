//! `sluice synth`: write a random checkpoint with a real model's exact shapes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_synth::{synthesize, Preset, Quant, SynthOptions, ZeroPoint, PRESETS};

#[derive(Args)]
#[command(after_help = "Presets (published config.json shapes):\n  \
    qwen3.5-35b-a3b     Qwen3.5-35B-A3B: 40 layers, 256 experts, top-8, shared expert (~19.5 GB at 4 bits)\n  \
    qwen3.5-122b-a10b   Qwen3.5-122B-A10B: 48 layers, hidden 3072 (~65 GB at 4 bits)\n  \
    qwen3.5-397b-a17b   Qwen3.5-397B-A17B: 60 layers, hidden 4096, 512 experts, top-10 (~223 GB at 4 bits)\n  \
    qwen3-30b-a3b       Qwen3-30B-A3B: 48 layers, 128 experts, top-8 (~17.2 GB at 4 bits)\n  \
    qwen3-235b-a22b     Qwen3-235B-A22B: 94 layers, hidden 4096 (~132 GB at 4 bits)\n  \
    gpt-oss-20b         gpt-oss-20b: 24 layers, 32 experts, top-4, sinks, sliding window (~11.8 GB at 4 bits)\n  \
    gpt-oss-120b        gpt-oss-120b: 36 layers, 128 experts, top-4 (~65.8 GB at 4 bits)\n  \
    tiny-qwen3.5-moe, tiny-qwen3-moe, tiny-gpt-oss, ...   the same structures at test size (~2 MB)\n\n\
Example:\n  sluice synth --preset qwen3.5-35b-a3b -o ~/models/q35-synth")]
pub struct SynthArgs {
    /// Which model's shapes to write (see below; `--preset list` prints them with sizes).
    #[arg(
        long,
        value_name = "NAME",
        required_unless_present = "list",
        default_value = ""
    )]
    preset: String,
    /// Output directory (must not exist; written as DIR.partial and renamed when complete).
    #[arg(long, short = 'o', value_name = "DIR")]
    out: Option<PathBuf>,
    /// Bits per quantised weight (MLX affine; router gates are always 8 bits, as mlx-lm writes).
    #[arg(long, default_value_t = 4, value_parser = PossibleValuesParser::new(["4", "8"]).map(|s| s.parse::<u32>().expect("listed value")))]
    bits: u32,
    /// Weights per quantisation group (32, 64 or 128).
    #[arg(long, default_value_t = 64, value_parser = PossibleValuesParser::new(["32", "64", "128"]).map(|s| s.parse::<usize>().expect("listed value")))]
    group_size: usize,
    /// Random seed: the same preset, bits and seed give the same files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep only the first N layers (a mid-size model of the same shapes).
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Write every bias as exactly -2^(bits-1) x its scale (ggml's zero point) instead of
    /// centring the codes, so that `bench/gguf_from_mlx.py` writes a Q4_0 (or Q8_0) GGUF that
    /// holds the same numbers at the same 4.5 bits per weight: for llama.cpp speed comparisons.
    #[arg(long)]
    ggml_zero_point: bool,
    /// Print the presets with their sizes and exit.
    #[arg(long)]
    list: bool,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let quant = Quant {
        bits: a.bits,
        group_size: a.group_size,
    };
    if a.list || a.preset == "list" {
        println!(
            "| preset | family | layers | experts (top-k) | size at {} bits |",
            a.bits
        );
        println!("|---|---|---|---|---|");
        for p in PRESETS {
            let opts = SynthOptions {
                quant,
                ..SynthOptions::new(p, PathBuf::new())
            };
            let bytes = sluice_synth::planned_bytes(&sluice_synth::shard_plan(p, &opts));
            println!(
                "| {} | {:?} | {} | {} ({}) | {:.2} GB |",
                p.name,
                p.family,
                p.layers,
                p.experts,
                p.experts_per_token,
                bytes as f64 / 1e9
            );
        }
        return Ok(());
    }
    let preset = Preset::find(&a.preset).map_err(anyhow::Error::msg)?;
    let Some(out) = a.out else {
        bail!("--out DIR is required");
    };
    let opts = SynthOptions {
        preset,
        out: out.clone(),
        quant,
        zero_point: if a.ggml_zero_point {
            ZeroPoint::Ggml
        } else {
            ZeroPoint::Centred
        },
        seed: a.seed,
        layers: a.layers,
    };
    if out.exists() {
        return Err(sluice_synth::SynthError::Exists(out).into());
    }
    let total = sluice_synth::planned_bytes(&sluice_synth::shard_plan(
        &sluice_synth::effective_preset(&opts)?,
        &opts,
    ));
    eprintln!(
        "sluice synth: {} ({} bits, group {}) -> {} ({:.2} GB)",
        preset.name,
        a.bits,
        a.group_size,
        out.display(),
        total as f64 / 1e9
    );
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template(
            "{wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    let start = Instant::now();
    let summary = synthesize(&opts, &|done, _| bar.set_position(done))?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({:.2} GB in {} file(s), {} tensors) in {:.1} s, {:.2} GB/s",
        out.display(),
        summary.bytes as f64 / 1e9,
        summary.files,
        summary.tensors,
        secs,
        summary.bytes as f64 / 1e9 / secs
    );
    Ok(())
}
