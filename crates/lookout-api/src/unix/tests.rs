use super::*;

/// A frame as bytes.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame_header(&mut out, payload.len(), kind, flags, stream);
    out.extend_from_slice(payload);
    out
}

/// Splits bytes into (kind, flags, stream, payload) frames.
fn frames_of(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while b.len() >= 9 {
        let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
        let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
        v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
        b = &b[9 + len..];
    }
    assert!(b.is_empty(), "a partial frame left");
    v
}

/// A literal with incremental indexing of an indexed name (RFC 7541
/// §6.2.1), as grpc C-core sends `:authority` (static index 1).
fn indexed_name(index: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![0x40 | index];
    string(&mut out, value);
    out
}

/// A request header block the way C-core writes its first one:
/// `:method POST` (static 3), `:scheme http` (static 6), `:path`, and the
/// authority indexed into the dynamic table.
fn first_block(authority: &[u8]) -> Vec<u8> {
    let mut b = vec![0x83, 0x86];
    b.extend(indexed_name(4, b"/grpc.health.v1.Health/Check"));
    b.extend(indexed_name(1, authority));
    b.extend(indexed_name(31, b"application/grpc")); // content-type
    b
}

fn connection(blocks: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut c = PREFACE.to_vec();
    c.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])); // SETTINGS
    for (stream, block) in blocks {
        c.extend(frame(HEADERS, END_HEADERS, *stream, block));
        c.extend(frame(0x0, END_STREAM, *stream, &[0, 0, 0, 0, 0])); // DATA
    }
    c
}

/// Decodes every header block of `out` with a fresh table, as h2 does.
fn h2_reads(out: &[u8]) -> Vec<Vec<(String, String)>> {
    assert!(out.starts_with(PREFACE));
    let mut decoder = loona_hpack::Decoder::new();
    let mut blocks = Vec::new();
    let mut pending = Vec::new();
    for (kind, flags, _, payload) in frames_of(&out[PREFACE.len()..]) {
        if kind == HEADERS || kind == CONTINUATION {
            let mut p = payload.as_slice();
            if kind == HEADERS && flags & PRIORITY != 0 {
                p = &p[5..];
            }
            pending.extend_from_slice(p);
            if flags & END_HEADERS != 0 {
                let fields = decoder.decode(&pending).expect("h2 decodes it");
                blocks.push(
                    fields
                        .into_iter()
                        .map(|(n, v)| {
                            (
                                String::from_utf8(n).expect("utf-8"),
                                String::from_utf8(v).expect("utf-8"),
                            )
                        })
                        .collect(),
                );
                pending.clear();
            }
        }
    }
    blocks
}

fn authority(block: &[(String, String)]) -> Option<&str> {
    block
        .iter()
        .find(|(n, _)| n == ":authority")
        .map(|(_, v)| v.as_str())
}

fn run(input: &[u8]) -> (Vec<u8>, Rewriter) {
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    r.feed(input, &mut out).expect("feeds");
    (out, r)
}

#[test]
fn a_percent_encoded_path_becomes_localhost_in_every_request_of_the_connection() {
    // The second request refers to the first one's authority by its
    // dynamic-table index (62), as C-core does.
    // The table holds content-type (62), :authority (63), :path (64).
    let second = vec![0x83, 0x86, 0xc0, 0xbf, 0xbe];
    let input = connection(&[(1, first_block(b"tmp%2Flookout.sock")), (3, second)]);
    let (out, r) = run(&input);
    let blocks = h2_reads(&out);
    assert_eq!(blocks.len(), 2);
    assert_eq!(authority(&blocks[0]), Some("localhost"));
    assert_eq!(authority(&blocks[1]), Some("localhost"));
    assert_eq!(
        blocks[1][2],
        (":path".into(), "/grpc.health.v1.Health/Check".into())
    );
    assert_eq!(r.rewritten(), 2);
    // Every other frame is as it came.
    let kinds: Vec<u8> = frames_of(&out[PREFACE.len()..])
        .iter()
        .map(|f| f.0)
        .collect();
    assert_eq!(kinds, [0x4, HEADERS, 0x0, HEADERS, 0x0]);
}

