//! Circles in the arrows between sibling modules: a pure function over edges.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;

use crate::{Rule, Violation};

/// A reference from one module to another, drawn between the two children of their closest
/// common ancestor (`level`) that hold them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Edge {
    /// The path of the common ancestor from the crate root (empty: the root).
    pub level: Vec<String>,
    /// The child that holds the referring code.
    pub from: String,
    /// The child the path leads into.
    pub to: String,
    /// Where the reference is, relative to the workspace.
    pub file: PathBuf,
    pub line: usize,
    /// The path as written.
    pub text: String,
}

/// One violation for each set of sibling modules of `krate` that reach each other (a strongly
/// connected component of two or more), naming one shortest circle through it with the code
/// that draws each arrow.
pub(crate) fn circles(krate: &str, edges: &[Edge]) -> Vec<Violation> {
    // The first reference of each arrow is its evidence.
    let mut levels: BTreeMap<&[String], BTreeMap<(&str, &str), &Edge>> = BTreeMap::new();
    for edge in edges {
        levels
            .entry(&edge.level)
            .or_default()
            .entry((&edge.from, &edge.to))
            .or_insert(edge);
    }
    let mut violations = Vec::new();
    for (level, arrows) in levels {
        let mut next: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for &(from, to) in arrows.keys() {
            next.entry(from).or_default().insert(to);
            next.entry(to).or_default();
        }
        for component in components(&next) {
            let circle = shortest_circle(&next, &component);
            let mut steps = Vec::new();
            for pair in circle.windows(2) {
                let edge = arrows[&(pair[0], pair[1])];
                steps.push(format!(
                    "{} -> {} ({}:{} `{}`)",
                    pair[0],
                    pair[1],
                    edge.file.display(),
                    edge.line,
                    edge.text
                ));
            }
            let first = arrows[&(circle[0], circle[1])];
            let parent = if level.is_empty() {
                "the crate root".to_owned()
            } else {
                format!("`{}`", level.join("::"))
            };
            violations.push(Violation {
                rule: Rule::ImportCircle,
                file: first.file.clone(),
                line: Some(first.line),
                message: format!(
                    "{krate}: the modules {} under {parent} import each other: {}. Move what \
                     they share into a module that imports neither, or pass it in",
                    component
                        .iter()
                        .map(|m| format!("`{m}`"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    steps.join(", ")
                ),
            });
        }
    }
    violations
}

/// The strongly connected components of two or more nodes (Tarjan's algorithm), each sorted.
fn components<'a>(next: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Vec<Vec<&'a str>> {
    struct Walk<'a, 'g> {
        next: &'g BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<&'a str>>,
    }
    impl<'a> Walk<'a, '_> {
        fn visit(&mut self, node: &'a str) {
            let order = self.index.len();
            self.index.insert(node, order);
            self.low.insert(node, order);
            self.stack.push(node);
            self.on_stack.insert(node);
            for &to in &self.next[node] {
                if !self.index.contains_key(to) {
                    self.visit(to);
                    let low = self.low[node].min(self.low[to]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(to) {
                    let low = self.low[node].min(self.index[to]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    component.push(member);
                    if member == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort_unstable();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        next,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for &node in next.keys() {
        if !walk.index.contains_key(node) {
            walk.visit(node);
        }
    }
    walk.found.sort();
    walk.found
}

/// A shortest circle from the component's first node back to it, through the component, with
/// that node at both ends.
fn shortest_circle<'a>(
    next: &BTreeMap<&'a str, BTreeSet<&'a str>>,
    component: &[&'a str],
) -> Vec<&'a str> {
    let start = component[0];
    let inside: BTreeSet<&str> = component.iter().copied().collect();
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(node) = queue.pop_front() {
        for &to in &next[node] {
            if to == start {
                // Back from `node` to `start` (the one node without a parent), then round.
                let mut circle = vec![node];
                let mut at = node;
                while let Some(&before) = parent.get(at) {
                    circle.push(before);
                    at = before;
                }
                circle.reverse();
                circle.push(start);
                return circle;
            }
            if to != start && inside.contains(to) && !parent.contains_key(to) {
                parent.insert(to, node);
                queue.push_back(to);
            }
        }
    }
    // A component of two or more always has a circle through each of its nodes.
    component.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(from: &str, to: &str) -> Edge {
        Edge {
            level: Vec::new(),
            from: from.into(),
            to: to.into(),
            file: PathBuf::from(format!("src/{from}.rs")),
            line: 1,
            text: format!("crate::{to}::X"),
        }
    }

    #[test]
    fn a_chain_has_no_circle() {
        assert!(circles("c", &[edge("a", "b"), edge("b", "c"), edge("a", "c")]).is_empty());
    }

    #[test]
    fn a_circle_of_three_is_named_in_order() {
        let found = circles(
            "c",
            &[
                edge("a", "b"),
                edge("b", "c"),
                edge("c", "a"),
                edge("c", "d"),
            ],
        );
        assert_eq!(found.len(), 1, "{found:?}");
        let message = &found[0].message;
        assert!(message.contains("`a`, `b`, `c`"), "{message}");
        assert!(
            message.contains(
                "a -> b (src/a.rs:1 `crate::b::X`), b -> c (src/b.rs:1 `crate::c::X`), c -> a"
            ),
            "{message}"
        );
    }

    #[test]
    fn two_separate_circles_are_two_violations() {
        let found = circles(
            "c",
            &[
                edge("a", "b"),
                edge("b", "a"),
                edge("x", "y"),
                edge("y", "x"),
            ],
        );
        assert_eq!(found.len(), 2, "{found:?}");
    }

    #[test]
    fn the_same_names_at_two_levels_are_two_graphs() {
        let mut inner = edge("b", "a");
        inner.level = vec!["m".into()];
        assert!(circles("c", &[edge("a", "b"), inner]).is_empty());
    }

    #[test]
    fn the_shortest_circle_is_shown() {
        let found = circles(
            "c",
            &[
                edge("a", "b"),
                edge("b", "c"),
                edge("c", "a"),
                edge("b", "a"),
            ],
        );
        assert_eq!(found.len(), 1);
        assert!(
            found[0]
                .message
                .contains("a -> b (src/a.rs:1 `crate::b::X`), b -> a"),
            "{}",
            found[0].message
        );
    }
}
