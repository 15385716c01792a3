//! The tidy test: this repository's structure, checked on every `cargo test`, and the checks'
//! own tests on small fixture workspaces that each break one rule.

use std::path::Path;

use lookout_tidy::{Config, Rule, Violation, check};

/// This repository's limits and exceptions. Each exception says why; a file may shrink below its
/// number but not grow past it, and an exception that no longer applies fails as stale.
fn lookout() -> Config {
    Config::new()
        // Published crates that exist to serve or use the wire API.
        .allow_api(
            "lookout-client",
            "the API's own client: the contract is its purpose",
        )
        .allow_api(
            "lookout-agent",
            "the binary that serves the API; nothing reuses it as a library",
        )
        .allow_size(
            "crates/lookout-agent/tests/run.rs",
            2147,
            "the `lookout run` end-to-end suite: one binary, as ripgrep keeps one per area; to \
             be split by area (start-up, exits, hooks, signals)",
        )
        .allow_size(
            "crates/lookout-inode-map/src/snapshot.rs",
            960,
            "one versioned on-disk format, its reader and writer side by side",
        )
        .allow_size(
            "crates/lookout-inode-map/examples/stablefs.rs",
            854,
            "a whole FUSE file system in one example file, so that it reads top to bottom",
        )
        .allow_size(
            "crates/lookout-nri/src/plugin.rs",
            840,
            "NRI's plugin protocol: registration, the resync and the held calls, one state",
        )
        .allow_size(
            "crates/lookout-testsupport/src/apiserver.rs",
            838,
            "the hand-written API server, kept until the test API server from Kubernetes' own \
             library replaces it (issue #59)",
        )
}

#[test]
fn the_workspace_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let violations = check(&root, &lookout()).unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert!(
        violations.is_empty(),
        "the tree breaks {} structure rule(s) (see crates/lookout-tidy/src/lib.rs):\n{}",
        violations.len(),
        violations
            .iter()
            .map(|v| format!("  {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// A workspace in a temporary directory: crates `a` (a library with a few modules) and `b`
/// (which uses `a`), and the arrow list that allows exactly that. Each test breaks one rule.
struct Fixture {
    dir: tempfile::TempDir,
}

const ARROWS: &str = "# Architecture\n\n<!-- tidy:arrows -->\n```text\na -> \nb -> a\n```\n";

impl Fixture {
    fn new() -> Self {
        let fixture = Fixture {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        fixture
            .file(
                "Cargo.toml",
                "[workspace]\nmembers = [\"crates/a\", \"crates/b\"]\n",
            )
            .file("docs/architecture.md", ARROWS)
            .file("crates/a/Cargo.toml", &manifest("a", "", ""))
            .file(
                "crates/a/src/lib.rs",
                "mod model;\nmod store;\nmod hub;\npub use store::Store;\n\
                 pub struct Root;\n#[cfg(test)]\nmod tests;\n",
            )
            .file("crates/a/src/model.rs", "pub struct Container;\n")
            .file(
                "crates/a/src/store.rs",
                "use crate::model::Container;\npub struct Store(Vec<Container>);\n\
                 pub fn root() -> crate::Root { crate::Root }\n",
            )
            // A parent that uses its children, and children that use their parent and an
            // uncle: no circle.
            .file(
                "crates/a/src/hub/mod.rs",
                "mod gate;\nmod watch;\npub struct Hub;\n\
                 pub fn both() { gate::open(); watch::queue(); }\n",
            )
            .file(
                "crates/a/src/hub/gate.rs",
                "use super::Hub;\npub fn open() -> Hub { super::watch::queue(); Hub }\n",
            )
            .file(
                "crates/a/src/hub/watch.rs",
                "pub fn queue() { let _ = crate::Store(Vec::new()); }\n\
                 #[cfg(test)]\nmod tests { fn t() { super::super::gate::open(); } }\n",
            )
            // Tests that use everything are no arrows.
            .file(
                "crates/a/src/tests.rs",
                "use crate::hub::Hub;\nuse crate::model::Container;\n",
            )
            .file(
                "crates/b/Cargo.toml",
                &manifest("b", "a = { path = \"../a\" }", ""),
            )
            .file("crates/b/src/main.rs", "fn main() { let _ = a::Root; }\n");
        fixture
    }

    fn file(&self, path: &str, text: &str) -> &Self {
        let path = self.dir.path().join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
        self
    }

    fn check(&self, config: &Config) -> Vec<Violation> {
        check(self.dir.path(), config).unwrap_or_else(|e| panic!("{}", chain(&e)))
    }

    /// The violations of one rule, as text.
    fn broken(&self, rule: Rule, config: &Config) -> Vec<String> {
        self.check(config)
            .into_iter()
            .filter(|v| v.rule == rule)
            .map(|v| v.to_string())
            .collect()
    }
}

fn manifest(name: &str, dependencies: &str, rest: &str) -> String {
    format!(
        "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\n{rest}\n\
         [dependencies]\n{dependencies}\n"
    )
}

/// The one violation of `rule`, whose text must contain every one of `needles`.
#[track_caller]
fn one(found: Vec<String>, needles: &[&str]) {
    assert_eq!(found.len(), 1, "expected one violation, got {found:#?}");
    for needle in needles {
        assert!(found[0].contains(needle), "{needle:?} not in {}", found[0]);
    }
}

#[test]
fn the_fixture_is_tidy() {
    // Without this, every test below could pass on a checker that fails everything.
    assert_eq!(Fixture::new().check(&Config::new()), Vec::new());
}

#[test]
fn two_modules_that_import_each_other_fail() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/model.rs",
        "use crate::store::Store;\npub struct Container;\npub fn all() -> Option<Store> { None }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &[
            "crates/a/src/model.rs:1",
            "the modules `model`, `store` under the crate root",
            "model -> store (crates/a/src/model.rs:1 `crate::store::Store`)",
            "store -> model (crates/a/src/store.rs:1 `crate::model::Container`)",
        ],
    );
}

#[test]
fn a_circle_between_nested_siblings_fails_at_their_level() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/hub/watch.rs",
        "pub fn queue() { super::gate::open(); }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &[
            "under `hub`",
            "gate -> watch",
            "watch -> gate (crates/a/src/hub/watch.rs:1 `super::gate::open`)",
        ],
    );
}