#[test]
fn a_raw_path_as_grpc_java_sends_it_becomes_localhost() {
    let (out, _) = run(&connection(&[(
        1,
        first_block(b"/run/lookout/lookout.sock"),
    )]));
    assert_eq!(authority(&h2_reads(&out)[0]), Some("localhost"));
}

#[test]
fn an_authority_h2_accepts_passes_the_whole_connection_through_untouched() {
    for good in [&b"localhost"[..], b"localhost:50051", b"lookout"] {
        let input = connection(&[(1, first_block(good)), (3, vec![0x83, 0x86, 0xbf, 0xbe])]);
        let (out, r) = run(&input);
        assert_eq!(out, input, "{}", String::from_utf8_lossy(good));
        assert!(r.passing());
        assert_eq!(r.rewritten(), 0);
    }
    // No authority at all: also untouched.
    let input = connection(&[(1, vec![0x83, 0x86, 0x84])]);
    assert_eq!(run(&input).0, input);
}

#[test]
fn the_output_is_the_same_however_the_input_is_cut() {
    let input = connection(&[
        (1, first_block(b"tmp%2Fx.sock")),
        (3, vec![0x83, 0x86, 0xbf, 0xbe]),
    ]);
    let (whole, _) = run(&input);
    for cut in [1, 2, 7, 9, 10, 24, 25, 100] {
        let mut r = Rewriter::new();
        let mut out = Vec::new();
        for piece in input.chunks(cut) {
            r.feed(piece, &mut out).expect("feeds");
        }
        assert_eq!(out, whole, "cut every {cut} bytes");
    }
}

#[test]
fn padding_priority_and_continuations_are_read_and_a_large_block_is_split() {
    let mut block = first_block(b"tmp%2Fx.sock");
    // A 20 KB header: re-encoded, the block needs a CONTINUATION.
    block.push(0x40);
    string(&mut block, b"x-big");
    string(&mut block, &vec![b'a'; 20_000]);
    let (a, b) = block.split_at(100);
    let mut payload = vec![4]; // pad length
    payload.extend_from_slice(&[0x80, 0, 0, 0, 16]); // priority: exclusive on 0
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0; 4]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload));
    input.extend(frame(CONTINUATION, END_HEADERS, 5, b));
    let (out, _) = run(&input);
    let frames = frames_of(&out[PREFACE.len()..]);
    assert_eq!(frames[0].0, HEADERS);
    assert_eq!(
        frames[0].1,
        END_STREAM | PRIORITY,
        "END_HEADERS on the last frame only"
    );
    assert_eq!(&frames[0].3[..5], &[0x80, 0, 0, 0, 16]);
    assert!(frames.iter().all(|f| f.3.len() <= OUT_FRAME));
    assert_eq!(
        frames.last().map(|f| (f.0, f.1)),
        Some((CONTINUATION, END_HEADERS))
    );
    let blocks = h2_reads(&out);
    assert_eq!(authority(&blocks[0]), Some("localhost"));
    assert_eq!(blocks[0].last().map(|f| f.1.len()), Some(20_000));
}

#[test]
fn bad_blocks_end_the_connection_with_a_reason() {
    let feed = |input: &[u8]| {
        let mut out = Vec::new();
        Rewriter::new().feed(input, &mut out)
    };
    let mut too_big = PREFACE.to_vec();
    too_big.extend(frame(HEADERS, 0, 1, &vec![0; MAX_HEADER_BLOCK + 1]));
    assert!(matches!(feed(&too_big), Err(Error::BlockTooLarge)));

    let mut interrupted = PREFACE.to_vec();
    interrupted.extend(frame(HEADERS, 0, 1, &[0x83]));
    interrupted.extend(frame(0x0, 0, 1, &[]));
    assert!(matches!(feed(&interrupted), Err(Error::Interrupted(1, 0))));

    let mut padded_too_much = PREFACE.to_vec();
    padded_too_much.extend(frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x83]));
    assert!(matches!(
        feed(&padded_too_much),
        Err(Error::MalformedHeaders(1))
    ));

    // An index beyond the (empty) dynamic table.
    let mut undecodable = PREFACE.to_vec();
    undecodable.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0x10]));
    let e = feed(&undecodable).expect_err("bad index");
    assert!(e.to_string().contains("does not decode"), "{e}");
}

