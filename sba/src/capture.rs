//! Bounded output capture: keeps the head and the tail of a stream, counts what it drops.
//!
//! Memory stays at most `cap` bytes per stream however much a command prints, so 1 GiB of
//! output under a 1 MiB cap costs about 2 MiB.

use std::collections::VecDeque;

/// Head and tail of one stream.
#[derive(Debug)]
pub struct HeadTail {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    half: usize,
    total: u64,
}

impl HeadTail {
    /// A buffer for a step whose stdout+stderr may hold `cap` bytes together.
    pub fn new(cap: usize) -> Self {
        let half = (cap / 2).max(1);
        Self {
            head: Vec::new(),
            tail: VecDeque::new(),
            half,
            total: 0,
        }
    }

    /// Appends a chunk.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.half {
            let take = data.len().min(self.half - self.head.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        if data.is_empty() {
            return;
        }
        if data.len() >= self.half {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.half..]);
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.half);
        self.tail.drain(..overflow);
        self.tail.extend(data);
    }

    /// Bytes the stream produced in all.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Renders at most `budget` bytes of content: all of it when it fits, else head, a
    /// marker naming the dropped byte count, and tail.
    pub fn render(&self, budget: usize) -> String {
        let kept = self.head.len() + self.tail.len();
        if self.total as usize == kept && kept <= budget {
            let mut all = self.head.clone();
            all.extend(self.tail.iter());
            return String::from_utf8_lossy(&all).into_owned();
        }
        let h = self.head.len().min(budget / 2);
        let t = self.tail.len().min(budget - h);
        let dropped = self.total - (h + t) as u64;
        let mut out = Vec::with_capacity(h + t + 64);
        out.extend_from_slice(&self.head[..h]);
        out.extend_from_slice(format!("\n...[{dropped} bytes dropped]...\n").as_bytes());
        out.extend(self.tail.iter().skip(self.tail.len() - t));
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Splits `cap` between two streams: a small stream keeps everything up to half, the other
/// gets the rest. Returns `(budget_a, budget_b, truncated)`.
pub fn split_budget(a: u64, b: u64, cap: usize) -> (usize, usize, bool) {
    if a + b <= cap as u64 {
        return (a as usize, b as usize, false);
    }
    let half = cap / 2;
    if a <= b {
        let ba = (a as usize).min(half);
        (ba, cap - ba, true)
    } else {
        let bb = (b as usize).min(half);
        (cap - bb, bb, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_output_is_kept_whole() {
        let mut c = HeadTail::new(100);
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(c.render(100), "hello world");
    }

    #[test]
    fn large_output_keeps_head_and_tail() {
        let mut c = HeadTail::new(10);
        for chunk in [b"0123".as_slice(), b"456789", b"abcdef", b"XYZ"] {
            c.push(chunk);
        }
        assert_eq!(c.total(), 19);
        assert_eq!(c.render(10), "01234\n...[9 bytes dropped]...\nefXYZ");
    }

    #[test]
    fn one_huge_chunk() {
        let mut c = HeadTail::new(4);
        c.push(&[b'a'; 1000]);
        c.push(b"zz");
        assert_eq!(c.render(4), "aa\n...[998 bytes dropped]...\nzz");
    }

    #[test]
    fn budget_split_favours_the_small_stream() {
        assert_eq!(split_budget(10, 5, 100), (10, 5, false));
        assert_eq!(split_budget(1000, 5, 100), (95, 5, true));
        assert_eq!(split_budget(5, 1000, 100), (5, 95, true));
        assert_eq!(split_budget(1000, 1000, 100), (50, 50, true));
    }
}
