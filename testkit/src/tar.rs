//! Tar archives written raw: each header is filled in by hand (name, link name, type,
//! device numbers) and not checked by the `tar` crate's builder, so a test can hand the
//! node exactly the hostile entry it means to (`../x`, an absolute link, a device) and
//! what is tested is the node's own checks.

/// Appends one entry to `b`. A `Char` entry is /dev/null's device (1, 3).
///
/// # Panics
/// When `path` or `link` does not fit the old header's 100 bytes.
pub fn raw_entry(
    b: &mut tar::Builder<Vec<u8>>,
    path: &str,
    kind: tar::EntryType,
    link: &str,
    data: &[u8],
) {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_entry_type(kind);
    h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
    if kind == tar::EntryType::Char {
        h.set_device_major(1)
            .unwrap_or_else(|e| panic!("device major: {e}"));
        h.set_device_minor(3)
            .unwrap_or_else(|e| panic!("device minor: {e}"));
    }
    h.set_cksum();
    b.append(&h, data)
        .unwrap_or_else(|e| panic!("tar entry {path}: {e}"));
}

/// A whole archive of (path, type, link name, content) entries, each written raw.
///
/// # Panics
/// As [`raw_entry`].
pub fn tar_of(entries: &[(&str, tar::EntryType, &str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, link, data) in entries {
        raw_entry(&mut b, path, *kind, link, data);
    }
    b.into_inner()
        .unwrap_or_else(|e| panic!("tar archive: {e}"))
}
