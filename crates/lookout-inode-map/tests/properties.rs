//! Property tests: for any sequence of maps, reuses, releases, forgets,
//! snapshots and restores (under every policy), in every mode, numbers are
//! never 0 or 1, unique per live file, stable for a file until its inode is
//! reused, stable across save/load/restore, and a `Fail` restore that fails
//! leaves the map bit-for-bit unchanged.

use std::collections::HashMap;

use lookout_inode_map::{
    ConflictPolicy, DeviceIdentity, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const DEVICES: [&str; 2] = ["a", "b"];

#[derive(Debug, Clone)]
enum Op {
    /// Map a file (device index, inode) with its current stamp, or without
    /// one (a directory listing).
    Map {
        dev: usize,
        ino: u64,
        stat: bool,
    },
    /// The host frees the inode and gives it to a new file.
    Reuse {
        dev: usize,
        ino: u64,
    },
    Release {
        dev: usize,
        ino: u64,
    },
    /// Forget the n-th tombstone.
    Forget(usize),
    /// save → load → restore into a new map, devices renumbered.
    Reload,
    /// Restore the map's own snapshot into itself.
    SelfRestore(ConflictPolicy),
    /// Restore a snapshot of another map (same devices, other files).
    Foreign(ConflictPolicy, Vec<(usize, u64)>),
}

fn policy() -> impl Strategy<Value = ConflictPolicy> {
    prop_oneof![
        Just(ConflictPolicy::Fail),
        Just(ConflictPolicy::Remap),
        Just(ConflictPolicy::Trust),
    ]
}

fn op(big_inodes: bool) -> impl Strategy<Value = Op> {
    // A few inodes, so that files meet again; in Xino some past its field.
    // From 2: host file systems do not give out 0 and 1 (ext4's 1 is
    // its bad-blocks inode), and Passthrough and Xino show host numbers.
    let ino = if big_inodes {
        prop_oneof![2u64..8, (1u64 << 59)..(1u64 << 59) + 4].boxed()
    } else {
        (2u64..10).boxed()
    };
    let dev = 0usize..DEVICES.len();
    prop_oneof![
        8 => (dev.clone(), ino.clone(), any::<bool>()).prop_map(|(dev, ino, stat)| Op::Map { dev, ino, stat }),
        2 => (dev.clone(), ino.clone()).prop_map(|(dev, ino)| Op::Reuse { dev, ino }),
        1 => (dev.clone(), ino.clone()).prop_map(|(dev, ino)| Op::Release { dev, ino }),
        1 => (0usize..4).prop_map(Op::Forget),
        1 => Just(Op::Reload),
        1 => policy().prop_map(Op::SelfRestore),
        1 => (policy(), prop::collection::vec((dev, ino), 0..6)).prop_map(|(p, f)| Op::Foreign(p, f)),
    ]
}

fn modes() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Passthrough),
        Just(Mode::Xino {
            bits: 4,
            overflow: Overflow::Fallback
        }),
        Just(Mode::Allocated),
        Just(Mode::Hashed),
    ]
}

/// The test's view of the host and of what the map promised.
struct World {
    map: InodeMap,
    /// st_dev of each device now (changes on Reload, as after a reboot).
    st_dev: [u64; 2],
    /// Each file's current life (bumped by Reuse).
    life: HashMap<(usize, u64), u32>,
    /// The number each file's current life was given, while it is known
    /// to be kept (cleared where the map may legitimately renumber).
    given: HashMap<(usize, u64), (u64, u64)>,
}

impl World {
    fn new(mode: Mode) -> World {
        let mut map = InodeMap::new(mode, Limits::default());
        for (i, name) in DEVICES.iter().enumerate() {
            map.register_device(10 + i as u64, DeviceIdentity::marker(name))
                .expect("dev");
        }
        World {
            map,
            st_dev: [10, 11],
            life: HashMap::new(),
            given: HashMap::new(),
        }
    }

    fn key(&self, dev: usize, ino: u64) -> FileKey {
        FileKey {
            dev: self.st_dev[dev],
            ino,
        }
    }

    /// The file handle of a file's life: few distinct values, so that
    /// Hashed meets collisions; life-dependent, as handles carry a
    /// generation.
    fn handle(ino: u64, life: u32) -> [u8; 2] {
        [(ino % 3) as u8, (life % 2) as u8]
    }

