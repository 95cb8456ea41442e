//! Reading one field of a config file's JSON, with its default, as every config reader of the
//! crate does (vision configs, processor configs).

use serde_json::Value;

/// A positive integer field `name` (its value `value`, absent or null: `default`), else
/// "`name` must be a positive integer".
pub fn positive_int(value: Option<&Value>, default: usize, name: impl std::fmt::Display) -> Result<usize, String> {
    match value {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| format!("`{name}` must be a positive integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_null_and_bad_values() {
        let j = serde_json::json!({ "a": 3, "n": null, "zero": 0, "neg": -1, "s": "4" });
        assert_eq!(positive_int(j.get("a"), 7, "a"), Ok(3));
        assert_eq!(positive_int(j.get("missing"), 7, "missing"), Ok(7));
        assert_eq!(positive_int(j.get("n"), 7, "n"), Ok(7));
        for bad in ["zero", "neg", "s"] {
            assert_eq!(
                positive_int(j.get(bad), 7, format_args!("x.{bad}")),
                Err(format!("`x.{bad}` must be a positive integer"))
            );
        }
    }
}
