//! A packed directory's `experts.json` manifest: parsed and validated, then its blocks file's
//! expected length.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = sluice_fuzz::fresh_dir("packed");
    sluice_fuzz::write(&dir, "experts.json", data);
    if let Ok(Some(m)) = sluice_store::Manifest::open(&dir) {
        std::hint::black_box(m.file_len());
    }
});
