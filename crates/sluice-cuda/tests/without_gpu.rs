//! What a user without a usable GPU meets: a one-line error that says what to do, never a panic.
//! Runs everywhere (on a GPU machine it checks the message for a device that does not exist).

#[test]
fn opening_a_missing_device_is_a_clear_error() {
    let count = sluice_cuda::device_count();
    let err = match sluice_cuda::open(count) {
        Ok(_) => panic!("cuda:{count} opened although {count} devices were counted"),
        Err(e) => e.to_string(),
    };
    assert!(!err.contains('\n'), "one line: {err}");
    if count == 0 {
        assert!(err.contains("--device cpu"), "says what to do: {err}");
    } else {
        assert!(err.contains("does not exist"), "{err}");
    }
    eprintln!("{count} CUDA device(s); opening cuda:{count}: {err}");
}
