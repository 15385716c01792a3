//! One target's module tree, read from its root file with `syn`, and the references between
//! its modules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proc_macro2::{Spacing, TokenStream, TokenTree};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Attribute, ImplItem, Item, Meta, TraitItem, UseTree};

use crate::graph::Edge;
use crate::{Error, Rule, Violation, read, relative};

/// How many `use` hops a path is followed through before the search gives up (a `use` that
/// names itself ends there).
const MAX_HOPS: u8 = 8;

/// The modules of one target (a library, binary, example, test or build script), every path
/// its code names, and the files only `#[cfg(test)]` brings in.
#[derive(Debug)]
pub(crate) struct Tree {
    root: PathBuf,
    modules: Vec<Module>,
    references: Vec<Reference>,
    path_attributes: Vec<(PathBuf, usize)>,
    /// Files brought in by `#[cfg(test)] mod …;`: tests alone, for the size limits.
    pub test_files: Vec<PathBuf>,
}

#[derive(Debug)]
struct Module {
    /// Its path from the crate root (empty for the root).
    path: Vec<String>,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// What its `use` declarations bring in: the name, and the path as written there.
    imports: BTreeMap<String, Vec<String>>,
    /// The paths of its glob imports (`use super::*`), as written.
    globs: Vec<Vec<String>>,
}

/// A path of two or more segments named in a module, as written.
#[derive(Debug)]
struct Reference {
    module: usize,
    segments: Vec<String>,
    file: PathBuf,
    line: usize,
}

impl Tree {
    /// Reads the tree whose root file is `file`. `root` is the workspace's, for messages.
    pub fn read(root: &Path, file: &Path) -> Result<Self, Error> {
        let mut tree = Tree {
            root: root.to_path_buf(),
            modules: vec![Module::new(Vec::new(), None)],
            references: Vec::new(),
            path_attributes: Vec::new(),
            test_files: Vec::new(),
        };
        let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
        tree.load(file, 0, dir)?;
        Ok(tree)
    }

    /// The `#[path]` attributes on its modules.
    pub fn path_attributes(&self) -> impl Iterator<Item = Violation> + '_ {
        self.path_attributes.iter().map(|(file, line)| Violation {
            rule: Rule::PathAttribute,
            file: relative(&self.root, file),
            line: Some(*line),
            message: "a #[path] module: put the file where its module's name says (`a/b.rs` \
                      for `a::b`), so that the tree reads like the module tree"
                .into(),
        })
    }

    /// Every reference between two modules that are not each other's ancestors, as an arrow
    /// between the two children of their closest common ancestor that hold them.
    pub fn edges(&self) -> Vec<Edge> {
        let mut edges = Vec::new();
        for reference in &self.references {
            let Some(absolute) = self.absolute(reference.module, &reference.segments, 0) else {
                continue;
            };
            let from = &self.modules[reference.module].path;
            let to = &self.modules[self.locate(&absolute, 0)].path;
            if to.starts_with(from) || from.starts_with(to) {
                continue;
            }
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            edges.push(Edge {
                level: from[..common].to_vec(),
                from: from[common].clone(),
                to: to[common].clone(),
                file: relative(&self.root, &reference.file),
                line: reference.line,
                text: reference.segments.join("::"),
            });
        }
        edges
    }

    /// `segments`, as written in `module`, as a path from the crate root; `None` for a path
    /// that leaves the crate (another crate, the prelude, a local name).
    fn absolute(&self, module: usize, segments: &[String], hops: u8) -> Option<Vec<String>> {
        let (first, rest) = segments.split_first()?;
        let here = &self.modules[module];
        match first.as_str() {
            "crate" | "$crate" => Some(rest.to_vec()),
            "self" => Some([here.path.as_slice(), rest].concat()),
            "super" => {
                let mut at = module;
                let mut skipped = 0;
                for segment in segments {
                    if segment != "super" {
                        break;
                    }
                    at = self.modules[at].parent?;
                    skipped += 1;
                }
                Some([self.modules[at].path.as_slice(), &segments[skipped..]].concat())
            }
            name => {
                if here.children.contains_key(name) {
                    return Some([here.path.as_slice(), segments].concat());
                }
                if hops >= MAX_HOPS {
                    return None;
                }
                if let Some(imported) = here.imports.get(name) {
                    let target = self.absolute(module, imported, hops + 1)?;
                    return Some([target.as_slice(), rest].concat());
                }
                // `use super::*` brings the parent's modules and imports in by name.
                here.globs.iter().find_map(|glob| {
                    let target = self.absolute(module, glob, hops + 1)?;
                    let held = &self.modules[self.locate(&target, hops + 1)];
                    (held.children.contains_key(name) || held.imports.contains_key(name))
                        .then(|| [target.as_slice(), segments].concat())
                })
            }
        }
    }

    /// The deepest module an absolute path leads into, through modules and `use`s.
    fn locate(&self, absolute: &[String], hops: u8) -> usize {
        let mut at = 0;
        for (i, segment) in absolute.iter().enumerate() {
            let module = &self.modules[at];
            if let Some(&child) = module.children.get(segment) {
                at = child;
                continue;
            }
            if hops < MAX_HOPS
                && let Some(imported) = module.imports.get(segment)
                && let Some(target) = self.absolute(at, imported, hops + 1)
            {
                return self.locate(&[target.as_slice(), &absolute[i + 1..]].concat(), hops + 1);
            }
            break;
        }
        at
    }

    fn load(&mut self, file: &Path, module: usize, dir: PathBuf) -> Result<(), Error> {
        let source = read(file)?;
        let ast = syn::parse_file(&source).map_err(|source| Error::Parse {
            path: file.to_path_buf(),
            source,
        })?;
        let mut collector = Collector {
            tree: self,
            file: file.to_path_buf(),
            module,
            dir,
            error: None,
        };
        for item in &ast.items {
            collector.visit_item(item);
        }
        collector.error.map_or(Ok(()), Err)
    }

    fn add_child(&mut self, parent: usize, name: String) -> usize {
        if let Some(&existing) = self.modules[parent].children.get(&name) {
            // `#[cfg(a)] mod x;` beside `#[cfg(not(a))] mod x;`: one module.
            return existing;
        }
        let path = [
            self.modules[parent].path.as_slice(),
            std::slice::from_ref(&name),
        ]
        .concat();
        self.modules.push(Module::new(path, Some(parent)));
        let index = self.modules.len() - 1;
        self.modules[parent].children.insert(name, index);
        index
    }
}