#[test]
fn a_circle_through_a_reexport_fails() {
    // `crate::Store` is `store::Store`, re-exported by the root.
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/model.rs",
        "pub struct Container;\npub fn kept() -> Option<crate::Store> { None }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &["model -> store (crates/a/src/model.rs:2 `crate::Store`)"],
    );
}

#[test]
fn a_circle_through_a_glob_import_fails() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/hub/watch.rs",
        "use super::*;\npub fn queue() { gate::open(); }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &["watch -> gate (crates/a/src/hub/watch.rs:2 `gate::open`)"],
    );
}

#[test]
fn a_circle_inside_a_macro_call_fails() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/model.rs",
        "pub struct Container;\npub fn f() { let _ = vec![crate::store::root()]; }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &["model -> store (crates/a/src/model.rs:2 `crate::store::root`)"],
    );
}

#[test]
fn a_circle_through_a_third_module_names_the_whole_loop() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/model.rs",
        "pub struct Container;\npub fn f() { crate::hub::both(); }\n",
    );
    one(
        fixture.broken(Rule::ImportCircle, &Config::new()),
        &[
            "`hub`, `model`, `store`",
            "hub -> store",
            "store -> model",
            "model -> hub",
        ],
    );
}

#[test]
fn an_arrow_the_list_does_not_allow_fails() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/Cargo.toml",
        &manifest("a", "b = { path = \"../b\" }", ""),
    );
    one(
        fixture.broken(Rule::CrateArrow, &Config::new()),
        &[
            "crates/a/Cargo.toml",
            "a depends on b ([dependencies])",
            "docs/architecture.md",
        ],
    );
}

#[test]
fn a_listed_arrow_that_no_manifest_has_fails() {
    let fixture = Fixture::new();
    fixture.file("crates/b/Cargo.toml", &manifest("b", "", ""));
    fixture.file("crates/b/src/main.rs", "fn main() {}\n");
    one(
        fixture.broken(Rule::CrateArrow, &Config::new()),
        &[
            "docs/architecture.md:6",
            "the arrow b -> a is listed, but no manifest has it",
        ],
    );
}

#[test]
fn an_arrow_only_tests_use_belongs_right_of_the_bar() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/b/Cargo.toml",
        &manifest("b", "", "[dev-dependencies]\na = { path = \"../a\" }\n"),
    );
    one(
        fixture.broken(Rule::CrateArrow, &Config::new()),
        &["only its tests use it: list it right of `|`"],
    );
    // Listed right of the bar it passes; the code may not use it then.
    fixture.file(
        "docs/architecture.md",
        &ARROWS.replace("b -> a", "b -> | a"),
    );
    assert_eq!(
        fixture.broken(Rule::CrateArrow, &Config::new()),
        Vec::<String>::new()
    );
    fixture.file(
        "crates/b/Cargo.toml",
        &manifest("b", "a = { path = \"../a\" }", ""),
    );
    one(
        fixture.broken(Rule::CrateArrow, &Config::new()),
        &["b depends on a ([dependencies])"],
    );
}

#[test]
fn a_crate_without_a_line_in_the_list_fails() {
    let fixture = Fixture::new();
    fixture.file("docs/architecture.md", &ARROWS.replace("a -> \n", ""));
    let found = fixture.broken(Rule::CrateArrow, &Config::new());
    assert!(
        found
            .iter()
            .any(|v| v.contains("`a` has no line in the arrow list")),
        "{found:#?}"
    );
}

