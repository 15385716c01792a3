//! The counts, each with its container's id, printed once per tick.
//!
//! The BPF program counts by cgroup id; the container's id is in lookout's
//! `containers_by_cgroup` entry for that cgroup. The entry goes when the
//! container exits, and its counter stays, so [`Report`] remembers every id
//! it has read: an exited container is still printed with its id. A
//! container that came and went between two ticks was never seen in the
//! map, and is printed without one.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::Duration;

use anyhow::Context;
use aya::maps::{HashMap, MapData, MapError};
use lookout_ebpf_common::ContainerEntry;
use serde::Serialize;

/// lookout's `containers_by_cgroup`: cgroup id → a [`ContainerEntry`]'s bytes.
pub type Containers<'a> = HashMap<&'a MapData, u64, [u8; ContainerEntry::SIZE]>;
/// Bytes of a counter: the execs (`u64`), then the counted container's
/// [`ContainerEntry`], copied by the program at its first exec.
pub const COUNTED_SIZE: usize = 8 + ContainerEntry::SIZE;

/// The program's counters: cgroup id → execs and whose they are.
pub type Counters<'a> = HashMap<&'a MapData, u64, [u8; COUNTED_SIZE]>;

/// How a tick is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A header, then one line per container.
    Text,
    /// One JSON object per container: `{"container_id":…,"cgroup_id":…,"execs":…}`.
    Json,
}

/// Prints the counts and remembers the containers' ids.
#[derive(Debug)]
pub struct Report {
    format: Format,
    /// Every container id read from the map, by cgroup id.
    ids: BTreeMap<u64, String>,
}

/// One container's line of a tick.
#[derive(Debug, Serialize)]
struct Row<'a> {
    /// `None`: the container left the map before a tick saw it.
    container_id: Option<&'a str>,
    cgroup_id: u64,
    execs: u64,
    /// The cgroup is no longer in lookout's map: the container exited.
    #[serde(skip)]
    exited: bool,
}

impl Report {
    pub fn new(format: Format) -> Report {
        Report {
            format,
            ids: BTreeMap::new(),
        }
    }

    /// Reads every counter and prints it with its container's id.
    pub fn tick(
        &mut self,
        counters: &Counters<'_>,
        containers: &Containers<'_>,
        elapsed: Duration,
    ) -> anyhow::Result<()> {
        let mut counts = Vec::new();
        for item in counters.iter() {
            let (cgroup_id, counted) = item.context("reading the counters (EXECS_BY_CGROUP)")?;
            let mut execs = [0u8; 8];
            execs.copy_from_slice(&counted[..8]);
            // Whose: known even if the container is gone now.
            self.learn(cgroup_id, &counted[8..]);
            counts.push((cgroup_id, u64::from_ne_bytes(execs)));
        }
        counts.sort_unstable();
        let mut present = Vec::with_capacity(counts.len());
        for &(cgroup_id, _) in &counts {
            match containers.get(&cgroup_id, 0) {
                Ok(bytes) => {
                    self.learn(cgroup_id, &bytes);
                    present.push(true);
                }
                Err(MapError::KeyNotFound) => present.push(false),
                Err(error) => {
                    return Err(error).context("reading lookout's containers_by_cgroup map");
                }
            }
        }
        let mut text = String::new();
        if self.format == Format::Text {
            text.push_str(&format!(
                "-- after {:.1}s: execs of {} container(s)\n",
                elapsed.as_secs_f64(),
                counts.len()
            ));
        }
        for (&(cgroup_id, execs), &present) in counts.iter().zip(&present) {
            text.push_str(&self.line(cgroup_id, execs, !present)?);
            text.push('\n');
        }
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .context("writing to stdout")
    }

    /// Remembers the container id of an entry read for `cgroup_id`. An
    /// entry that does not decode (version 0, too short) teaches nothing.
    fn learn(&mut self, cgroup_id: u64, bytes: &[u8]) {
        if let Some(entry) = ContainerEntry::from_bytes(bytes) {
            let id = String::from_utf8_lossy(entry.id()).into_owned();
            self.ids.insert(cgroup_id, id);
        }
    }

    /// One line for `cgroup_id`, without its newline.
    fn line(&self, cgroup_id: u64, execs: u64, exited: bool) -> anyhow::Result<String> {
        let row = Row {
            container_id: self.ids.get(&cgroup_id).map(String::as_str),
            cgroup_id,
            execs,
            exited,
        };
        Ok(match self.format {
            Format::Json => serde_json::to_string(&row).context("encoding a line as JSON")?,
            Format::Text => format!(
                "{:>8} execs  cgroup {:<10}  {}{}",
                row.execs,
                row.cgroup_id,
                row.container_id.unwrap_or("-"),
                if row.exited { "  (exited)" } else { "" }
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_have_the_documented_fields_in_order() {
        let mut report = Report::new(Format::Json);
        report.learn(398075, &ContainerEntry::new(b"4f2c").to_bytes());
        assert_eq!(
            report.line(398075, 3, false).expect("a line"),
            r#"{"container_id":"4f2c","cgroup_id":398075,"execs":3}"#
        );
        // Never seen in the map: no id.
        assert_eq!(
            report.line(7, 1, true).expect("a line"),
            r#"{"container_id":null,"cgroup_id":7,"execs":1}"#
        );
    }

    #[test]
    fn an_exited_container_keeps_its_id() {
        let mut report = Report::new(Format::Text);
        report.learn(12, &ContainerEntry::new(b"abc").to_bytes());
        assert_eq!(
            report.line(12, 2, false).expect("a line"),
            "       2 execs  cgroup 12          abc"
        );
        assert_eq!(
            report.line(12, 5, true).expect("a line"),
            "       5 execs  cgroup 12          abc  (exited)"
        );
        assert_eq!(
            report.line(13, 1, true).expect("a line"),
            "       1 execs  cgroup 13          -  (exited)"
        );
    }

    #[test]
    fn entries_that_do_not_decode_teach_nothing() {
        let mut report = Report::new(Format::Json);
        report.learn(1, &[0u8; ContainerEntry::SIZE]);
        report.learn(2, &[1u8; 16]);
        assert!(report.ids.is_empty());
    }
}
