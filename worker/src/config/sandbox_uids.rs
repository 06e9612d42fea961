//! `sandbox_uids`: the range of host uids the node's sandboxes run as, one per workspace
//! (the assignment is [`crate::uid_pool`]'s). Checked when the configuration loads.

use serde::{Deserialize, Serialize};

/// The host uids sandboxes may run as (config `sandbox_uids`): `first`, `first + 1`, …,
/// `first + count - 1`; each is also the gid. Never root, never `(uid_t)-1`, never the
/// 16-bit `nobody`/`-1` pair; at start the node also refuses a range that overlaps a user
/// or group of the host or a range of `/etc/subuid` or `/etc/subgid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawRange")]
pub struct UidRange {
    pub first: u32,
    pub count: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRange {
    first: u32,
    count: u32,
}

impl Default for UidRange {
    /// 65,536 uids from 1,879,048,192 (0x70000000): above the ranges `useradd` hands out
    /// in `/etc/subuid` (from 100,000, 65,536 per user) and systemd's container ranges
    /// (524,288–1,879,048,191), below 2^31.
    fn default() -> Self {
        UidRange {
            first: 0x7000_0000,
            count: 65_536,
        }
    }
}

impl TryFrom<RawRange> for UidRange {
    type Error = String;
    fn try_from(r: RawRange) -> Result<Self, String> {
        UidRange::new(r.first, r.count)
    }
}

impl UidRange {
    /// A checked range.
    pub fn new(first: u32, count: u32) -> Result<Self, String> {
        if count == 0 {
            return Err("sandbox_uids.count must be at least 1".into());
        }
        if first == 0 {
            return Err("sandbox_uids.first must not be 0: sandboxes never run as root".into());
        }
        // The last uid must stay below u32::MAX, which is (uid_t)-1 ("no change").
        if first.checked_add(count).is_none() {
            return Err(format!(
                "sandbox_uids: first + count ({first} + {count}) must fit below 4294967295"
            ));
        }
        let r = UidRange { first, count };
        if r.contains(65_534) || r.contains(65_535) {
            return Err("sandbox_uids must not contain 65534 (nobody) or 65535 (16-bit -1)".into());
        }
        Ok(r)
    }

    /// One past the last uid.
    pub fn end(&self) -> u64 {
        u64::from(self.first) + u64::from(self.count)
    }

    pub fn contains(&self, uid: u32) -> bool {
        uid >= self.first && u64::from(uid) < self.end()
    }

    pub(crate) fn overlaps(&self, start: u64, len: u64) -> bool {
        start < self.end() && u64::from(self.first) < start.saturating_add(len)
    }

    /// The host's users, groups and subordinate ranges that fall in this range, one line
    /// each (empty: none). A uid shared with a host user (or a rootless engine's mapped
    /// range) would give that user the workspace's files.
    pub fn host_conflicts(&self) -> Vec<String> {
        let mut found = Vec::new();
        for (file, id_field) in [("/etc/passwd", 2), ("/etc/group", 2)] {
            let Ok(text) = std::fs::read_to_string(file) else {
                continue;
            };
            for line in text.lines() {
                let f: Vec<&str> = line.split(':').collect();
                let Some(id) = f.get(id_field).and_then(|v| v.parse::<u64>().ok()) else {
                    continue;
                };
                if self.overlaps(id, 1) {
                    found.push(format!("{file}: {} ({id})", f[0]));
                }
            }
        }
        for file in ["/etc/subuid", "/etc/subgid"] {
            let Ok(text) = std::fs::read_to_string(file) else {
                continue;
            };
            for line in text.lines() {
                let f: Vec<&str> = line.split(':').collect();
                let (Some(start), Some(len)) = (
                    f.get(1).and_then(|v| v.parse::<u64>().ok()),
                    f.get(2).and_then(|v| v.parse::<u64>().ok()),
                ) else {
                    continue;
                };
                if self.overlaps(start, len) {
                    found.push(format!("{file}: {} ({start}, {len} ids)", f[0]));
                }
            }
        }
        found
    }
}
