#!/usr/bin/env bash
# sluice vs llama.cpp vs mlx-lm on one checkpoint, as one markdown table.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/peers.sh MODEL_DIR [--available SIZE] [-p N] [-n N] [-r N] [-t N]
                      [--mlx-p N] [--mlx-n N] [--mlx-r N] [--no-llama] [--no-mlx]
                      [--sluice BIN] [--sluice-json FILE] [--gguf FILE]

Runs, on the same mlx-community 4-bit checkpoint:
  sluice     target/release/sluice bench --model DIR -p N -n N -r N -t T --memory --disk --json
  llama.cpp  bench/llama_cpp.sh (exact GGUF converted from DIR; scenarios repack and mmap)
  mlx-lm     bench/mlx_lm.sh (its own, much smaller, -p/-n/-r: it runs ~0.05 tok/s on 2 cores)
and prints one markdown table on stdout:
  engine | scenario | pp tok/s | tg tok/s | tg ratio to sluice | tg fraction of the limit
The limit is the one sluice's generation run was measured against (its JSON `limits`): DRAM
read bandwidth when the weights fit in memory, the disk when --available makes them stream.
A peer's fraction is its tg tok/s x sluice's bytes per generated token / that limit.

  -p/-n/-r/-t N     prompt tokens, generated tokens, repetitions, threads (512/128/3/2)
  --available S     run every engine under bench/memcap with only S (e.g. 10GiB) available;
                    llama.cpp then runs only its mmap scenario
  --mlx-p/-n/-r N   mlx-lm's own settings (default 32/4/1)
  --no-llama, --no-mlx   skip a peer
  --sluice BIN      sluice binary (default target/release/sluice; built with cargo if missing)
  --sluice-json F   use this `sluice bench --json` output instead of running sluice
  --gguf FILE       GGUF for llama.cpp (default MODEL_DIR.gguf, converted if missing)
  --peers-jsonl F   use these llama_cpp.sh / mlx_lm.sh JSON lines instead of running the peers
Raw outputs are kept under $SLUICE_BENCH_HOME/runs/ (default ~/.cache/sluice-bench/runs/).
EOF
}
die() { echo "peers.sh: $*" >&2; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
HOME_DIR="${SLUICE_BENCH_HOME:-$HOME/.cache/sluice-bench}"
MODEL="" AVAIL="" P=512 N=128 R=3 T=2 MP=32 MN=4 MR=1 NO_LLAMA=0 NO_MLX=0
SLUICE="$ROOT/target/release/sluice" SLUICE_JSON="" GGUF="" PEERS_JSONL=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --available) AVAIL="${2:?--available needs a size}"; shift 2 ;;
        -p) P="${2:?}"; shift 2 ;;
        -n) N="${2:?}"; shift 2 ;;
        -r) R="${2:?}"; shift 2 ;;
        -t) T="${2:?}"; shift 2 ;;
        --mlx-p) MP="${2:?}"; shift 2 ;;
        --mlx-n) MN="${2:?}"; shift 2 ;;
        --mlx-r) MR="${2:?}"; shift 2 ;;
        --no-llama) NO_LLAMA=1; shift ;;
        --no-mlx) NO_MLX=1; shift ;;
        --sluice) SLUICE="${2:?}"; shift 2 ;;
        --sluice-json) SLUICE_JSON="${2:?}"; shift 2 ;;
        --gguf) GGUF="${2:?}"; shift 2 ;;
        --peers-jsonl) PEERS_JSONL="${2:?}"; shift 2 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$MODEL" ]] || die "one MODEL_DIR only"; MODEL="${1%/}"; shift ;;
    esac
