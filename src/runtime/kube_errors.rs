//! What an error of the API server means, asked by the writer, the event publisher and the
//! features alike (so that none of them imports another for it).

/// The write was fenced out: 409 (resourceVersion precondition), or a JSON Patch whose `test`
/// failed. The API server answers a failed `test` with a bare 422 Invalid that carries no
/// details (its message names no test); a schema rejection always lists its causes.
pub fn is_fenced_out(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => {
            s.code == 409
                || (s.code == 422 && s.details.as_ref().is_none_or(|d| d.causes.is_empty()))
        }
        _ => false,
    }
}

/// The object (or its namespace) does not exist: HTTP 404.
pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// A create found the name taken: HTTP 409, reason AlreadyExists.
pub fn is_already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists")
}