impl Module {
    fn new(path: Vec<String>, parent: Option<usize>) -> Self {
        Module {
            path,
            parent,
            children: BTreeMap::new(),
            imports: BTreeMap::new(),
            globs: Vec::new(),
        }
    }
}

/// Walks one file's items for a [`Tree`].
struct Collector<'a> {
    tree: &'a mut Tree,
    file: PathBuf,
    /// The module whose items are being read.
    module: usize,
    /// Where that module's `mod x;` files are.
    dir: PathBuf,
    error: Option<Error>,
}

impl Collector<'_> {
    fn module(&mut self, item: &syn::ItemMod) {
        let name = item.ident.to_string();
        let line = item.span().start().line;
        let path = path_attribute(&item.attrs);
        if path.is_some() {
            self.tree.path_attributes.push((self.file.clone(), line));
        }
        let child = self.tree.add_child(self.module, name.clone());
        if let Some((_, items)) = &item.content {
            let outer = (self.module, self.dir.clone());
            self.module = child;
            self.dir = self.dir.join(&name);
            for item in items {
                self.visit_item(item);
            }
            (self.module, self.dir) = outer;
            return;
        }
        let Some((file, dir)) = self.module_file(&name, path.as_deref()) else {
            // A file cargo would not find either fails the build, not this check.
            return;
        };
        if let Err(error) = self.tree.load(&file, child, dir) {
            self.error.get_or_insert(error);
        }
    }

    /// The file of `mod name;` and the directory of its own `mod` files.
    fn module_file(&self, name: &str, path: Option<&str>) -> Option<(PathBuf, PathBuf)> {
        if let Some(path) = path {
            let file = self.file.parent()?.join(path);
            let dir = file.parent()?.to_path_buf();
            return file.is_file().then_some((file, dir));
        }
        let flat = self.dir.join(format!("{name}.rs"));
        if flat.is_file() {
            return Some((flat, self.dir.join(name)));
        }
        let nested = self.dir.join(name).join("mod.rs");
        nested.is_file().then(|| (nested, self.dir.join(name)))
    }

    fn test_module(&mut self, item: &syn::ItemMod) {
        if item.content.is_none()
            && let Some((file, _)) = self.module_file(
                &item.ident.to_string(),
                path_attribute(&item.attrs).as_deref(),
            )
        {
            self.tree.test_files.push(file);
        }
    }

    fn use_tree(&mut self, tree: &UseTree, prefix: &mut Vec<String>, line: usize) {
        match tree {
            UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(&path.tree, prefix, line);
                prefix.pop();
            }
            UseTree::Name(name) => self.import(prefix, &name.ident, None, line),
            UseTree::Rename(rename) => {
                self.import(prefix, &rename.ident, Some(&rename.rename), line)
            }
            UseTree::Glob(_) => {
                self.tree.modules[self.module].globs.push(prefix.clone());
                self.reference(prefix.clone(), line);
            }
            UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(tree, prefix, line);
                }
            }
        }
    }

    fn import(
        &mut self,
        prefix: &[String],
        ident: &syn::Ident,
        rename: Option<&syn::Ident>,
        line: usize,
    ) {
        let full = if ident == "self" {
            prefix.to_vec()
        } else {
            [prefix, &[ident.to_string()]].concat()
        };
        let Some(last) = full.last() else { return };
        let name = rename.map_or_else(|| last.clone(), ToString::to_string);
        if name != "_" {
            let imports = &mut self.tree.modules[self.module].imports;
            imports.entry(name).or_insert_with(|| full.clone());
        }
        self.reference(full, line);
    }

    fn reference(&mut self, segments: Vec<String>, line: usize) {
        if segments.len() < 2 {
            return;
        }
        self.tree.references.push(Reference {
            module: self.module,
            segments,
            file: self.file.clone(),
            line,
        });
    }

    /// `crate::…`, `$crate::…`, `super::…` and `self::…` paths in a macro's tokens.
    fn macro_tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < tokens.len() {
            match &tokens[i] {
                TokenTree::Group(group) => self.macro_tokens(group.stream()),
                TokenTree::Ident(ident)
                    if matches!(ident.to_string().as_str(), "crate" | "super" | "self") =>
                {
                    let line = ident.span().start().line;
                    let mut segments = vec![ident.to_string()];
                    while let [
                        TokenTree::Punct(a),
                        TokenTree::Punct(b),
                        TokenTree::Ident(next),
                        ..,
                    ] = &tokens[i + 1..]
                        && a.as_char() == ':'
                        && a.spacing() == Spacing::Joint
                        && b.as_char() == ':'
                    {
                        segments.push(next.to_string());
                        i += 3;
                    }
                    self.reference(segments, line);
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast Item) {
        if is_test(item_attributes(item)) {
            if let Item::Mod(module) = item {
                self.test_module(module);
            }
            return;
        }
        match item {
            Item::Mod(module) => self.module(module),
            Item::Use(item) if item.leading_colon.is_none() => {
                self.use_tree(&item.tree, &mut Vec::new(), item.span().start().line);
            }
            Item::Use(_) => {}
            _ => visit::visit_item(self, item),
        }
    }

    fn visit_impl_item(&mut self, item: &'ast ImplItem) {
        let attributes = match item {
            ImplItem::Const(i) => &i.attrs,
            ImplItem::Fn(i) => &i.attrs,
            ImplItem::Type(i) => &i.attrs,
            ImplItem::Macro(i) => &i.attrs,
            _ => return visit::visit_impl_item(self, item),
        };
        if !is_test(attributes) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_trait_item(&mut self, item: &'ast TraitItem) {
        let attributes = match item {
            TraitItem::Const(i) => &i.attrs,
            TraitItem::Fn(i) => &i.attrs,
            TraitItem::Type(i) => &i.attrs,
            TraitItem::Macro(i) => &i.attrs,
            _ => return visit::visit_trait_item(self, item),
        };
        if !is_test(attributes) {
            visit::visit_trait_item(self, item);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.reference(segments, path.span().start().line);
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        visit::visit_macro(self, mac);
        self.macro_tokens(mac.tokens.clone());
    }
}

/// The attributes of an item.
pub(crate) fn item_attributes(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// Whether the attributes compile the item for tests only: `#[cfg(test)]`, or an
/// `#[cfg(all(…))]` that requires `test`.
pub(crate) fn is_test(attributes: &[Attribute]) -> bool {
    fn requires_test(meta: &Meta) -> bool {
        match meta {
            Meta::Path(path) => path.is_ident("test"),
            Meta::List(list) if list.path.is_ident("all") => list
                .parse_args_with(Punctuated::<Meta, syn::Token![,]>::parse_terminated)
                .is_ok_and(|metas| metas.iter().any(requires_test)),
            _ => false,
        }
    }
    attributes.iter().any(|attribute| {
        attribute.path().is_ident("cfg")
            && attribute
                .parse_args::<Meta>()
                .is_ok_and(|meta| requires_test(&meta))
    })
}

/// The value of a `#[path = "…"]` attribute.
fn path_attribute(attributes: &[Attribute]) -> Option<String> {
    attributes
        .iter()
        .find_map(|attribute| match &attribute.meta {
            Meta::NameValue(pair) if pair.path.is_ident("path") => match &pair.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(path),
                    ..
                }) => Some(path.value()),
                _ => None,
            },
            _ => None,
        })
}