#[test]
fn a_published_crate_on_the_wire_api_fails_even_for_its_examples() {
    let fixture = Fixture::new();
    fixture
        .file(
            "Cargo.toml",
            "[workspace]\nmembers = [\"crates/a\", \"crates/b\", \"crates/lookout-api\"]\n",
        )
        .file(
            "docs/architecture.md",
            &ARROWS.replace("b -> a", "b -> a | lookout-api\nlookout-api ->"),
        )
        .file(
            "crates/lookout-api/Cargo.toml",
            &manifest("lookout-api", "", ""),
        )
        .file("crates/lookout-api/src/lib.rs", "")
        .file(
            "crates/b/Cargo.toml",
            &manifest(
                "b",
                "a = { path = \"../a\" }",
                "[dev-dependencies]\nlookout-api = { path = \"../lookout-api\" }\n",
            ),
        );
    one(
        fixture.broken(Rule::PublishedOnApi, &Config::new()),
        &[
            "crates/b/Cargo.toml",
            "b is published and depends on lookout-api",
        ],
    );
    // Unpublished, or excepted, it passes; an exception nobody needs fails as stale.
    let excepted = Config::new().allow_api("b", "b serves the API");
    assert_eq!(
        fixture.broken(Rule::PublishedOnApi, &excepted),
        Vec::<String>::new()
    );
    let stale = Config::new().allow_api("a", "no reason any more");
    assert_eq!(fixture.broken(Rule::PublishedOnApi, &stale).len(), 2);
    fixture.file(
        "crates/b/Cargo.toml",
        &manifest(
            "b",
            "a = { path = \"../a\" }",
            "publish = false\n[dev-dependencies]\nlookout-api = { path = \"../lookout-api\" }\n",
        ),
    );
    assert_eq!(
        fixture.broken(Rule::PublishedOnApi, &Config::new()),
        Vec::<String>::new()
    );
}

#[test]
fn a_path_module_fails() {
    let fixture = Fixture::new();
    fixture
        .file(
            "crates/a/src/lib.rs",
            "mod model;\nmod store;\nmod hub;\npub use store::Store;\npub struct Root;\n\
             #[path = \"elsewhere.rs\"]\nmod other;\n",
        )
        .file("crates/a/src/elsewhere.rs", "");
    one(
        fixture.broken(Rule::PathAttribute, &Config::new()),
        &["crates/a/src/lib.rs:6", "a #[path] module"],
    );
}

#[test]
fn a_file_over_its_limit_fails_and_its_tests_do_not_count() {
    let fixture = Fixture::new();
    let code = "pub fn f() {}\n".repeat(8);
    let tests = format!(
        "#[cfg(test)]\nmod tests {{\n{}}}\n",
        "    fn t() {}\n".repeat(20)
    );
    fixture.file(
        "crates/a/src/model.rs",
        &format!("pub struct Container;\n{code}{tests}"),
    );
    let config = Config::new().code_lines(10).test_lines(30);
    assert_eq!(
        fixture.broken(Rule::FileSize, &config),
        Vec::<String>::new()
    );
    fixture.file(
        "crates/a/src/model.rs",
        &format!("pub struct Container;\n{code}{code}{tests}"),
    );
    one(
        fixture.broken(Rule::FileSize, &config),
        &[
            "crates/a/src/model.rs",
            "17 lines of code, over the limit of 10",
        ],
    );
    // A file of tests alone has the test limit.
    fixture.file("crates/a/tests/big.rs", &"fn t() {}\n".repeat(31));
    let found = fixture.broken(Rule::FileSize, &config);
    assert!(
        found
            .iter()
            .any(|v| v.contains("crates/a/tests/big.rs: [file-size] 31 lines of tests")),
        "{found:#?}"
    );
}

#[test]
fn a_size_exception_may_shrink_but_not_grow_and_goes_when_it_fits() {
    let fixture = Fixture::new();
    fixture.file(
        "crates/a/src/model.rs",
        &"pub struct Container;\n".repeat(12),
    );
    let limit = |allowed| {
        Config::new()
            .code_lines(10)
            .allow_size("crates/a/src/model.rs", allowed, "one format")
    };
    assert_eq!(
        fixture.broken(Rule::FileSize, &limit(12)),
        Vec::<String>::new()
    );
    assert_eq!(
        fixture.broken(Rule::FileSize, &limit(14)),
        Vec::<String>::new()
    );
    one(
        fixture.broken(Rule::FileSize, &limit(11)),
        &["12 lines of code: it grew past its exception (11 lines: one format)"],
    );
    fixture.file("crates/a/src/model.rs", "pub struct Container;\n");
    one(
        fixture.broken(Rule::FileSize, &limit(12)),
        &["fits the limit of 10 now: remove its size exception"],
    );
    let gone = Config::new().allow_size("crates/a/src/gone.rs", 900, "was big");
    one(
        fixture.broken(Rule::FileSize, &gone),
        &["names a file that is gone"],
    );
}

#[test]
fn unreadable_trees_are_errors_not_passes() {
    let fixture = Fixture::new();
    fixture.file("crates/a/src/store.rs", "pub fn broken( {\n");
    let error = check(fixture.dir.path(), &Config::new()).expect_err("a parse error");
    assert!(
        chain(&error).contains("crates/a/src/store.rs"),
        "{}",
        chain(&error)
    );
    let fixture = Fixture::new();
    fixture.file("docs/architecture.md", "# no list\n");
    let error = check(fixture.dir.path(), &Config::new()).expect_err("no arrow list");
    assert!(chain(&error).contains("tidy:arrows"), "{}", chain(&error));
}
