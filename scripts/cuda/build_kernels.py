#!/usr/bin/env python3
"""Compile sluice's CUDA kernels (crates/sluice-cuda/kernels/sluice.cu) to PTX.

The PTX is committed and embedded in the binary, so building sluice needs no CUDA toolkit; the
driver JIT-compiles it for whatever GPU it finds. It targets compute_80 with NVRTC 12.4 (PTX ISA
8.4): every GPU from Ampere on, with any driver from 550 on.

NVRTC and ptxas come from NVIDIA's PyPI wheels, downloaded once into .cuda-toolchain/ (ignored by
git). ptxas then assembles the PTX for sm_90 (H100) and sm_80 to report registers and spills, and
to catch what the JIT would reject.

    python3 scripts/cuda/build_kernels.py            # writes crates/sluice-cuda/kernels/sluice.ptx
    python3 scripts/cuda/build_kernels.py --check    # fails if the committed PTX is stale
"""

import argparse
import ctypes
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "crates/sluice-cuda/kernels/sluice.cu"
OUTPUT = ROOT / "crates/sluice-cuda/kernels/sluice.ptx"
TOOLCHAIN = ROOT / ".cuda-toolchain"
WHEELS = {
    "nvidia-cuda-nvrtc-cu12": "12.4.127",
    "nvidia-cuda-nvcc-cu12": "12.4.131",
    "nvidia-cuda-runtime-cu12": "12.4.127",
}
ARCH = "compute_80"


def fnv1a64(data: bytes) -> int:
    """The hash the Rust test recomputes (crates/sluice-cuda/src/kernels.rs) to detect stale PTX."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def toolchain() -> Path:
    base = TOOLCHAIN / "nvidia"
    if not (base / "cuda_nvrtc/lib/libnvrtc.so.12").exists():
        TOOLCHAIN.mkdir(exist_ok=True)
        wheels = TOOLCHAIN / "wheels"
        specs = [f"{name}=={version}" for name, version in WHEELS.items()]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *specs],
            check=True,
        )
        for w in wheels.glob("*.whl"):
            with zipfile.ZipFile(w) as z:
                z.extractall(TOOLCHAIN)
        for exe in (base / "cuda_nvcc/bin").glob("*"):
            exe.chmod(0o755)
    return base


def compile_ptx(base: Path, source: bytes) -> bytes:
    nvrtc = ctypes.CDLL(str(base / "cuda_nvrtc/lib/libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"nvrtc {what} failed ({rc})")
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"sluice.cu", 0, None, None), "create")
    opts = [
        f"--gpu-architecture={ARCH}".encode(),
        b"--std=c++17",
        b"--fmad=true",
        b"-I" + str(base / "cuda_runtime/include").encode(),
    ]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    check(rc, "compile")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "get PTX")
    return ptx.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the PTX is up to date")
    args = ap.parse_args()
    source = SOURCE.read_bytes()
    stamp = f"// sluice-source-fnv1a64: {fnv1a64(source):016x}\n".encode()
    if args.check:
        ok = OUTPUT.exists() and OUTPUT.read_bytes().startswith(stamp)
        sys.exit(0 if ok else f"{OUTPUT} is stale: run {Path(__file__).relative_to(ROOT)}")
    base = toolchain()
    ptx = compile_ptx(base, source)
    OUTPUT.write_bytes(stamp + ptx)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(ptx)} bytes)")
    # On 9.0 and newer the loader turns the marker comments into instructions (kernels.rs): assemble
    # that text for sm_90, the PTX as built for sm_80.
    patched = TOOLCHAIN / "sluice_sm90.ptx"
    patched.write_bytes(
        OUTPUT.read_bytes().replace(b".target sm_80", b".target sm_90", 1).replace(b"// sluice-pdl: ", b"")
    )
    for arch, ptx_file in [("sm_90", patched), ("sm_80", OUTPUT)]:
        out = subprocess.run(
            [str(base / "cuda_nvcc/bin/ptxas"), f"-arch={arch}", "-v", str(ptx_file), "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(f"ptxas {arch} rejected the PTX:\n{out.stderr}")
        if arch == "sm_90":
            lines = out.stderr.splitlines()
            for i, line in enumerate(lines):
                if "Compiling entry function" in line:
                    name = line.split("'")[1]
                    rest = " ".join(l.split("info    :")[-1].strip() for l in lines[i + 1 : i + 4])
                    print(f"  {name:28} {rest}")


if __name__ == "__main__":
    main()
