//! What every feature stands on rather than one feature: the control plane and the manager's
//! runtime (`cluster`, `runtime`), the shipped deployment (`deploy`), hostile and malformed input
//! (`bad_input`), the security checks (`security`), injected faults (`faults`) and the real local
//! node (`node`, run by hack/node/check.sh, not by hack/test/e2e.sh).

mod bad_input;
mod cluster;
mod deploy;
mod faults;
mod node;
mod runtime;
mod security;
