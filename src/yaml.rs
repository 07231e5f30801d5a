//! YAML through the crate kube already brings (serde-saphyr). Documents users write (the
//! Jumpstarter ConfigMap, the agent's pools file) are read as a JSON value first and then as
//! their type, so an error names the field (`authentication.k8s.enabled: invalid type: …`)
//! rather than only a line and column, and it stays one line: readiness and conditions show it.

use serde::de::DeserializeOwned;

/// One document; a syntax error says where it is, a type error names the field.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let value: serde_json::Value =
        serde_saphyr::from_str_with_options(text, serde_saphyr::options! { with_snippet: false })
            .map_err(|e| e.to_string())?;
    serde_path_to_error::deserialize(value).map_err(|e| match e.path().to_string() {
        path if path == "." => e.into_inner().to_string(),
        path => format!("{path}: {}", e.into_inner()),
    })
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[allow(dead_code)]
        outer: Inner,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[allow(dead_code)]
        enabled: bool,
    }

    #[test]
    fn errors_name_the_field_on_one_line() {
        let e = super::from_str::<Doc>("outer:\n  enabled: sometimes\n").unwrap_err();
        assert!(e.starts_with("outer.enabled: invalid type"), "{e}");
        let e = super::from_str::<Doc>("outer:\n  enabeld: true\n").unwrap_err();
        assert!(e.contains("unknown field `enabeld`"), "{e}");
        let e = super::from_str::<Doc>("outer: [unclosed\n").unwrap_err();
        assert!(e.contains("line"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
