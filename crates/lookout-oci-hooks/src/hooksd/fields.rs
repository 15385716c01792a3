//! Reading a hook file's JSON one field at a time, so that every refusal
//! names the field (`stages[1]`, `when.annotations["key"]`), which serde's
//! own errors (a line and a column) do not.
//!
//! The rules are those of Go's `encoding/json`, which containers/common
//! uses: an absent key and `null` are the same (the Go field keeps its zero
//! value), unknown keys are ignored, and a key given twice keeps its last
//! value (serde_json's `Map` does that too). Unlike Go, keys are matched
//! exactly, not case-insensitively.

use std::path::{Path, PathBuf};

use regex::Regex;
use serde_json::{Map, Value};

use super::{LoadError, Stage};

/// One JSON object of hook file `file`, `prefix` naming where it is
/// (`""` for the top, `"hook."`, `"when."`).
#[derive(Clone, Copy)]
pub(super) struct Fields<'a> {
    file: &'a Path,
    prefix: &'static str,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The file's top-level object.
    pub(super) fn top(file: &'a Path, map: &'a Map<String, Value>) -> Fields<'a> {
        Fields {
            file,
            prefix: "",
            map,
        }
    }

    /// The full name of member `key` of this object.
    pub(super) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// A refusal of member `key`.
    pub(super) fn refuse(&self, key: &str, reason: String) -> LoadError {
        self.refuse_named(self.name(key), reason)
    }

    /// A refusal of the field named `field` (an element: `stages[1]`).
    pub(super) fn refuse_named(&self, field: String, reason: String) -> LoadError {
        LoadError::Field {
            path: self.file.to_path_buf(),
            field,
            reason,
        }
    }

    /// Member `key`, `None` when it is absent or `null`.
    pub(super) fn value(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, field: String, expected: &str, found: &Value) -> LoadError {
        self.refuse_named(field, format!("expected {expected}, found {}", kind(found)))
    }

    /// Member `key` as a string.
    pub(super) fn string(&self, key: &str) -> Result<Option<&'a str>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(self.name(key), "a string", v)),
        }
    }

    /// Member `key` as a boolean.
    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(self.name(key), "true or false", v)),
        }
    }

    /// Member `key` as a 64-bit integer (no fraction, no exponent).
    pub(super) fn int(&self, key: &str) -> Result<Option<i64>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(i) => Ok(Some(i)),
                None => Err(self.refuse(key, format!("{n} is not a 64-bit integer"))),
            },
            Some(v) => Err(self.wrong(self.name(key), "an integer", v)),
        }
    }

    /// Member `key` as an array of strings; an element of another type is
    /// refused as `key[i]`.
    pub(super) fn strings(&self, key: &str) -> Result<Option<Vec<&'a str>>, LoadError> {
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong(self.name(key), "an array of strings", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.wrong(format!("{}[{i}]", self.name(key)), "a string", other)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// Member `key` as an object of strings; a value of another type is
    /// refused as `key["name"]`.
    pub(super) fn string_map(
        &self,
        key: &str,
    ) -> Result<Option<Vec<(&'a str, &'a str)>>, LoadError> {
        let Some(map) = self.object_map(key)? else {
            return Ok(None);
        };
        map.iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.as_str(), s.as_str())),
                other => Err(self.wrong(format!("{}[{k:?}]", self.name(key)), "a string", other)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// Member `key` as an object, its own members named `prefix...`.
    pub(super) fn object(
        &self,
        key: &str,
        prefix: &'static str,
    ) -> Result<Option<Fields<'a>>, LoadError> {
        Ok(self.object_map(key)?.map(|map| Fields {
            file: self.file,
            prefix,
            map,
        }))
    }

    fn object_map(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, LoadError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(self.wrong(self.name(key), "an object", v)),
        }
    }

    /// Member `key`, a program's path: absolute, as the runtime spec wants
    /// (containers/common only checks that it exists, which for a relative
    /// path depends on the working directory of whoever reads the file).
    pub(super) fn absolute_path(&self, key: &str, p: &str) -> Result<PathBuf, LoadError> {
        let path = PathBuf::from(p);
        if path.is_absolute() {
            Ok(path)
        } else {
            Err(self.refuse(key, format!("{p:?} is not absolute")))
        }
    }

    /// Member `key`'s stages: at least one, each known; an unknown one is
    /// refused as `key[i]`.
    pub(super) fn stages(&self, key: &str, names: &[&str]) -> Result<Vec<Stage>, LoadError> {
        if names.is_empty() {
            return Err(self.refuse(key, "empty (the hook would never run)".into()));
        }
        names
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Stage::parse(s).ok_or_else(|| {
                    self.refuse_named(
                        format!("{}[{i}]", self.name(key)),
                        format!("unknown stage {s:?}"),
                    )
                })
            })
            .collect()
    }

    /// `re` compiled, a refusal of field `field` if it does not compile.
    pub(super) fn regex(&self, field: String, re: &str) -> Result<Regex, LoadError> {
        Regex::new(re).map_err(|source| LoadError::Regex {
            path: self.file.to_path_buf(),
            field,
            regex: re.to_owned(),
            source,
        })
    }
}

/// What a JSON value is, for "expected X, found Y".
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