done
[[ -n "$MODEL" ]] || { usage >&2; exit 2; }
[[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found"
for v in "$P" "$N" "$R" "$T" "$MP" "$MN" "$MR"; do
    [[ "$v" =~ ^[0-9]+$ ]] || die "numeric options take integers (got $v)"
done

RUN="$HOME_DIR/runs/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"
echo "peers.sh: raw outputs in $RUN" >&2
MEMCAP=()
[[ -n "$AVAIL" ]] && MEMCAP=("$HERE/memcap" --available "$AVAIL" --)

# ---- sluice
if [[ -n "$SLUICE_JSON" ]]; then
    [[ -f "$SLUICE_JSON" ]] || die "$SLUICE_JSON not found"
    cp "$SLUICE_JSON" "$RUN/sluice.json"
else
    if [[ ! -x "$SLUICE" ]]; then
        [[ "$SLUICE" == "$ROOT/target/release/sluice" ]] || die "$SLUICE not found"
        echo "peers.sh: building sluice (cargo build --release -p sluice-cli)" >&2
        (cd "$ROOT" && cargo build --release -p sluice-cli >&2) || die "cargo build failed"
    fi
    cmd=("$SLUICE" bench --model "$MODEL" -p "$P" -n "$N" -r "$R" -t "$T" --memory --disk --json)
    echo "peers.sh: ${MEMCAP[*]+${MEMCAP[*]} }${cmd[*]}" >&2
    ${MEMCAP[@]+"${MEMCAP[@]}"} "${cmd[@]}" >"$RUN/sluice.json" || die "sluice bench failed"
fi

# ---- peers
: >"$RUN/peers.jsonl"
if [[ -n "$PEERS_JSONL" ]]; then
    [[ -f "$PEERS_JSONL" ]] || die "$PEERS_JSONL not found"
    cat "$PEERS_JSONL" >"$RUN/peers.jsonl"
    NO_LLAMA=1 NO_MLX=1
fi
PEER_ARGS=()
[[ -n "$AVAIL" ]] && PEER_ARGS+=(--available "$AVAIL")
if [[ "$NO_LLAMA" == 0 ]]; then
    LARGS=("$MODEL" -p "$P" -n "$N" -r "$R" -t "$T" ${PEER_ARGS[@]+"${PEER_ARGS[@]}"})
    [[ -n "$GGUF" ]] && LARGS+=(--gguf "$GGUF")
    "$HERE/llama_cpp.sh" "${LARGS[@]}" | tee -a "$RUN/peers.jsonl" >&2 \
        || echo "peers.sh: llama.cpp failed (its rows may be missing)" >&2
fi
if [[ "$NO_MLX" == 0 ]]; then
    "$HERE/mlx_lm.sh" "$MODEL" -p "$MP" -n "$MN" -r "$MR" ${PEER_ARGS[@]+"${PEER_ARGS[@]}"} \
        | tee -a "$RUN/peers.jsonl" >&2 || echo "peers.sh: mlx-lm failed (its row is missing)" >&2
fi

# ---- table
python3 - "$RUN/sluice.json" "$RUN/peers.jsonl" "$AVAIL" "$P" "$N" "$R" "$T" "$MP" "$MN" "$MR" \
    <<'EOF' | tee "$RUN/table.md"
import json, sys
sl_path, peers_path, avail, P, N, R, T, MP, MN, MR = sys.argv[1:]
sl = json.load(open(sl_path))
lim = sl.get("limits", {})
runs = sl.get("runs", [])
pp = next((r for r in runs if str(r.get("test", "")).startswith("pp")), None)
tg = next((r for r in runs if str(r.get("test", "")).startswith("tg")), None)

mem = lim.get("memory_read_gbps")
disk = lim.get("disk_gbps", lim.get("disk_seq_gbps"))
kind = (tg or {}).get("limit") or ("disk" if avail else "memory")
gbps = (tg or {}).get("limit_gbps") or (disk if kind == "disk" else mem)
bpt = (tg or {}).get("bytes_per_token")

def fmt(x, sd=None, digits=2):
    if x is None:
        return "-"
    d = digits if x >= 1 else 3 if x >= 0.01 else 4
    s = f"{x:.{d}f}"
    if sd:
        s += f" ± {sd:.{d}f}"
    return s

def frac(tok_s):
    if tok_s is None or not bpt or not gbps:
        return "-"
    f = tok_s * bpt / (gbps * 1e9)
    return f"{f:.0%}" if f >= 0.1 else f"{f:.2%}"

sl_tg = (tg or {}).get("tok_s")
rows = []
scen = "streaming" if avail else "in memory"
rows.append(("sluice", scen, fmt((pp or {}).get("tok_s"), (pp or {}).get("tok_s_sd")),
             fmt(sl_tg, (tg or {}).get("tok_s_sd")), "1.00" if sl_tg else "-",
             f"{tg['fraction_of_limit']:.0%}" if tg and tg.get("fraction_of_limit") is not None else frac(sl_tg)))
notes = []
for line in open(peers_path):
    line = line.strip()
    if not line.startswith("{"):
        continue
    p = json.loads(line)
    t = p.get("tg_tok_s")
    ratio = f"{t / sl_tg:.2f}" if t and sl_tg else "-"
    rows.append((p["engine"], p["scenario"], fmt(p.get("pp_tok_s"), p.get("pp_sd")),
                 fmt(t, p.get("tg_sd")), ratio, frac(t)))
    if p["engine"] == "mlx-lm":
        notes.append(f"mlx-lm ran with -p {MP} -n {MN} -r {MR} (tg over tokens 2..{MN}; "
                     f"first token after {p.get('ttft_s', 0):.1f} s)")

print("| engine | scenario | pp tok/s | tg tok/s | tg ratio to sluice | tg fraction of the limit |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
print()
lim_txt = f"{kind} {gbps:.2f} GB/s" if gbps else f"{kind} (not measured)"
bpt_txt = f"{bpt / 1e9:.2f} GB" if bpt else "?"
print(f"Settings: -p {P} -n {N} -r {R} -t {T}" + (f", only {avail} available (bench/memcap)" if avail else ", everything in memory")
      + f". Limit: {lim_txt}; weight bytes per generated token (sluice's count, used for every engine): {bpt_txt}."
      + (f" DRAM read {mem:.1f} GB/s." if mem and kind != "memory" else "")
      + (f" Disk {disk:.2f} GB/s." if disk and kind != "disk" else ""))
for n in notes:
    print(n + ".")
EOF
