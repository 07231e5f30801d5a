//! YAML through the crate kube already brings (serde-saphyr). Documents users write (the
//! Jumpstarter ConfigMap, the agent's pools file) are read straight into their type, so a
//! scalar takes the type its field wants (`audiences: [y]` is the string "y"), and through
//! serde_path_to_error, so an error names the field (`authentication.k8s.enabled: …`) on one
//! line: readiness and conditions show it.

use serde::de::DeserializeOwned;

/// One document; an error names the field where there is one, and the line and column.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let options = serde_saphyr::options! { with_snippet: false };
    let mut path = String::new();
    serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = e.path().to_string();
            e.into_inner()
        })
    })
    .map_err(|e| match path.as_str() {
        "" | "." => e.to_string(),
        path => format!("{path}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        outer: Inner,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(default)]
        enabled: bool,
        #[serde(default)]
        names: Vec<String>,
    }

    #[test]
    fn errors_name_the_field_on_one_line() {
        let e = super::from_str::<Doc>("outer:\n  enabled: sometimes\n").unwrap_err();
        assert!(e.starts_with("outer.enabled: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let e = super::from_str::<Doc>("outer:\n  enabeld: true\n").unwrap_err();
        assert!(e.contains("unknown field `enabeld`"), "{e}");
        let e = super::from_str::<Doc>("outer: {enabled: true\n").unwrap_err();
        assert!(e.contains("line"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn scalars_take_the_type_of_their_field() {
        let d: Doc = super::from_str("outer:\n  names: [y, no, '1']\n  enabled: true\n").unwrap();
        assert_eq!(d.outer.names, ["y", "no", "1"]);
        assert!(d.outer.enabled);
    }
}
