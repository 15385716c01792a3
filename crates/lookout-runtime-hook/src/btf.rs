//! Just enough of the BTF format to find one struct member's offset in the
//! running kernel (`/sys/kernel/btf/vmlinux`), so a BPF program can read
//! that field without CO-RE relocations (which rustc does not emit).
//!
//! Format: <https://docs.kernel.org/bpf/btf.html>.

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn str_at(strings: &[u8], off: u32) -> Option<&[u8]> {
    let s = strings.get(off as usize..)?;
    Some(&s[..s.iter().position(|&c| c == 0)?])
}

/// Bytes of kind-specific data after the 12-byte type header.
fn extra_len(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        1 => 4,                            // INT
        2 | 7 | 8 | 9 | 10 | 11 | 12 => 0, // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC
        3 => 12,                           // ARRAY
        4 | 5 => 12 * vlen,                // STRUCT, UNION
        6 => 8 * vlen,                     // ENUM
        13 => 8 * vlen,                    // FUNC_PROTO
        14 => 4,                           // VAR
        15 => 12 * vlen,                   // DATASEC
        16 => 0,                           // FLOAT
        17 => 4,                           // DECL_TAG
        18 => 0,                           // TYPE_TAG
        19 => 12 * vlen,                   // ENUM64
        _ => return None,
    })
}

/// The byte offset of `member` in `struct name`, from raw BTF bytes.
pub fn member_offset(btf: &[u8], name: &str, member: &str) -> Option<u32> {
    if btf.len() < 24 || u16::from_le_bytes([btf[0], btf[1]]) != BTF_MAGIC {
        return None;
    }
    let hdr_len = u32_at(btf, 4)? as usize;
    let type_off = u32_at(btf, 8)? as usize;
    let type_len = u32_at(btf, 12)? as usize;
    let str_off = u32_at(btf, 16)? as usize;
    let str_len = u32_at(btf, 20)? as usize;
    let types = btf.get(hdr_len + type_off..hdr_len + type_off + type_len)?;
    let strings = btf.get(hdr_len + str_off..hdr_len + str_off + str_len)?;
    let mut off = 0;
    while off + 12 <= types.len() {
        let name_off = u32_at(types, off)?;
        let info = u32_at(types, off + 4)?;
        let kind = (info >> 24) & 0x1f;
        let vlen = (info & 0xffff) as usize;
        let kind_flag = info >> 31 == 1;
        let extra = extra_len(kind, vlen)?;
        if (kind == KIND_STRUCT || kind == KIND_UNION)
            && str_at(strings, name_off) == Some(name.as_bytes())
        {
            for i in 0..vlen {
                let m = off + 12 + i * 12;
                if str_at(strings, u32_at(types, m)?) == Some(member.as_bytes()) {
                    let raw = u32_at(types, m + 8)?;
                    let bits = if kind_flag { raw & 0x00ff_ffff } else { raw };
                    return (bits % 8 == 0).then_some(bits / 8);
                }
            }
        }
        off += 12 + extra;
    }
    None
}

/// `task_struct.exit_code` in the running kernel.
pub fn task_exit_code_offset() -> Option<u32> {
    let btf = std::fs::read("/sys/kernel/btf/vmlinux").ok()?;
    member_offset(&btf, "task_struct", "exit_code")
}

/// Turns a kernel exit code (`wait(2)` status) into a shell-style code:
/// the exit status, or 128 + the signal number.
pub fn shell_exit_code(raw: i32) -> i32 {
    if raw & 0x7f == 0 {
        (raw >> 8) & 0xff
    } else {
        128 + (raw & 0x7f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny BTF blob: INT "int", STRUCT "task_struct" { int pid @0; int exit_code @64 bits }.
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0task_struct\0pid\0exit_code\0".to_vec();
        let mut types = Vec::new();
        let push = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
        // [1] INT "int" size 4, encoding word.
        push(&mut types, 1);
        push(&mut types, 1 << 24);
        push(&mut types, 4);
        push(&mut types, 32);
        // [2] STRUCT "task_struct", 2 members, size 16.
        push(&mut types, 5);
        push(&mut types, (4 << 24) | 2);
        push(&mut types, 16);
        for (n, bits) in [(17u32, 0u32), (21, 64)] {
            push(&mut types, n);
            push(&mut types, 1);
            push(&mut types, bits);
        }
        let mut b = Vec::new();
        b.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        b.push(1);
        b.push(0);
        push(&mut b, 24);
        push(&mut b, 0);
        push(&mut b, types.len() as u32);
        push(&mut b, types.len() as u32);
        push(&mut b, strings.len() as u32);
        b.extend_from_slice(&types);
        b.extend_from_slice(&strings);
        b
    }

    #[test]
    fn finds_member_offsets() {
        let b = blob();
        assert_eq!(member_offset(&b, "task_struct", "exit_code"), Some(8));
        assert_eq!(member_offset(&b, "task_struct", "pid"), Some(0));
        assert_eq!(member_offset(&b, "task_struct", "nope"), None);
        assert_eq!(member_offset(&b[..10], "task_struct", "pid"), None);
    }

    #[test]
    fn the_running_kernel_has_task_exit_code() {
        if std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
            let off = task_exit_code_offset().expect("task_struct.exit_code in vmlinux BTF");
            assert!(off > 0 && off < 16384, "{off}");
        }
    }

    #[test]
    fn exit_codes_like_a_shell() {
        assert_eq!(shell_exit_code(3 << 8), 3);
        assert_eq!(shell_exit_code(9), 137);
        assert_eq!(shell_exit_code(0), 0);
    }
}
