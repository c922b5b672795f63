//! How the process takes a closed output pipe.

/// Makes writing to a closed pipe end the process quietly, as `cat` or `grep` do, instead of
/// the Rust runtime's default (SIGPIPE ignored, so the write fails and `println!` panics):
/// `sluice info ... | head` stops when `head` has read enough. For commands that only print;
/// a server keeps the default, where a client closing its socket is an error to handle.
/// Call it first thing in `main`, before any thread starts.
pub fn die_quietly_on_closed_pipe() {
    #[cfg(unix)]
    #[allow(unsafe_code)]
    // SAFETY: `signal` with SIG_DFL installs no handler (nothing runs in signal context); it is
    // called before any other thread exists, so no thread observes the change half way.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
