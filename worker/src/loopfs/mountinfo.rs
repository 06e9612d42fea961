//! `/proc/self/mountinfo`, read for the mounts under a directory: where each is mounted
//! and what it mounts (the node finds its own volumes by them at start and at removal).

use std::path::{Path, PathBuf};

/// One line of mountinfo: what the node needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Field 1: the mount's id (`statx`'s `STATX_MNT_ID`).
    pub id: u64,
    /// Field 4: the root of the mount within its filesystem.
    pub root: PathBuf,
    /// Field 5: where it is mounted.
    pub point: PathBuf,
    pub fstype: String,
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape(s: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Parses mountinfo text.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(Mount {
                id: f.first()?.parse().ok()?,
                root: unescape(f.get(3)?),
                point: unescape(f.get(4)?),
                fstype: (*r.first()?).to_string(),
                source: (*r.get(1)?).to_string(),
            })
        })
        .collect()
}

/// This process's mounts.
pub fn read() -> std::io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The mounts at or beneath `dir`, deepest first.
pub fn beneath(mounts: &[Mount], dir: &Path) -> Vec<Mount> {
    let mut v: Vec<Mount> = mounts
        .iter()
        .filter(|m| m.point.starts_with(dir))
        .cloned()
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.point.components().count()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_escapes() {
        let t = "42 27 7:0 / /var/lib/a\\040b/jobs/j1/job rw,nosuid,nodev,relatime shared:5 - ext4 /dev/loop0 rw\n27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n";
        let m = parse(t);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].point, Path::new("/var/lib/a b/jobs/j1/job"));
        assert_eq!(m[0].source, "/dev/loop0");
        assert_eq!(m[0].fstype, "ext4");
        assert_eq!(m[0].root, Path::new("/"));
        assert_eq!((m[0].id, m[1].id), (42, 27));
        let b = beneath(&m, Path::new("/var/lib/a b/jobs"));
        assert_eq!(b.len(), 1);
        assert!(beneath(&m, Path::new("/var/lib/a b/job")).is_empty());
    }
}