#[test]
fn what_is_not_http2_passes_through() {
    let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    let (out, r) = run(input);
    assert_eq!(out, input);
    assert!(r.passing());
}

/// A block that fills the table with one 4 KiB entry, then refers to it
/// `refs` times with one byte each.
fn amplifying(refs: usize, authority: bool) -> Vec<u8> {
    let mut block = vec![0x40];
    string(&mut block, b"a");
    string(&mut block, &vec![b'x'; 4000]);
    if authority {
        block.push(0x01); // :authority without indexing (static 1)
        string(&mut block, b"a b");
    }
    block.extend(std::iter::repeat_n(0xbe, refs));
    block
}

fn verdict(block: &[u8]) -> Result<Vec<u8>, Error> {
    let mut input = PREFACE.to_vec();
    for chunk in block.chunks(OUT_FRAME).enumerate() {
        let (i, bytes) = chunk;
        let last = (i + 1) * OUT_FRAME >= block.len();
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        input.extend(frame(kind, if last { END_HEADERS } else { 0 }, 1, bytes));
    }
    let mut out = Vec::new();
    Rewriter::new().feed(&input, &mut out).map(|()| out)
}

#[test]
fn a_small_block_that_decodes_to_a_huge_list_is_refused_without_copies() {
    // 60 000 one-byte references to a 4 KiB entry: 240 MB decoded.
    for authority in [false, true] {
        let e = verdict(&amplifying(60_000, authority)).expect_err("refused");
        assert!(
            matches!(e, Error::OverLimits { .. }) && e.to_string().contains("fields"),
            "{e}"
        );
    }
    // Under the field limit, the decoded size decides.
    let e = verdict(&amplifying(40, true)).expect_err("refused");
    assert!(e.to_string().contains("decoded"), "{e}");
    // A few references are fine.
    assert!(verdict(&amplifying(10, true)).is_ok());
}

#[test]
fn blocks_of_many_huffman_strings_or_fields_are_refused() {
    // `accept-charset` (static 15) with an empty Huffman value, repeated.
    let huffman: Vec<u8> = std::iter::repeat_n([0x0f, 0x00, 0x80], MAX_HUFFMAN_STRINGS + 1)
        .flatten()
        .collect();
    let e = verdict(&huffman).expect_err("refused");
    assert!(e.to_string().contains("Huffman strings"), "{e}");
    let plain: Vec<u8> = std::iter::repeat_n(0x83, MAX_FIELDS + 1).collect();
    let e = verdict(&plain).expect_err("refused");
    assert!(e.to_string().contains("fields"), "{e}");
    // At the limits: decoded.
    let huffman: Vec<u8> = std::iter::repeat_n([0x0f, 0x00, 0x80], MAX_HUFFMAN_STRINGS)
        .flatten()
        .collect();
    assert!(verdict(&huffman).is_ok());
}

#[test]
fn the_shape_walk_counts_what_the_decoder_reads() {
    let block = first_block(b"tmp%2Fx.sock");
    assert_eq!(shape(&block), Ok((5, 0)));
    assert_eq!(shape(&[0x00, 0x81, 0xff, 0x81, 0xff]), Ok((1, 2)));
    assert!(shape(&[0x40, 0x05, b'a']).is_err(), "truncated");
    assert!(
        shape(&[0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]).is_err(),
        "long integer"
    );
}
