//! A safetensors file: the header length, the JSON header, every entry's dtype, shape and
//! offsets checked against the file, then each tensor's bytes viewed.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = sluice_fuzz::scratch();
    let path = sluice_fuzz::write(dir, "model.safetensors", data);
    if let Ok(tensors) = sluice_format::safetensors::read_safetensors(&path) {
        for t in &tensors {
            // A tensor that passed validation lies inside the file: read all of it.
            let sum = t.bytes.as_slice().iter().fold(0u8, |a, &b| a ^ b);
            assert_eq!(
                t.bytes.len(),
                t.shape.iter().product::<usize>() * t.dtype.size()
            );
            std::hint::black_box(sum);
        }
    }
});
