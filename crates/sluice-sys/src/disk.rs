//! Free disk space (`statvfs`).

use std::path::Path;

/// Bytes an unprivileged user may still write on the filesystem holding `path`, or holding its
/// nearest existing ancestor when `path` does not exist yet. `None` where that is not available.
pub fn free_disk_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| {
        // An empty ancestor is the current directory of a relative path.
        let p = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        p.exists()
    })?;
    let existing = if existing.as_os_str().is_empty() {
        Path::new(".")
    } else {
        existing
    };
    statvfs_free(existing)
}

#[cfg(unix)]
#[allow(unsafe_code)] // the one FFI call of the crate
fn statvfs_free(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call, and `st` points to
    // writable memory of the right type, which statvfs fills in when it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u64 here, u32 on some).
    #[allow(clippy::unnecessary_cast, trivial_numeric_casts)]
    let free = (st.f_bavail as u64).checked_mul(st.f_frsize as u64)?;
    Some(free)
}

#[cfg(not(unix))]
fn statvfs_free(_path: &Path) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn free_disk_space_exists_even_for_paths_not_yet_made() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_disk_bytes(dir.path()).unwrap() > 0);
        // A path that does not exist yet is measured at its nearest existing ancestor.
        let missing = dir.path().join("not/yet/here");
        assert!(free_disk_bytes(&missing).unwrap() > 0);
        assert!(free_disk_bytes(Path::new("relative-missing-file")).unwrap() > 0);
    }
}