    fn map(&mut self, dev: usize, ino: u64, stat: bool) -> Result<(), TestCaseError> {
        let life = *self.life.get(&(dev, ino)).unwrap_or(&0);
        let stamp = if stat {
            Stamp(life + 1)
        } else {
            Stamp::UNKNOWN
        };
        let m = self
            .map
            .map(self.key(dev, ino), stamp, Some(&World::handle(ino, life)))
            .map_err(|e| TestCaseError::fail(format!("map: {e}")))?;
        prop_assert!(m.ino >= 2, "number {} is reserved", m.ino);
        if let Some(before) = self.given.get(&(dev, ino)) {
            prop_assert_eq!(
                *before,
                (m.ino, m.dev),
                "file ({}, {}) renumbered",
                dev,
                ino
            );
        }
        for (other, n) in &self.given {
            prop_assert!(
                *other == (dev, ino) || *n != (m.ino, m.dev),
                "({}, {}) got {:?}, the number of {:?}",
                dev,
                ino,
                m,
                other
            );
        }
        // Without a stamp the map cannot tell a new life from the old one;
        // only a stat'ed map is a promise for this life.
        if stat || !self.life.contains_key(&(dev, ino)) {
            self.given.insert((dev, ino), (m.ino, m.dev));
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.map
            .snapshot()
            .validate()
            .map_err(|e| TestCaseError::fail(format!("invalid own snapshot: {e}")))
    }
}

fn run(mode: Mode, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut w = World::new(mode);
    for op in ops {
        match op {
            Op::Map { dev, ino, stat } => w.map(dev, ino, stat)?,
            Op::Reuse { dev, ino } => {
                *w.life.entry((dev, ino)).or_default() += 1;
                // Passthrough and Xino keep host numbers, as the host does
                // (except Xino's fallbacks, which live in a table).
                let kept = match mode {
                    Mode::Passthrough => true,
                    Mode::Xino { .. } => ino < 1 << 59,
                    _ => false,
                };
                if !kept {
                    w.given.remove(&(dev, ino));
                }
            }
            Op::Release { dev, ino } => w.map.release(w.key(dev, ino)),
            Op::Forget(i) => {
                let s = w.map.snapshot();
                if let Some(n) = s.tombstones.get(i) {
                    w.map.forget_number(*n);
                }
            }
            Op::Reload => {
                let mut bytes = Vec::new();
                w.map.snapshot().save(&mut bytes).expect("save");
                let s = Snapshot::load(&bytes[..])
                    .map_err(|e| TestCaseError::fail(format!("load: {e}")))?;
                let mut m = InodeMap::from_snapshot(&s, Limits::default())
                    .map_err(|e| TestCaseError::fail(format!("restore: {e}")))?;
                w.st_dev = [w.st_dev[0] + 100, w.st_dev[1] + 100];
                for (i, name) in DEVICES.iter().enumerate() {
                    m.register_device(w.st_dev[i], DeviceIdentity::marker(name))
                        .expect("dev");
                }
                w.map = m;
                // Passthrough's st_dev is the virtual one: unchanged.
            }
            Op::SelfRestore(policy) => {
                let before = w.map.snapshot();
                let r = w
                    .map
                    .restore(&before, policy)
                    .map_err(|e| TestCaseError::fail(format!("self-restore: {e}")))?;
                prop_assert!(r.conflicts.is_empty(), "{:?}", r.conflicts);
                prop_assert_eq!(w.map.snapshot(), before);
            }
            Op::Foreign(policy, files) => {
                let mut other = World::new(mode);
                for (dev, ino) in files {
                    other.map(dev, ino, true)?;
                }
                let s = other.map.snapshot();
                let before = w.map.snapshot();
                match w.map.restore(&s, policy) {
                    Ok(r) => {
                        if policy == ConflictPolicy::Trust && !r.conflicts.is_empty() {
                            // The snapshot's numbers won: promises end.
                            w.given.clear();
                        } else if r.conflicts.is_empty() {
                            // Every foreign file got its saved number: a
                            // promise too, for the life it was saved in.
                            for ((dev, ino), n) in other.given {
                                if w.life.get(&(dev, ino)).is_none_or(|l| *l == 0) {
                                    w.given.entry((dev, ino)).or_insert(n);
                                }
                            }
                        }
                        // Remap with conflicts: the map kept its numbers,
                        // and the foreign files that clashed got others.
                    }
                    Err(_) => {
                        prop_assert_eq!(policy, ConflictPolicy::Fail);
                        prop_assert_eq!(
                            w.map.snapshot(),
                            before,
                            "a failed restore changed the map"
                        );
                    }
                }
            }
        }
        w.check()?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // Failing cases are kept next to this file (tests/properties.regressions)
        // and run first next time: commit them.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn numbers_stay_unique_stable_and_unreserved(
        mode in modes(),
        ops in prop::collection::vec(op(false), 0..60),
    ) {
        run(mode, ops)?;
    }

    #[test]
    fn xino_overflow_fallbacks_follow_the_same_rules(
        ops in prop::collection::vec(op(true), 0..60),
    ) {
        run(Mode::Xino { bits: 4, overflow: Overflow::Fallback }, ops)?;
    }
}
